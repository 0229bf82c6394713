"""The paged key/value cache: block pools (:class:`KVCache`), the free list of blocks
(:class:`BlockAllocator`), the rows' block table (:class:`BlockTable`), and KV capacity
arithmetic (:func:`kv_bytes_per_token`, :func:`max_concurrent_sequences`).

Per layer, keys and values are one *block pool* ``(num_blocks, Hkv, block_size, D)``
(flash attention's paged k/v layout), allocated once. A sequence in cache row (*slot*)
``b`` owns a list of blocks; the model's block table ``(max_batch, max_blocks)`` int32 in
device memory maps its position ``p`` to row ``p % block_size`` of block
``table[b, p // block_size]``, and both ``rope_kv_write`` (the KV write) and
``flash_attention`` (the read) follow it on the device, so one captured graph serves any
allocation. A sequence holds only the blocks its length needs.

Block 0 is the *null block*: never handed out, it is what a table entry holds before its
block is allocated (so every entry is a valid id; padding keys of a prefill graph past a
row's blocks land there, harmlessly). :class:`BlockAllocator` hands out the others.

Prefix caching (:mod:`.prefix_cache`): blocks are reference-counted; a row's full blocks can
be cached under the hash of their token prefix (:meth:`BlockTable.cache_prefix`) and another
row can point its table at them (:meth:`BlockTable.share_prefix`) instead of writing them.
Cached blocks no row references stay cached (idle) until the allocator needs them (least
recently used first). A row never writes into a cached block (:meth:`BlockTable.frozen`).

Capacity: SmolLM2-135M in float16 needs 23,040 bytes per token (368,640 per 16-token
block), 47.2 MB per 2,048-token sequence (128 blocks). On an H100 with 82.48 GB free after
the CUDA context and weights, that is 1,747 concurrent 2,048-token sequences
(``benchmarks/serve.py`` measured it and allocated a pool of 1,659). Paging does not
change that count at full length; it lets shorter sequences hold only the blocks they
use, so ``max_batch`` rows can share a pool smaller than ``max_batch * max_seq``
positions.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from deviceops import Stream, Tensor, api

from .prefix_cache import PrefixCache

__all__ = ["BlockAllocator", "BlockTable", "KVCache", "KVCacheFull", "kv_bytes_per_token",
           "max_concurrent_sequences"]


class KVCacheFull(RuntimeError):
    """The KV block pool has too few free blocks for what a row must write."""


@dataclass
class KVCache:
    """Keys and values of every layer: ``k[layer]``, ``v[layer]`` ``(num_blocks, Hkv, block_size, D)``."""

    k: list[Tensor]
    v: list[Tensor]

    @classmethod
    def allocate(cls, stream: Stream, *, layers: int, num_blocks: int, kv_heads: int,
                 block_size: int, head_dim: int, dtype: str) -> KVCache:
        """Zero-filled block pools for ``layers`` layers, allocated on ``stream`` now (synchronizing)."""
        shape = (num_blocks, kv_heads, block_size, head_dim)
        k = [api.zeros(shape, dtype).sync_on(stream) for _ in range(layers)]
        v = [api.zeros(shape, dtype).sync_on(stream) for _ in range(layers)]
        return cls(k, v)

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool (the null block 0 included)."""
        return int(self.k[0].shape[0])

    @property
    def block_size(self) -> int:
        """Positions per block."""
        return int(self.k[0].shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes held by every layer's keys and values."""
        return sum(t.nbytes for t in self.k) + sum(t.nbytes for t in self.v)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block costs over every layer, keys and values."""
        return self.nbytes // self.num_blocks

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        """The ``(k, v)`` block pools of layer ``i``."""
        return self.k[i], self.v[i]


class BlockAllocator:
    """Free list of KV blocks ``reserved .. num_blocks-1`` (lowest id first), with reference
    counts and the prefix cache (:class:`~.prefix_cache.PrefixCache`).

    A block handed out by :meth:`acquire` has one reference; :meth:`share` adds one (a row
    pointing at a block another row wrote), :meth:`release` drops one. A block whose count
    reaches zero goes back to the free list, unless it was cached (:meth:`cache`): then it
    stays in the cache, *idle*, until a row shares it again or :meth:`acquire` evicts it
    (least recently used first) because the free list ran short. A referenced block is
    never freed or evicted.

    Args:
        num_blocks: blocks in the pool.
        block_size: positions per block.
        reserved: leading blocks never handed out (the null block).

    Raises:
        ValueError: fewer than one allocatable block, or a non-positive block size.

    Example:
        >>> a = BlockAllocator(9, 16)
        >>> ids = a.acquire(3); ids, a.free, a.in_use
        ([1, 2, 3], 5, 3)
        >>> a.release(ids); a.in_use
        0
    """

    def __init__(self, num_blocks: int, block_size: int, *, reserved: int = 1) -> None:
        if int(block_size) < 1 or int(num_blocks) - int(reserved) < 1 or int(reserved) < 0:
            raise ValueError(f"BlockAllocator: num_blocks={num_blocks} must exceed reserved="
                             f"{reserved} and block_size={block_size} must be >= 1")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.reserved = int(reserved)
        self._free: list[int] = list(range(self.num_blocks - 1, self.reserved - 1, -1))
        self._ref: dict[int, int] = {}  # referenced block -> references
        self.prefix = PrefixCache()

    @property
    def capacity(self) -> int:
        """Blocks that can be handed out (all but the reserved ones)."""
        return self.num_blocks - self.reserved

    @property
    def free(self) -> int:
        """Blocks available to :meth:`acquire`: the free list and the idle cached blocks."""
        return len(self._free) + self.prefix.idle

    @property
    def in_use(self) -> int:
        """Blocks referenced by rows (a block shared by several rows counts once)."""
        return len(self._ref)

    @property
    def cached(self) -> int:
        """Blocks in the prefix cache, referenced or idle."""
        return len(self.prefix)

    @property
    def idle(self) -> int:
        """Cached blocks no row references (reclaimable; part of :attr:`free`)."""
        return self.prefix.idle

    def refs(self, block: int) -> int:
        """References to ``block`` (0: free or idle)."""
        return self._ref.get(block, 0)

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks ``n_tokens`` positions need."""
        return -(-max(int(n_tokens), 0) // self.block_size)

    def acquire(self, n: int) -> list[int] | None:
        """``n`` blocks with one reference each (the free list's lowest ids first, then idle
        cached blocks, least recently used first, evicted from the cache), or ``None``
        (nothing taken) when fewer are available."""
        if n < 0:
            raise ValueError(f"BlockAllocator.acquire: n={n} must be >= 0")
        if n > self.free:
            return None
        k = min(n, len(self._free))
        ids = [self._free.pop() for _ in range(k)]
        ids += [self.prefix.evict() for _ in range(n - k)]
        for i in ids:
            self._ref[i] = 1
        return ids

    def share(self, ids: list[int]) -> None:
        """One more reference to each block (referenced, or idle in the cache; anything else
        raises ``ValueError``, nothing shared)."""
        bad = [i for i in ids if i not in self._ref and not self.prefix.is_idle(i)]
        if bad:
            raise ValueError(f"BlockAllocator.share: blocks {bad} are neither held nor cached")
        for i in ids:
            if i in self._ref:
                self._ref[i] += 1
            else:
                self.prefix.unpark(i)
                self._ref[i] = 1

    def release(self, ids: list[int]) -> None:
        """Drop one reference to each block (a block not held raises ``ValueError``, nothing
        released); a block left without references is freed, or parked idle when cached."""
        bad = [i for i in ids if i not in self._ref]
        if bad or any(c > self._ref[i] for i, c in Counter(ids).items()):
            raise ValueError(f"BlockAllocator.release: blocks {bad or ids} are not held "
                             "(double release?)")
        freed = False
        for i in ids:
            left = self._ref[i] - 1
            if left:
                self._ref[i] = left
                continue
            del self._ref[i]
            if self.prefix.hash_of(i) is not None:
                self.prefix.park(i)
            else:
                self._free.append(i)
                freed = True
        if freed:
            self._free.sort(reverse=True)  # pop() hands out the lowest id

    def cache(self, h: bytes, block: int) -> bool:
        """Cache ``block`` (held) under the prefix hash ``h``; ``False`` when ``h`` is already
        cached by another block or ``block`` already has a hash (nothing changes)."""
        if block not in self._ref:
            raise ValueError(f"BlockAllocator.cache: block {block} is not held")
        return self.prefix.insert(h, block)

    def clear_cache(self) -> int:
        """Empty the prefix cache: idle blocks go back to the free list, referenced ones stay
        with their rows (freed when released). Returns the blocks freed."""
        idle = self.prefix.forget()
        self._free.extend(idle)
        self._free.sort(reverse=True)
        return len(idle)


class BlockTable:
    """Which blocks each cache row holds: the device table ``(max_batch, max_blocks)`` int32
    (0, the null block, past a row's blocks) and its host copy per row.

    Args:
        stream: the runner's stream (the table is allocated and updated on it).
        max_batch: rows.
        max_seq: positions per row (``max_blocks = ceil(max_seq / block_size)``).
        allocator: the pool's free list.
    """

    def __init__(self, stream: Stream, max_batch: int, max_seq: int,
                 allocator: BlockAllocator) -> None:
        self.stream = stream
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.max_blocks = -(-max_seq // self.block_size)
        self.table = api.zeros((max_batch, self.max_blocks), "int32").sync_on(stream)
        self.row_blocks: list[list[int]] = [[] for _ in range(max_batch)]

    def row(self, slot: int) -> np.ndarray:
        """Row ``slot`` of the table as the host sees it (its blocks, then null blocks)."""
        row = np.zeros(self.max_blocks, np.int32)
        held = self.row_blocks[slot]
        row[:len(held)] = held
        return row

    def _upload(self, slot: int) -> None:
        # the whole row: entries past the blocks held go back to the null block
        api.memcpy(self.table[slot], api.from_host(self.row(slot))).async_on(self.stream)

    def reserve(self, slot: int, n_tokens: int) -> bool:
        """Give row ``slot`` blocks for positions ``[0, n_tokens)`` (keeping those it holds)
        and upload its table row; ``False``, taking nothing, when too few are free."""
        held = self.row_blocks[slot]
        need = self.allocator.blocks_for(int(n_tokens)) - len(held)
        if need <= 0:
            return True
        ids = self.allocator.acquire(need)
        if ids is None:
            return False
        held += ids
        self._upload(slot)
        return True

    def grow(self, slot: int, n_tokens: int, what: str) -> None:
        """:meth:`reserve`, raising :class:`KVCacheFull` (naming ``what``) when it cannot."""
        if not self.reserve(slot, n_tokens):
            a = self.allocator
            need = a.blocks_for(n_tokens) - len(self.row_blocks[slot])
            raise KVCacheFull(
                f"{what}: row {slot} needs {need} more KV blocks for {n_tokens} positions, the "
                f"pool has {a.free} free of {a.capacity} (release finished rows, or build the "
                "model with a larger kv_blocks)")

    def frozen(self, slot: int) -> int:
        """Positions of row ``slot`` in its leading cached blocks: they hold a prefix other
        rows may read, and the row must not write there."""
        n = 0
        for b in self.row_blocks[slot]:
            if self.allocator.prefix.hash_of(b) is None:
                break
            n += 1
        return n * self.block_size

    def share_prefix(self, slot: int, hashes: Sequence[bytes], start: int) -> int:
        """Point row ``slot``'s blocks ``start // block_size ..`` at the cached blocks of
        ``hashes`` (a prefix's hash chain, :func:`~.prefix_cache.block_hashes`), as far as
        they are cached, and upload its table row; returns the positions the row now shares
        (``start`` when nothing more is cached).

        The row has written nothing from ``start`` on: blocks it holds there (reserved,
        unwritten) are given back as cached ones replace them.
        """
        bs, a = self.block_size, self.allocator
        if start % bs:
            raise ValueError(f"share_prefix: start={start} is not a multiple of the block size "
                             f"{bs}")
        held = self.row_blocks[slot]
        j = start // bs
        if j > len(held):
            raise ValueError(f"share_prefix: row {slot} holds {len(held)} blocks, fewer than "
                             f"start={start} covers")
        changed = False
        while j < len(hashes):
            b = a.prefix.lookup(hashes[j])
            if b is None:
                break
            if j < len(held) and held[j] == b:
                j += 1
                continue
            a.share([b])
            if j < len(held):
                a.release([held[j]])
                held[j] = b
            else:
                held.append(b)
            changed = True
            j += 1
        if changed:
            self._upload(slot)
        return j * bs

    def cache_prefix(self, slot: int, hashes: Sequence[bytes]) -> int:
        """Cache row ``slot``'s leading blocks under ``hashes`` (the hash chain of the tokens
        it has written there: every block is full); blocks already cached, or whose hash
        another block holds, are left as they are. Returns the blocks newly cached."""
        held, a = self.row_blocks[slot], self.allocator
        if len(hashes) > len(held):
            raise ValueError(f"cache_prefix: {len(hashes)} block hashes for row {slot}, which "
                             f"holds {len(held)} blocks")
        n = 0
        for h, b in zip(hashes, held, strict=False):
            old = a.prefix.hash_of(b)
            if old is not None:
                if old != h:
                    raise ValueError(f"cache_prefix: row {slot}'s block {b} is cached under "
                                     "another prefix (the tokens given are not the row's)")
                continue
            n += a.cache(h, b)
        return n

    def release(self, slot: int) -> None:
        """Drop row ``slot``'s references to its blocks (its table row is left as it is: an
        idle row writes nothing, and the next :meth:`reserve` rewrites it)."""
        held = self.row_blocks[slot]
        if held:
            self.allocator.release(held)
            self.row_blocks[slot] = []


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """KV-cache bytes one position costs: K and V, every layer and KV head.

    SmolLM2-135M in float16: ``2 * 30 * 3 * 64 * 2 = 23,040`` bytes per token.
    """
    return 2 * n_layers * n_kv_heads * head_dim * dtype_bytes


def max_concurrent_sequences(free_bytes: int, seq_len: int, bytes_per_token: int) -> int:
    """How many ``seq_len``-token sequences fit in ``free_bytes`` of KV memory."""
    if seq_len <= 0 or bytes_per_token <= 0:
        raise ValueError("max_concurrent_sequences: seq_len and bytes_per_token must be positive")
    return math.floor(free_bytes / (seq_len * bytes_per_token))
