"""Argument checks shared by the norm, activation, lookup and rope kernel families.

Row inputs (a floating ``x`` reduced over its last dim), per-column vectors (norm weights and
biases), ``eps``, RoPE positions (``start``), ``theta`` and a paged KV cache's block table.
Each raises before any launch with a message naming the op, the argument, the shapes or
dtypes and the fix. The ops' own ``check`` closures (in the ``*_ops`` modules) call these.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from deviceops.extend import FLOATING, DTypeError, ShapeError, Tensor, int32

from ._builder import Check, check_out


def _float_input(name: str, what: str, t: Tensor) -> None:
    if t.dtype not in FLOATING:
        raise DTypeError(f"{name}: {what} has dtype {t.dtype}; supported: float32, float16, bfloat16",
                         op=name)


def _row_input(name: str, x: Tensor) -> None:
    _float_input(name, "x", x)
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ShapeError(f"{name}: x has shape {x.shape}; it needs a last dim >= 1 "
                         "(the op works over the last dim)", op=name)
    if x.shape[-1] > 2**31 - 1:
        raise ShapeError(f"{name}: x rows of {x.shape[-1]} elements are too long", op=name)


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


def _same_as_x(name: str) -> Check:
    def check(ts: Mapping[str, Tensor | None]) -> tuple[tuple[int, ...], np.dtype[Any]]:
        x = ts["x"]
        assert x is not None
        _row_input(name, x)
        check_out(name, ts["out"], x.shape, x.dtype, f"the shape and dtype of x {x.shape} {x.dtype}")
        return x.shape, x.dtype

    return check


def _start(name: str, start: Tensor, batch: int, what: str) -> None:
    if start.dtype != int32:
        raise DTypeError(f"{name}: start has dtype {start.dtype}; it must be int32 (B,) "
                         "(positions in device memory)", op=name)
    if start.shape != (batch,):
        raise ShapeError(f"{name}: start has shape {start.shape}, expected ({batch},) for "
                         f"{what}", op=name)


def _theta(name: str, theta: float) -> float:
    t = float(theta)
    if not (math.isfinite(t) and t > 1.0):
        raise ValueError(f"{name}: theta {theta!r} must be finite and > 1 (Llama uses 10000.0)")
    return t


def _block_table(name: str, bt: Tensor, b: int, kc: Tensor, hkv: int, d: int,
                 qkv_shape: tuple[int, ...]) -> None:
    """Checks of a paged rope_kv_write: the table ``(B, max_blocks)`` int32, the pool's shape."""
    if bt.dtype != int32:
        raise DTypeError(f"{name}: block_table has dtype {bt.dtype}; it must be int32 "
                         "(B, max_blocks) block ids in device memory", op=name)
    if bt.ndim != 2 or bt.shape[0] != b or bt.shape[1] < 1:
        raise ShapeError(f"{name}: block_table has shape {bt.shape}, expected ({b}, max_blocks) "
                         f"with max_blocks >= 1 for qkv {qkv_shape}", op=name)
    if kc.ndim != 4 or kc.shape[0] < 1 or kc.shape[1] != hkv or kc.shape[2] < 1 or kc.shape[3] != d:
        raise ShapeError(f"{name}: k_cache has shape {kc.shape}, expected the block pool "
                         f"(num_blocks, {hkv}, block_size, {d}) for qkv {qkv_shape} with "
                         f"n_kv_heads={hkv} (paged: block_table given)", op=name)
