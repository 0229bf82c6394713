"""Argument checks of the quant family: formats, the packed weight's shape, activations,
outputs, ids. Errors name the op, the argument, the shapes or dtypes and the fix; they are
raised when the op is built (before any launch)."""

from __future__ import annotations

from typing import Any

import numpy as np

from deviceops.extend import (
    DTypeError,
    ShapeError,
    Tensor,
    bfloat16,
    float16,
    float32,
    int32,
    int64,
)

from ._plan import QuantFormat, packed_words, row_bytes

__all__ = ["check_dequantize", "check_qmatmul", "check_weight"]

_FLOATS = (float32, float16, bfloat16)


def check_weight(op: str, w: Tensor, f: QuantFormat, k: int) -> int:
    """Check a packed weight of ``K = k`` columns (:mod:`._plan`); return its ``N``."""
    if w.dtype != int32:
        raise DTypeError(f"{op}: the quantized weight has dtype {w.dtype}; it must be the int32 packed "
                         f"layout of deviceops.kernels.quant.pack (GGUF {f.name} blocks)", op=op)
    if k < 1 or k % f.block:
        raise ShapeError(f"{op}: K={k} is not a positive multiple of {f.name}'s block of {f.block} "
                         "elements", op=op)
    want = packed_words(f, k)
    if w.ndim != 2 or w.shape[0] < 1 or w.shape[1] != want:
        raise ShapeError(f"{op}: the {f.name} weight has shape {w.shape}; for K={k} it must be (N, {want}) "
                         f"(each row's {row_bytes(f, k)} block bytes padded to 16-byte words: "
                         "deviceops.kernels.quant.pack)", op=op)
    if not w.is_contiguous:
        raise ShapeError(f"{op}: the quantized weight {w.shape} is not C-contiguous; pass a contiguous "
                         "copy (api.dup)", op=op)
    return int(w.shape[0])


def check_qmatmul(op: str, x: Tensor, w: Tensor, out: Tensor | None, bias: Tensor | None,
                  f: QuantFormat, out_col: int) -> tuple[tuple[int, ...], np.dtype[Any]]:
    """Check ``qmatmul``'s arguments; return ``out``'s shape and dtype."""
    if x.dtype not in _FLOATS:
        raise DTypeError(f"{op}: x has dtype {x.dtype}; use float32, float16 or bfloat16", op=op)
    if x.ndim != 2 or min(x.shape) < 1:
        raise ShapeError(f"{op}: x has shape {x.shape}; expected (M, K) with M, K >= 1 (reshape "
                         "batched rows to 2-D first)", op=op)
    if not x.is_contiguous:
        raise ShapeError(f"{op}: x {x.shape} is not C-contiguous; pass a contiguous copy (api.dup)", op=op)
    m, k = x.shape
    n = check_weight(op, w, f, k)
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ShapeError(f"{op}: bias has shape {bias.shape} and dtype {bias.dtype}; expected ({n},) "
                         f"{x.dtype} (one per weight row, x's dtype)", op=op)
    if out is None:
        if out_col:
            raise ShapeError(f"{op}: out_col={out_col} writes into columns of a given out; pass out=", op=op)
        return (m, n), x.dtype
    if out.dtype != x.dtype:
        raise DTypeError(f"{op}: out has dtype {out.dtype}, expected x's {x.dtype}", op=op)
    if out.ndim != 2 or out.shape[0] != m or out.shape[1] < out_col + n:
        raise ShapeError(f"{op}: out has shape {out.shape}; x {x.shape} times the ({n}, {k}) {f.name} "
                         f"weight written at column {out_col} needs (M={m}, >= {out_col + n})", op=op)
    if not out.is_contiguous:
        raise ShapeError(f"{op}: out {out.shape} is not C-contiguous; pass a contiguous buffer", op=op)
    for name, t in (("x", x), ("w", w), ("bias", bias)):
        if t is not None and t._storage is out._storage:
            raise ShapeError(f"{op}: out {out.shape} shares memory with {name} {t.shape}; write to a "
                             "separate tensor", op=op)
    return out.shape, out.dtype


def check_dequantize(op: str, w: Tensor, ids: Tensor | None, out: Tensor | None, f: QuantFormat,
                     k: int, dtype: np.dtype[Any]) -> tuple[tuple[int, ...], np.dtype[Any]]:
    """Check ``dequantize``'s arguments; return ``out``'s shape and dtype."""
    check_weight(op, w, f, k)
    if ids is not None and ids.dtype not in (int32, int64):
        raise DTypeError(f"{op}: ids have dtype {ids.dtype}; use int32 or int64", op=op)
    lead = tuple(w.shape[:1]) if ids is None else tuple(ids.shape)
    oshape = (*lead, k)
    odt = dtype if out is None else out.dtype
    if odt not in _FLOATS:
        raise DTypeError(f"{op}: out dtype {odt}; use float32, float16 or bfloat16", op=op)
    if out is not None:
        if out.shape != oshape:
            raise ShapeError(f"{op}: out has shape {out.shape}, expected {oshape} (rows "
                             f"{'of w' if ids is None else 'per id'}, K={k})", op=op)
        if not out.is_contiguous:
            raise ShapeError(f"{op}: out {out.shape} is not C-contiguous", op=op)
    return oshape, odt
