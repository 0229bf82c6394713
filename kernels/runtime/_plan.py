"""The plan cache: one bounded, process-wide table of kernel plans, every family's.

A plan is what a launcher decided once for a problem: its checks passed, the outputs it
allocates, the path, tiles, grid and kernel handles. Every key has four parts::

    (device, op, static parameters, tensor signature)

* ``device``: the :class:`deviceops.Device` the op runs on (a CUDA launch plan:
  ``("cuda", index)``): several GPUs share one process, and a plan holds a device's kernel
  handles and SM count;
* ``op``: the launcher (a :class:`._spec.KernelSpec`, or a family's name for its CUDA
  launch plans such as ``"gemm_cuda"``);
* the static parameters: every scalar the plan may depend on (``eps``, ``activation``,
  ``trans_b``, ..., and a family's :class:`._override.Override` in force);
* the tensor signature: shapes, dtypes, strides/contiguity, and what a plan reads of the
  pointers (alignment; for a kernel op, each storage's ``id``: the alias pattern).

Two levels use it. A kernel op (:class:`._spec.KernelSpec`) keys its checked
:class:`._spec.Plan` by its arguments' interned signatures; a family's CUDA launcher keys
its launch plan by the arrays it is handed (``gemm`` and ``flash_attention`` take
shape-dependent paths; a launcher called directly, by a test or a benchmark, checks its
arguments on a miss). Arguments are checked once: by the op on its miss, never again by
the CUDA launch plan it reaches.

**Replays.** The fastest path of a kernel op on the ``cuda`` backend is a replay
(:mod:`._replay`): the driver calls its body made the first time, re-issued. A replay
record is part of its plan-cache entry: :attr:`._spec.Plan.replays` maps ``(stream,
pointers)`` to the record, so a record lives and dies with the plan of the same (device,
op, statics, signature) and needs no key of its own.

The table is bounded (:data:`LIMIT` entries, the oldest evicted first); :func:`stats`
counts hits and misses (``KernelSpec.op`` updates ``_counts`` inline: it is on the
per-call path).
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["LIMIT", "clear", "entries", "lookup", "stats", "store"]

LIMIT = 4096
_cache: dict[Any, Any] = {}
_counts = [0, 0]  # hits, misses


def lookup(key: Any) -> Any:
    """The plan stored under ``key`` (counted as a hit), or ``None`` (a miss)."""
    got = _cache.get(key)
    _counts[got is None] += 1
    return got


def store(key: Any, value: Any) -> Any:
    """Store ``value`` under ``key`` (evicting the oldest entry past :data:`LIMIT`); return it."""
    if len(_cache) >= LIMIT:
        with contextlib.suppress(KeyError, RuntimeError, StopIteration):  # a racing evictor
            del _cache[next(iter(_cache))]  # the oldest entry: O(1), no pause
    _cache[key] = value
    return value


def entries() -> list[tuple[Any, Any]]:
    """The ``(key, plan)`` pairs now cached (diagnostics and tests)."""
    return list(_cache.items())


def stats() -> dict[str, int]:
    """Hits, misses and entries of the plan cache (diagnostics and tests)."""
    return {"hits": _counts[0], "misses": _counts[1], "entries": len(_cache)}


def clear() -> None:
    """Forget every cached plan (tests)."""
    _cache.clear()
    _counts[0] = _counts[1] = 0
