"""The CUDA half of ``layer_norm``, ``softmax``, ``gelu``, ``silu``, ``embedding`` and ``argmax``.

CUDA source: ``src/nn_ops.cu`` (one module, every instantiation named up front). Row-wise
kernels get one warp per row up to 1024 columns, else one block per row
(:func:`_row_geometry`); blocks stride over rows beyond ``_MAX_BLOCKS``. Launches go through
:func:`._fastlaunch.fast_kernel` on the stream handed in. ``rms_norm`` and
``add_rms_norm`` run the kernel of :mod:`._norms` instead.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from deviceops.extend import ExecutionContext, Tensor, bfloat16, float16, float32, int32, int64

from ._fastlaunch import fast_kernel
from ._module import expanded_source, load_module

_CTYPE = {float32: "float", float16: "f16", bfloat16: "bf16"}
_ITYPE = {int32: "int", int64: "long long"}
_BITS = {2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}


def _names() -> tuple[str, ...]:
    names = [f"{k}<{c}>" for k in ("layer_norm", "softmax", "gelu", "silu")
             for c in _CTYPE.values()]
    names += [f"argmax<{c}, {i}>" for c in _CTYPE.values() for i in _ITYPE.values()]
    names += [f"embedding<{e}, {i}>" for e in _BITS.values() for i in _ITYPE.values()]
    return tuple(names)


_funcs: dict[tuple[int, str], Any] = {}


def _function(device_index: int, expr: str) -> Any:
    key = (device_index, expr)
    fn = _funcs.get(key)
    if fn is None:
        mod = load_module(expanded_source("nn_ops.cu"), device_id=device_index, name_expressions=_names())
        fn = _funcs[key] = fast_kernel(mod.get_function(expr), expr, device_index)
    return fn


_MAX_BLOCKS = 1 << 20  # blocks stride over the rows / elements beyond this


def _row_geometry(rows: int, cols: int) -> tuple[int, int, int]:
    """(blocks, threads, threads per row): a warp per row up to 1024 columns, else a block."""
    rows = max(rows, 1)  # (no launch happens for 0 rows)
    if cols <= 1024:
        threads = 32 * min(8, rows)
        return min(-(-rows // (threads // 32)), _MAX_BLOCKS), threads, 32
    threads = 512 if cols <= 8192 else 1024
    return min(rows, _MAX_BLOCKS), threads, threads


def _rows_cols(shape: tuple[int, ...]) -> tuple[int, int]:
    return math.prod(shape[:-1]), shape[-1]


def _row_launch(ctx: ExecutionContext, kernel: str, out: Tensor, x: Tensor, extra: tuple[Any, ...],
                tail: tuple[Any, ...]) -> Any:
    """The cuda half of a row-wise launch: ``kernel<T>(out, x, *extra, rows, cols, *tail, tpr)``."""
    rows, cols = _rows_cols(x.shape)
    blocks, threads, tpr = _row_geometry(rows, cols)
    expr = f"{kernel}<{_CTYPE[x.dtype]}>" if kernel != "argmax" else (
        f"argmax<{_CTYPE[x.dtype]}, {_ITYPE[out.dtype]}>")
    fn = _function(ctx.device.index, expr)
    args = (out.array, x.array, *extra, np.int64(rows), np.int32(cols), *tail, np.int32(tpr))

    def cuda(native: Any) -> None:
        if rows > 0:
            fn((blocks,), (threads,), args, stream=native)

    return cuda
