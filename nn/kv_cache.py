"""KVCache: the preallocated key/value cache of a decoder, one slot (batch row) per sequence.

Per layer, keys and values are ``(max_batch, Hkv, max_seq, D)`` tensors (flash attention's
k/v layout), allocated once. A *slot* is one batch row: one running sequence writes its
positions ``0 .. max_seq-1`` there. Views of rows share the storage, so the hazard
tracking of ``deviceops`` orders work on a row against work on the whole cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from deviceops import Stream, Tensor, api

__all__ = ["KVCache"]


@dataclass
class KVCache:
    """Keys and values of every layer: ``k[layer]``, ``v[layer]`` ``(max_batch, Hkv, max_seq, D)``."""

    k: list[Tensor]
    v: list[Tensor]

    @classmethod
    def allocate(cls, stream: Stream, *, layers: int, max_batch: int, kv_heads: int, max_seq: int,
                 head_dim: int, dtype: str) -> KVCache:
        """Zero-filled caches for ``layers`` layers, allocated on ``stream`` now (synchronizing)."""
        shape = (max_batch, kv_heads, max_seq, head_dim)
        k = [api.zeros(shape, dtype).sync_on(stream) for _ in range(layers)]
        v = [api.zeros(shape, dtype).sync_on(stream) for _ in range(layers)]
        return cls(k, v)

    @property
    def max_batch(self) -> int:
        """Slots (batch rows)."""
        return int(self.k[0].shape[0])

    @property
    def max_seq(self) -> int:
        """Positions per slot."""
        return int(self.k[0].shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes held by every layer's keys and values."""
        return sum(t.nbytes for t in self.k) + sum(t.nbytes for t in self.v)

    def rows(self, layer: int, start: int, stop: int) -> tuple[Tensor, Tensor]:
        """Views ``(k, v)`` of slots ``start .. stop-1`` of ``layer``: ``(stop-start, Hkv, S, D)``."""
        return self.k[layer][start:stop], self.v[layer][start:stop]
