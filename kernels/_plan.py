"""The plan cache: one bounded, process-wide table of kernel plans.

A :class:`._spec.KernelSpec` keys a plan by (the spec, its launcher's static parameters,
each tensor argument's interned signature — shape, dtype, device, C-contiguity,
:meth:`Tensor.signature_id` — and the ``id`` of its storage, which carries the alias
pattern). The first call with a key runs the full check and stores the plan here; later
calls with the same key reuse it: an inference loop that calls the same kernels on the same
buffers pays one dictionary lookup instead of the validation. A check that raised stores
nothing (the next call raises again, with a fresh message).

The table is bounded (:data:`LIMIT` entries, the oldest evicted first) and per process;
:func:`stats` counts hits and misses (``KernelSpec.op`` updates ``_counts`` inline: it is
on the per-call path).
"""

from __future__ import annotations

from typing import Any

__all__ = ["LIMIT", "clear", "stats", "store"]

LIMIT = 4096
_cache: dict[Any, Any] = {}
_counts = [0, 0]  # hits, misses


def store(key: Any, value: Any) -> Any:
    """Store ``value`` under ``key`` (evicting the oldest entry past :data:`LIMIT`); return it."""
    if len(_cache) >= LIMIT:
        del _cache[next(iter(_cache))]  # the oldest entry: O(1), no pause
    _cache[key] = value
    return value


def stats() -> dict[str, int]:
    """Hits, misses and entries of the plan cache (diagnostics and tests)."""
    return {"hits": _counts[0], "misses": _counts[1], "entries": len(_cache)}


def clear() -> None:
    """Forget every cached plan (tests)."""
    _cache.clear()
    _counts[0] = _counts[1] = 0
