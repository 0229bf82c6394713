"""The dtypes deviceops supports and how names map onto NumPy/CuPy dtypes.

bfloat16 comes from ``ml_dtypes``; NumPy and CuPy (14+) both accept it as an
array dtype, so one ``numpy.dtype`` object names each supported type on both
backends.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from ._errors import DTypeError

__all__ = ["bfloat16", "float16", "float32", "int32", "int64", "normalize_dtype"]

float32: np.dtype[Any] = np.dtype(np.float32)
float16: np.dtype[Any] = np.dtype(np.float16)
bfloat16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
int32: np.dtype[Any] = np.dtype(np.int32)
int64: np.dtype[Any] = np.dtype(np.int64)

SUPPORTED: tuple[np.dtype[Any], ...] = (float32, float16, bfloat16, int32, int64)
FLOATING: tuple[np.dtype[Any], ...] = (float32, float16, bfloat16)
_BY_NAME = {str(d): d for d in SUPPORTED}


def normalize_dtype(dtype: Any, *, op: str = "deviceops") -> np.dtype[Any]:
    """Return the ``numpy.dtype`` for ``dtype`` (a name, type or dtype).

    Raises:
        DTypeError: the dtype is not one deviceops supports.
    """
    for d in SUPPORTED:  # the common case, a supported dtype object: identity, no hashing
        if dtype is d:
            return d
    if isinstance(dtype, str) and dtype in _BY_NAME:
        return _BY_NAME[dtype]
    try:
        d = np.dtype(dtype)
    except TypeError as exc:
        raise DTypeError(f"{op}: {dtype!r} is not a dtype", op=op) from exc
    if d not in SUPPORTED:
        names = ", ".join(str(s) for s in SUPPORTED)
        raise DTypeError(f"{op}: dtype {d} is not supported; use one of {names}", op=op)
    return d


def is_floating(dtype: np.dtype[Any]) -> bool:
    """True for float32, float16 and bfloat16."""
    return dtype in FLOATING
