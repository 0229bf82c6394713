"""Argument checks of the elementwise kernels (``saxpy``, ``add``, ``mul``).

Matching shapes, dtypes and devices (no broadcasting), C-contiguous operands, and ``saxpy``'s
scalar (a real number the float32 computation can hold, within an integer ``z``'s range).
They run before launch, and only on a call that is not the memoised repeat of the last
launch (:mod:`._plan`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from deviceops.extend import DeviceError, DTypeError, ShapeError, Tensor, int32, int64

from ..runtime._op import contiguous


def _check_pair(name: str, a: Tensor, b: Tensor, an: str, bn: str) -> None:
    aa, ba = a._array, b._array
    if aa.shape != ba.shape:
        raise ShapeError(f"{name}: {an} shape {a.shape} != {bn} shape {b.shape} (no broadcasting)", op=name)
    if aa.dtype != ba.dtype:
        raise DTypeError(f"{name}: {an} dtype {a.dtype} != {bn} dtype {b.dtype}", op=name)
    if a._storage.device is not b._storage.device:
        raise DeviceError(f"{name}: {an} is on {a.device} but {bn} is on {b.device}; an op runs "
                          f"on one device: copy one first with api.to_device(t, {str(a.device)!r})",
                          op=name, device=str(b.device))


def _saxpy_check(z: Tensor, x: Tensor) -> None:
    _check_pair("saxpy", z, x, "z", "x")
    contiguous(z, "saxpy", "z")
    contiguous(x, "saxpy", "x")


def _scalar_arg(a: Any) -> float:
    """``saxpy``'s ``a`` as a float: a real number (not a bool, a string or ``None``)."""
    if isinstance(a, bool) or not isinstance(a, int | float | np.integer | np.floating):
        raise TypeError(f"saxpy: a must be a real number (int or float), got {type(a).__name__} "
                        f"{a!r}")
    return float(a)


_INT_RANGE = {int32: (-(2**31), 2**31 - 1), int64: (-(2**63), 2**63 - 1)}
_F32_MAX = float(np.finfo(np.float32).max)


def _saxpy_scalar(a: float, dt: np.dtype[Any]) -> None:
    """Refuse a scalar the computation cannot hold (it is used as a float32)."""
    if not math.isfinite(a):
        if dt in _INT_RANGE:
            raise ValueError(f"saxpy: a={a} is not finite; an {dt} z cannot hold the result")
        return
    if abs(a) > _F32_MAX:
        raise ValueError(f"saxpy: a={a} overflows float32, the precision saxpy computes in; "
                         f"use |a| <= {_F32_MAX:.3e}")
    rng = _INT_RANGE.get(dt)
    if rng is not None and not rng[0] <= a <= rng[1]:
        raise ValueError(f"saxpy: a={a} is outside the range of z's dtype {dt} "
                         f"[{rng[0]}, {rng[1]}]; use a smaller scalar or a wider dtype")


def _binary_check(name: str, x: Tensor, y: Tensor, out: Tensor | None) -> None:
    _check_pair(name, x, y, "x", "y")
    contiguous(x, name, "x")
    contiguous(y, name, "y")
    if out is not None:
        _check_pair(name, out, x, "out", "x")
        contiguous(out, name, "out")
