"""Prefix caching: full KV blocks keyed by a hash of their whole token prefix.

A block of ``block_size`` positions that a row has completely written holds keys and values
that depend only on the tokens at positions ``0 .. end`` of its row. Its *hash* chains the
hash of the block before it with its own tokens (:func:`block_hashes`: ``blake2b(parent
digest, tokens)``, 16 bytes), so equal hashes mean equal prefixes, and a later request whose
prompt starts with the same full blocks can point its block table at them instead of
computing them again.

:class:`PrefixCache` is the table ``hash -> block id`` (and back) plus the LRU order of the
cached blocks no row references: the :class:`~.paged_kv.BlockAllocator` keeps reference
counts, parks a cached block here when its count drops to zero, takes it back when a row
shares it again, and evicts the least recently used one when it needs a free block.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

__all__ = ["PrefixCache", "block_hashes"]


def block_hashes(ids: Sequence[int], block_size: int, known: Sequence[bytes] = ()) -> list[bytes]:
    """The hash chain of ``ids``' full blocks: one 16-byte digest per complete
    ``block_size``-token block (a partial last block has none).

    ``known``: the chain of a prefix of ``ids`` already hashed (reused, not recomputed).

    Example:
        >>> a = block_hashes([1, 2, 3, 4, 5], 2); len(a)
        2
        >>> block_hashes([1, 2, 3, 4, 9], 2) == a, block_hashes([0, 2, 3, 4], 2)[1] == a[1]
        (True, False)
    """
    bs = int(block_size)
    if bs < 1:
        raise ValueError(f"block_hashes: block_size={block_size} must be >= 1")
    n = len(ids) // bs
    out = list(known[:n])
    if len(out) == n:
        return out
    arr = np.asarray(ids[len(out) * bs:n * bs], dtype="<i8")
    parent = out[-1] if out else b""
    for j in range(n - len(out)):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(arr[j * bs:(j + 1) * bs].tobytes())
        parent = h.digest()
        out.append(parent)
    return out


class PrefixCache:
    """Cached blocks by prefix hash, and the LRU order of those no row references.

    The :class:`~.paged_kv.BlockAllocator` that owns it decides when a block is referenced;
    this class only keeps the table and the order (module docstring).
    """

    def __init__(self) -> None:
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # unreferenced, oldest first

    def __len__(self) -> int:
        """Blocks in the table (referenced by rows or not)."""
        return len(self._by_hash)

    @property
    def idle(self) -> int:
        """Cached blocks no row references (reclaimable: evicted when blocks run short)."""
        return len(self._idle)

    def lookup(self, h: bytes) -> int | None:
        """The block cached under ``h``, or ``None``."""
        return self._by_hash.get(h)

    def hash_of(self, block: int) -> bytes | None:
        """The hash ``block`` is cached under, or ``None``."""
        return self._hash_of.get(block)

    def insert(self, h: bytes, block: int) -> bool:
        """Cache ``block`` (referenced by a row) under ``h``; ``False`` when ``h`` is already
        cached (by another block: this one stays private) or ``block`` has another hash."""
        if h in self._by_hash or block in self._hash_of:
            return False
        self._by_hash[h] = block
        self._hash_of[block] = h
        return True

    def park(self, block: int) -> None:
        """``block`` (cached) lost its last reference: the most recently used idle block."""
        self._idle[block] = None

    def unpark(self, block: int) -> None:
        """``block`` (idle) is referenced again."""
        del self._idle[block]

    def is_idle(self, block: int) -> bool:
        """``block`` is cached and no row references it."""
        return block in self._idle

    def evict(self) -> int:
        """Drop the least recently used idle block from the cache and return it (free)."""
        block, _ = self._idle.popitem(last=False)
        del self._by_hash[self._hash_of.pop(block)]
        return block

    def forget(self) -> list[int]:
        """Empty the table: returns the idle blocks (now free); referenced blocks stay with
        their rows, uncached (freed when released)."""
        idle = list(self._idle)
        self._idle.clear()
        self._by_hash.clear()
        self._hash_of.clear()
        return idle
