"""Argument checks computed once per (kernel, argument signature) and cached.

A kernel launcher (``gemm``, ``rms_norm``, ...) validates its tensor arguments with a
``check`` function that returns the output's shape and dtype (or several). What a check
decides depends only on

* the check's code and the scalar parameters it closes over (``activation``, ``trans_b``,
  the kernel's name, ...): :func:`static_key`;
* each tensor's shape, dtype, device and C-contiguity (:meth:`Tensor.signature`), and
  which arguments share storage (the *alias pattern*): :func:`arg_key`.

So the first call with a given key runs the full check and stores its result; later calls
with the same key reuse it: an inference loop that calls the same kernels on the same
buffers pays one dictionary lookup instead of the validation. A check that raised stores
nothing (the next call raises again, with a fresh message). A check that closes over
anything else (a tensor, a list, a mutable object) is not cached: :func:`static_key`
returns ``None`` and the check runs every time, so a launcher cannot get a stale result
by closing over state the key does not see.

The cache is bounded (:data:`LIMIT` entries, the oldest evicted first) and per process.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from deviceops._tensor import Tensor

__all__ = ["LIMIT", "arg_key", "cached", "clear", "static_key", "stats"]

LIMIT = 4096
_SIMPLE = (str, int, float, bool, bytes, np.dtype, type(None))
_cache: dict[Any, Any] = {}
_counts = [0, 0]  # hits, misses


def static_key(fn: Callable[..., Any], depth: int = 0) -> Any:
    """A hashable key of ``fn``'s code and the values it closes over, or ``None``.

    Closed-over functions contribute their own key (two levels deep); simple values
    (str, numbers, dtypes, ``None``, tuples of those) their value. Anything else makes
    the check uncacheable (``None``).
    """
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    cells = fn.__closure__
    if not cells:
        return code
    parts: list[Any] = [code]
    for c in cells:
        try:
            v = c.cell_contents
        except ValueError:  # a cell not yet bound
            return None
        if isinstance(v, _SIMPLE) or (isinstance(v, tuple)
                                      and all(isinstance(x, _SIMPLE) for x in v)):
            parts.append(v)
        elif isinstance(v, types.FunctionType) and depth < 2:
            k = static_key(v, depth + 1)
            if k is None:
                return None
            parts.append(k)
        else:
            return None
    return tuple(parts)


def arg_key(vals: Sequence[Any]) -> tuple[Any, ...] | None:
    """Signatures and alias pattern of ``vals`` (Tensors or ``None``), or ``None`` if another
    kind of argument (a Partition, a DeviceOp) is among them."""
    sigs: list[Any] = []
    stores: list[Any] = []
    for v in vals:
        if v is None:
            sigs.append(None)
            continue
        if type(v) is not Tensor:
            return None
        sig = v._sig
        sigs.append(sig if sig is not None else v.signature())
        st = v._storage
        # alias pattern: the index of the first argument sharing this storage
        for j, o in enumerate(stores):
            if o is st:
                sigs.append(j)
                break
        stores.append(st)
    return tuple(sigs)


def cached(check_key: Any, vals: Sequence[Any], compute: Callable[[], Any]) -> Any:
    """``compute()`` (the full check of ``vals``), cached under ``(check_key, arg_key(vals))``.

    ``check_key`` is :func:`static_key` of the launcher's check (``None``: no caching).
    """
    if check_key is None:
        return compute()
    ak = arg_key(vals)
    if ak is None:
        return compute()
    key = (check_key, ak)
    try:
        got = _cache.get(key)
    except TypeError:  # an unhashable value slipped into the key: no caching
        return compute()
    if got is not None:
        _counts[0] += 1
        return got
    _counts[1] += 1
    got = compute()
    if len(_cache) >= LIMIT:
        del _cache[next(iter(_cache))]  # the oldest entry: O(1), no pause
    _cache[key] = got
    return got


def stats() -> dict[str, int]:
    """Hits, misses and entries of the check cache (diagnostics and tests)."""
    return {"hits": _counts[0], "misses": _counts[1], "entries": len(_cache)}


def clear() -> None:
    """Forget every cached check result (tests)."""
    _cache.clear()
    _counts[0] = _counts[1] = 0
