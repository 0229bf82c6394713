"""Launch geometry and kernel loading shared by the row-wise and vector kernels.

The norms, activations, lookup, transformer and sampling families launch small kernels over
``(rows, cols) = (prod(shape[:-1]), shape[-1])`` or over flat element counts; their CUDA
sources include ``runtime/include/rows.cuh``. Row-wise kernels get one warp per row up to
1024 columns, else one block per row (:func:`row_geometry`); blocks stride over rows
beyond :data:`MAX_BLOCKS`. A family loads its own ``.cu`` file through
:func:`kernel_function` (one module per source, every instantiation named up front) and
launches through :func:`..runtime._driver.fast_kernel` on the stream handed in.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from deviceops.extend import Tensor, bfloat16, float16, float32, int32, int64

from ._driver import fast_kernel
from ._module import expanded_source, load_module

__all__ = ["BITS", "CTYPE", "ITYPE", "MAX_BLOCKS", "MOVE_TYPES", "THREADS", "grid", "kernel_function",
           "row_geometry", "row_launch", "vec_width"]

#: The CUDA storage type of each floating dtype (``float16_types.cuh``).
CTYPE = {float32: "float", float16: "f16", bfloat16: "bf16"}
#: The CUDA type of each index dtype.
ITYPE = {int32: "int", int64: "long long"}
#: The unsigned type of each element size (a gather copies bits, never converts).
BITS = {2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}
#: Bytes moved per access -> the CUDA type (``merge_heads`` copies bits).
MOVE_TYPES = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short"}
MAX_BLOCKS = 1 << 20  # blocks stride over the rows / elements beyond this
THREADS = 256  # threads of the flat (one thread per unit) kernels

_funcs: dict[tuple[int, str, str], Any] = {}


def kernel_function(device_index: int, source: str, expr: str, names: tuple[str, ...]) -> Any:
    """The compiled kernel ``expr`` (``"rope<f16, 8>"``) of ``source`` (``"family/file.cu"``),
    whose module is compiled once with every instantiation in ``names``."""
    key = (device_index, source, expr)
    fn = _funcs.get(key)
    if fn is None:
        mod = load_module(expanded_source(source), device_id=device_index, name_expressions=names)
        fn = _funcs[key] = fast_kernel(mod.get_function(expr), expr, device_index)
    return fn


def grid(units: int) -> int:
    """Blocks of :data:`THREADS` threads for ``units`` units (at most :data:`MAX_BLOCKS`)."""
    return min(max(1, -(-units // THREADS)), MAX_BLOCKS)


def vec_width(dtype: np.dtype[Any], cols: int, arrays: tuple[Any, ...]) -> int:
    """Elements per 16-byte access if ``cols`` is a multiple of it and every array is aligned, else 1."""
    vec = 16 // dtype.itemsize
    if cols % vec or any(a.data.ptr % 16 for a in arrays):
        return 1
    return vec


def row_geometry(rows: int, cols: int) -> tuple[int, int, int]:
    """(blocks, threads, threads per row): a warp per row up to 1024 columns, else a block."""
    rows = max(rows, 1)  # (no launch happens for 0 rows)
    if cols <= 1024:
        threads = 32 * min(8, rows)
        return min(-(-rows // (threads // 32)), MAX_BLOCKS), threads, 32
    threads = 512 if cols <= 8192 else 1024
    return min(rows, MAX_BLOCKS), threads, threads


def row_launch(fn: Any, out: Tensor, x: Tensor, extra: tuple[Any, ...], tail: tuple[Any, ...]) -> Any:
    """The cuda half of a row-wise launch of ``fn``: ``fn(out, x, *extra, rows, cols, *tail,
    tpr)``, as a ``cuda(native_stream)`` function."""
    rows, cols = math.prod(x.shape[:-1]), x.shape[-1]
    blocks, threads, tpr = row_geometry(rows, cols)
    args = (out.array, x.array, *extra, np.int64(rows), np.int32(cols), *tail, np.int32(tpr))

    def cuda(native: Any) -> None:
        if rows > 0:
            fn((blocks,), (threads,), args, stream=native)

    return cuda


