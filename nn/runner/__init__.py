"""The device side of a model: :class:`Runner` (buffers, paged KV pool, graphs, step API).

| module | holds |
|---|---|
| :mod:`.runner` | :class:`Runner`: the step API (prefill chunk, decode step, sampling, KV reservation) |
| :mod:`.paged_kv` | :class:`KVCache` (block pools), :class:`BlockAllocator`, :class:`BlockTable`, :class:`KVCacheFull`, KV capacity arithmetic |
| :mod:`.prefix_cache` | :class:`~.prefix_cache.PrefixCache` (cached blocks by prefix hash, LRU of idle ones), :func:`~.prefix_cache.block_hashes` |
| :mod:`.rows` | :class:`~.rows.RowState`: per-row decode and sampling state, device and host shadow |
| :mod:`.forward` | the activation arena, thunk chains, decode buckets, an architecture's layers over the cache |
| :mod:`.decode` | :class:`~.decode.Decoder`: the decode step and its per-bucket graphs |
| :mod:`.prefill` | :class:`~.prefill.Prefiller`: eager and graphed prompt chunks |

The runner imports the architectures' interface (:mod:`deviceops.nn.models`) and the public
``deviceops`` API, never the serving layer.
"""

from __future__ import annotations

from .forward import buckets
from .paged_kv import (
    BlockAllocator,
    BlockTable,
    KVCache,
    KVCacheFull,
    kv_bytes_per_token,
    max_concurrent_sequences,
)
from .prefix_cache import PrefixCache, block_hashes
from .runner import Runner

__all__ = ["BlockAllocator", "BlockTable", "KVCache", "KVCacheFull", "PrefixCache", "Runner",
           "block_hashes", "buckets", "kv_bytes_per_token", "max_concurrent_sequences"]
