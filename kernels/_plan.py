"""Argument checks computed once per (kernel, argument signature) and cached.

A kernel launcher (``gemm``, ``rms_norm``, ...) validates its tensor arguments with a
``check`` function that returns the output's shape and dtype (or several). What a check
decides depends only on

* the check's code and the scalar parameters it closes over (``activation``, ``trans_b``,
  the kernel's name, ...): :func:`static_key`;
* each tensor's shape, dtype, device and C-contiguity (:meth:`Tensor.signature`, interned
  as a small int), and which arguments share storage (the *alias pattern*, carried by the
  storages' ids): :func:`arg_key`.

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

from deviceops.extend import Tensor

__all__ = ["LIMIT", "arg_key", "cached", "clear", "lookup", "static_key", "stats", "store"]

LIMIT = 4096
_SIMPLE_TYPES = frozenset((str, int, float, bool, bytes, type(None)))
_cache: dict[Any, Any] = {}
_counts = [0, 0]  # hits, misses


def static_key(fn: Callable[..., Any], depth: int = 0) -> Any:
    """A hashable key of ``fn``'s code and the values it closes over, or ``None``.

    Closed-over functions contribute their own key (two levels deep); simple values
    (str, numbers, dtypes, ``None``, tuples of those) their value. Anything else makes
    the check uncacheable (``None``). The code object itself is part of the key (its
    hash is computed by CPython from its identity-relevant fields once per lookup).
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
        t = type(v)
        if t in _SIMPLE_TYPES:
            parts.append(v)
        elif t is types.FunctionType and depth < 2:
            k = static_key(v, depth + 1)
            if k is None:
                return None
            parts.append(k)
        elif isinstance(v, np.dtype) or (t is tuple and all(type(x) in _SIMPLE_TYPES for x in v)):
            parts.append(v)
        else:
            return None
    return tuple(parts)


def arg_key(vals: Sequence[Any]) -> tuple[Any, ...] | None:
    """Signatures and storages of ``vals`` (Tensors or ``None``), or ``None`` if another kind
    of argument (a Partition, a DeviceOp) is among them.

    Each tensor contributes its interned signature number and ``id`` of its storage. The
    ids stand for the alias pattern: two live arguments share a storage exactly when their
    ids are equal, so equal keys mean equal signatures and equal aliasing, which is all a
    check may depend on (an id reused by a later storage yields a key whose check result
    is still right for it).
    """
    key: list[Any] = []
    for v in vals:
        if v is None:
            key.append(None)
            continue
        if type(v) is not Tensor:
            return None
        sid = v._sig_id
        if sid < 0:
            sid = v.signature_id()
            if sid < 0:
                return None
        key.append(sid)
        key.append(id(v._storage))
    return tuple(key)


def cached(check_key: Any, vals: Sequence[Any], compute: Callable[[], Any]) -> Any:
    """``compute()`` (the full check of ``vals``), cached under ``(check_key, arg_key(vals))``.

    ``check_key`` is :func:`static_key` of the launcher's check (``None``: no caching).
    """
    if check_key is None:
        return compute()
    ak = arg_key(vals)
    if ak is None:
        return compute()
    key = (check_key, ak)  # hashable: static_key admits only simple values, arg_key ints
    got = _cache.get(key)
    if got is not None:
        _counts[0] += 1
        return got
    _counts[1] += 1
    got = compute()
    if len(_cache) >= LIMIT:
        del _cache[next(iter(_cache))]  # the oldest entry: O(1), no pause
    _cache[key] = got
    return got


def lookup(key: Any) -> Any:
    """The entry stored under ``key`` (counted as a hit), or ``None`` (a miss).

    Raises:
        TypeError: ``key`` is not hashable (the caller then does not cache).
    """
    got = _cache.get(key)
    _counts[0 if got is not None else 1] += 1
    return got


def store(key: Any, value: Any) -> Any:
    """Store ``value`` under ``key`` (evicting the oldest entry past :data:`LIMIT`); return it."""
    if len(_cache) >= LIMIT:
        del _cache[next(iter(_cache))]
    _cache[key] = value
    return value


def stats() -> dict[str, int]:
    """Hits, misses and entries of the check cache (diagnostics and tests)."""
    return {"hits": _counts[0], "misses": _counts[1], "entries": len(_cache)}


def clear() -> None:
    """Forget every cached check result (tests)."""
    _cache.clear()
    _counts[0] = _counts[1] = 0
