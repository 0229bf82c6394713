"""KVCache: the paged key/value cache of a decoder (a block pool) and its block allocator.

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
"""

from __future__ import annotations

from dataclasses import dataclass

from deviceops import Stream, Tensor, api

__all__ = ["BlockAllocator", "KVCache"]


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
    """Free list of KV blocks ``reserved .. num_blocks-1`` (lowest id first).

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
        self._held: set[int] = set()

    @property
    def capacity(self) -> int:
        """Blocks that can be handed out (all but the reserved ones)."""
        return self.num_blocks - self.reserved

    @property
    def free(self) -> int:
        """Blocks available to :meth:`acquire`."""
        return len(self._free)

    @property
    def in_use(self) -> int:
        """Blocks handed out and not released."""
        return len(self._held)

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks ``n_tokens`` positions need."""
        return -(-max(int(n_tokens), 0) // self.block_size)

    def acquire(self, n: int) -> list[int] | None:
        """``n`` free block ids (lowest first), or ``None`` (nothing taken) when fewer are free."""
        if n < 0:
            raise ValueError(f"BlockAllocator.acquire: n={n} must be >= 0")
        if n > len(self._free):
            return None
        ids = [self._free.pop() for _ in range(n)]
        self._held.update(ids)
        return ids

    def release(self, ids: list[int]) -> None:
        """Give blocks back (a block not held raises ``ValueError``, nothing released)."""
        bad = [i for i in ids if i not in self._held]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"BlockAllocator.release: blocks {bad or ids} are not held "
                             "(double release?)")
        self._held.difference_update(ids)
        self._free.extend(ids)
        self._free.sort(reverse=True)  # pop() hands out the lowest id
