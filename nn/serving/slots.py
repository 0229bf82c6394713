"""The serving engine's batch rows (*slots*): :class:`SlotPool`.

A running request holds one cache row of the model (a *slot*) and, with the paged cache
(:mod:`deviceops.nn.runner.paged_kv`), the KV blocks its length needs, which the engine
reserves at admission (``CausalLM.reserve``) and the model gives back on ``release``;
``Engine.stats().kv_blocks_in_use`` is that allocator's real count. :class:`SlotPool` hands
out the rows and keeps the logical occupancy of each (how many positions its sequence has
written; ``blocks_in_use`` here rounds that up per slot, what a step model without paged
memory reports).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SlotPool"]


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

