"""The argument checks several kernel families share (floating inputs, row inputs reduced over
their last dim, matching shapes, distinct outputs), and (re-exported from
:mod:`._builder`) :func:`multi_op`, the builder of kernel ops with several outputs such as
``add_rms_norm`` (``out`` and ``residual_out``, the latter defaulting to ``residual``) and
``rope_kv_write`` (``q_out`` allocated, the caches written in place).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from deviceops.extend import FLOATING, DTypeError, ShapeError, Tensor

from ._builder import Body, Check, MultiCheck, Outputs, check_out, multi_op

__all__ = ["Body", "Check", "MultiCheck", "Outputs", "distinct", "floating", "multi_op", "row_input", "same",
           "same_as_x"]

# -- shared checks ---------------------------------------------------------------------------


def floating(name: str, what: str, t: Tensor) -> None:
    """Refuse a non-floating tensor ``what`` of op ``name`` (``DTypeError``)."""
    if t.dtype not in FLOATING:
        raise DTypeError(f"{name}: {what} has dtype {t.dtype}; supported: float32, float16, "
                         "bfloat16", op=name)


def same(name: str, what: str, t: Tensor, shape: tuple[int, ...], dtype: np.dtype[Any],
         why: str) -> None:
    """Refuse ``t`` unless it has ``shape`` and ``dtype`` (``ShapeError`` / ``DTypeError``)."""
    if t.shape != shape:
        raise ShapeError(f"{name}: {what} has shape {t.shape}, expected {shape} ({why})", op=name)
    if t.dtype != dtype:
        raise DTypeError(f"{name}: {what} has dtype {t.dtype}, expected {dtype} ({why})", op=name)


def distinct(name: str, ts: Mapping[str, Tensor | None], pairs: tuple[tuple[str, str], ...],
             fix: str) -> None:
    """Refuse (``ShapeError``) each pair of given tensors that share storage."""
    for a, b in pairs:
        ta, tb = ts.get(a), ts.get(b)
        if ta is not None and tb is not None and ta._storage is tb._storage:
            raise ShapeError(f"{name}: {a} {ta.shape} shares memory with {b} {tb.shape}; {fix}",
                             op=name)


def row_input(name: str, x: Tensor) -> None:
    floating(name, "x", x)
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ShapeError(f"{name}: x has shape {x.shape}; it needs a last dim >= 1 "
                         "(the op works over the last dim)", op=name)
    if x.shape[-1] > 2**31 - 1:
        raise ShapeError(f"{name}: x rows of {x.shape[-1]} elements are too long", op=name)


def same_as_x(name: str) -> Check:
    def check(ts: Mapping[str, Tensor | None]) -> tuple[tuple[int, ...], np.dtype[Any]]:
        x = ts["x"]
        assert x is not None
        row_input(name, x)
        check_out(name, ts["out"], x.shape, x.dtype, f"the shape and dtype of x {x.shape} {x.dtype}")
        return x.shape, x.dtype

    return check
