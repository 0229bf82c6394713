"""Argument checks of the norms: per-column vectors (weights and biases) and ``eps``.

Row inputs are checked by :func:`..runtime._checks.row_input`. Each raises before any launch
with a message naming the op, the argument, the shapes or dtypes and the fix; the ops'
``check`` closures (:mod:`.op`) call these.
"""

from __future__ import annotations

import math

import numpy as np

from deviceops.extend import DTypeError, ShapeError, Tensor


def _vector(name: str, what: str, v: Tensor | None, x: Tensor) -> None:
    if v is None:
        return
    d = x.shape[-1]
    if v.shape != (d,):
        raise ShapeError(f"{name}: {what} has shape {v.shape}, expected ({d},) for x {x.shape}", op=name)
    if v.dtype != x.dtype:
        raise DTypeError(f"{name}: {what} has dtype {v.dtype} but x has dtype {x.dtype}; they must match",
                         op=name)


def _eps(name: str, eps: float) -> float:
    if type(eps) is float and 0.0 <= eps < math.inf:
        return eps
    if isinstance(eps, bool) or not isinstance(eps, int | float | np.integer | np.floating):
        raise TypeError(f"{name}: eps must be a real number (a float >= 0), got "
                        f"{type(eps).__name__} {eps!r}")
    e = float(eps)
    if not (math.isfinite(e) and e >= 0.0):
        raise ValueError(f"{name}: eps {eps!r} must be finite and >= 0")
    return e
