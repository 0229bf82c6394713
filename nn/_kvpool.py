"""KV memory accounting for the serving :class:`~deviceops.nn.Engine`: batch rows (slots).

The model's KV cache is **paged** (:mod:`.kv_cache`): per layer one block pool
``(num_blocks, Hkv, block_size, D)`` and a block table ``(max_batch, max_blocks)`` in device
memory; a running sequence holds one batch row of the table (a *slot*) and the blocks its
length needs, handed out by the model's :class:`~.kv_cache.BlockAllocator`. The engine
reserves a request's blocks at admission (``CausalLM.reserve``) and the model gives them
back on ``release``; ``Engine.stats().kv_blocks_in_use`` is that allocator's real count.

:class:`SlotPool` hands out the batch rows and keeps the logical occupancy of each (how
many positions its sequence has written; ``blocks_in_use`` here rounds that up per slot,
what a step model without paged memory reports).

:func:`kv_bytes_per_token` and :func:`max_concurrent_sequences` compute how many
sequences of a given length fit in a given amount of device memory. SmolLM2-135M in
float16 needs 23,040 bytes per token (368,640 per 16-token block), 47.2 MB per 2,048-token
sequence (128 blocks). Measured on the H100 (``benchmarks/serve.py``, 2026-11-23): 82.48 GB
free after the CUDA context, weights and this run's other buffers -> 1,747 concurrent
2,048-token sequences (1,779 counting the run's own pool), and a pool of 1,659 of them
(78.3 GB) was allocated. Paging does not change that count at full length; it lets
shorter sequences hold only the blocks they use, so ``max_batch`` rows can share a pool
smaller than ``max_batch * max_seq`` positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SlotPool", "kv_bytes_per_token", "max_concurrent_sequences"]


@dataclass(frozen=True)
class _Usage:
    slots_in_use: int
    tokens_in_use: int
    blocks_in_use: int


class SlotPool:
    """Free list of KV-cache slots (batch rows), lowest index first.

    Args:
        n_slots: number of cache rows (the model's ``max_batch``).
        max_seq: positions per row.
        block_size: the unit of ``blocks_in_use`` (positions per block).

    Raises:
        ValueError: a non-positive size.

    Example:
        >>> pool = SlotPool(4, 2048)
        >>> s = pool.acquire(); pool.set_length(s, 100); pool.blocks_in_use
        7
        >>> pool.release(s); pool.in_use
        0
    """

    def __init__(self, n_slots: int, max_seq: int, *, block_size: int = 16) -> None:
        for name, v in (("n_slots", n_slots), ("max_seq", max_seq), ("block_size", block_size)):
            if int(v) <= 0:
                raise ValueError(f"SlotPool: {name} must be positive, got {v}")
        self.n_slots = int(n_slots)
        self.max_seq = int(max_seq)
        self.block_size = int(block_size)
        self._free: list[int] = list(range(self.n_slots - 1, -1, -1))  # pop() gives lowest
        self._length: dict[int, int] = {}

    @property
    def in_use(self) -> int:
        """Slots held by sequences."""
        return len(self._length)

    @property
    def free(self) -> int:
        """Slots available to :meth:`acquire`."""
        return len(self._free)

    @property
    def tokens_in_use(self) -> int:
        """Positions written by the sequences that hold slots."""
        return sum(self._length.values())

    @property
    def blocks_in_use(self) -> int:
        """``tokens_in_use`` rounded up per slot to ``block_size``-token blocks."""
        b = self.block_size
        return sum(-(-n // b) for n in self._length.values())

    def usage(self) -> _Usage:
        """A snapshot of slots, tokens and blocks in use."""
        return _Usage(self.in_use, self.tokens_in_use, self.blocks_in_use)

    def acquire(self) -> int | None:
        """Take the lowest free slot, or ``None`` when all are held."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._length[slot] = 0
        return slot

    def set_length(self, slot: int, n: int) -> None:
        """Record that ``slot``'s sequence now occupies positions ``[0, n)``."""
        if slot not in self._length:
            raise ValueError(f"SlotPool.set_length: slot {slot} is not held")
        if not 0 <= n <= self.max_seq:
            raise ValueError(f"SlotPool.set_length: length {n} outside [0, {self.max_seq}]")
        self._length[slot] = int(n)

    def release(self, slot: int) -> None:
        """Return ``slot`` to the free list (a slot not held raises ``ValueError``)."""
        if self._length.pop(slot, None) is None:
            raise ValueError(f"SlotPool.release: slot {slot} is not held (double release?)")
        # keep the free list sorted descending so pop() hands out the lowest slot
        self._free.append(slot)
        self._free.sort(reverse=True)


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
