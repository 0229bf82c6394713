"""Lookup kernels as DeviceOps: embedding gather and argmax.

The ``cpu`` backend runs the NumPy references of :mod:`._reference`; on CUDA the kernels of
:mod:`._cuda` (``lookup.cu``). Row inputs are checked by :func:`..runtime._checks.row_input`.

| launcher                              | computes                                              |
|---------------------------------------|-------------------------------------------------------|
| ``embedding(ids, table, *, out)``     | ``table[ids]``: ``(*ids.shape, D)``, ids clamped      |
| ``argmax(x, *, out, dtype)``          | index of the first maximum: ``x.shape[:-1]``          |

``embedding`` gathers rows of any dtype of the library by ids of int32 or int64; ``argmax``
reduces a float32, float16 or bfloat16 ``x`` over its last dim to int32 or int64 indices.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from deviceops.extend import (
    DTypeError,
    ExecutionContext,
    ShapeError,
    Tensor,
    int32,
    int64,
    launch,
    normalize_dtype,
)

from ..runtime._builder import Body, Check, check_out, noop
from ..runtime._checks import row_input
from ..runtime._op import KernelOp
from ..runtime._spec import KernelSpec
from ._cuda import argmax_cuda, embedding_cuda
from ._reference import argmax_reference, embedding_reference

__all__ = ["argmax", "embedding"]

def embedding(ids: Any, table: Any, *, out: Any = None) -> KernelOp:
    """Gather rows of ``table``: ``out[..., :] = table[ids[...], :]``.

    Ids should be in ``[0, V)``. They usually come from the device (a previous
    ``argmax``), so they cannot be checked before launch. An id outside the range is
    **clamped** into it on both backends (a negative id reads row 0, an id ``>= V``
    row ``V - 1``; no wrap-around), so the op never reads outside the table and both
    backends give the same answer. Check ids on the host first when they come from
    untrusted input.

    Args:
        ids: int32 or int64 Tensor (or Partition, or DeviceOp producing one) of any shape.
        table: ``(V, D)`` Tensor of any supported dtype, C-contiguous.
        out: optional ``(*ids.shape, D)`` output of the table's dtype; allocated if ``None``.

    Returns:
        A :class:`KernelOp` producing ``out`` in the form given.

    Raises:
        ShapeError, DTypeError: before any launch.
    """
    return _EMBEDDING.op((ids, table, out))


def _embedding_parts() -> tuple[Check, Body]:
    name = "embedding"

    def check(ts: Mapping[str, Tensor | None]) -> tuple[tuple[int, ...], np.dtype[Any]]:
        it, tt = ts["ids"], ts["table"]
        assert it is not None and tt is not None
        if it.dtype not in (int32, int64):
            raise DTypeError(f"{name}: ids have dtype {it.dtype}; use int32 or int64", op=name)
        if tt.ndim != 2 or min(tt.shape) < 1:
            raise ShapeError(f"{name}: table has shape {tt.shape}; expected (V, D) with V, D >= 1",
                             op=name)
        if tt.shape[1] > 2**31 - 1:
            raise ShapeError(f"{name}: table rows of {tt.shape[1]} elements are too long", op=name)
        oshape = (*it.shape, tt.shape[1])
        check_out(name, ts["out"], oshape, tt.dtype, f"ids {it.shape} gather rows of table {tt.shape}")
        return oshape, tt.dtype

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        it, tt, o = ts["ids"], ts["table"], ts["out"]
        ia, ta, oa = it.array, tt.array, o.array

        def cpu() -> None:
            oa[...] = embedding_reference(ia, ta)

        cuda = embedding_cuda(ctx.device.index, oa, ta, ia) if not ctx.device.is_cpu else noop

        launch(ctx, name, (it, tt), (o,), cpu, cuda)

    return check, body


_EMBEDDING = KernelSpec("embedding", ("ids", "table", "out"), _embedding_parts, replay=True)


def argmax(x: Any, *, out: Any = None, dtype: Any = "int32") -> KernelOp:
    """Index of the maximum over the last dim (the first one on ties, as NumPy).

    NaN counts as larger than every number (the first NaN wins), as in NumPy.

    Args:
        x: ``(..., D)`` Tensor, Partition or DeviceOp producing one (float32, float16,
            bfloat16; C-contiguous), ``D >= 1``.
        out: optional int32 or int64 output of shape ``x.shape[:-1]``; its dtype wins
            over ``dtype``. Allocated (of ``dtype``) if ``None``.
        dtype: ``"int32"`` (default) or ``"int64"``, for an allocated output.

    Returns:
        A :class:`KernelOp` producing ``out`` in the form given.

    Raises:
        ShapeError, DTypeError: before any launch.

    Example:
        >>> next_token = kernels.argmax(logits, out=token_buf)   # (1, V) -> (1,)
    """
    if dtype not in ("int32", "int64"):  # (a str static: cheap to hash, unlike a dtype)
        dt = normalize_dtype(dtype, op="argmax")
        if dt not in (int32, int64):
            raise DTypeError(f"argmax: index dtype {dt} must be int32 or int64", op="argmax")
        dtype = dt.name
    return _ARGMAX.op((x, out), (dtype,))


def _argmax_parts(want_name: str) -> tuple[Check, Body]:
    name = "argmax"
    want = np.dtype(want_name)

    def check(ts: Mapping[str, Tensor | None]) -> tuple[tuple[int, ...], np.dtype[Any]]:
        x, o = ts["x"], ts["out"]
        assert x is not None
        row_input(name, x)
        oshape = x.shape[:-1]
        if o is not None:
            if o.dtype not in (int32, int64):
                raise DTypeError(f"{name}: out has dtype {o.dtype}; use int32 or int64", op=name)
            check_out(name, o, oshape, o.dtype, f"x {x.shape} reduced over its last dim")
            return oshape, o.dtype
        return oshape, want

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        x, o = ts["x"], ts["out"]
        xa, oa, odt = x.array, o.array, o.dtype

        def cpu() -> None:
            oa[...] = argmax_reference(xa, odt)

        cuda = argmax_cuda(ctx.device.index, o, x) if not ctx.device.is_cpu else noop
        launch(ctx, name, (x,), (o,), cpu, cuda)

    return check, body


_ARGMAX = KernelSpec("argmax", ("x", "out"), _argmax_parts, replay=True)
