"""The norms on CUDA: ``layer_norm`` (row-wise, one warp or block a row) and ``rms_norm`` /
``add_rms_norm`` (one block a row); CUDA source ``norms.cu``.

``rms_norm`` holds a row in registers between the reduction and the store (``NV`` vectors of
``VEC`` elements per thread; 16-byte loads where the row length and the pointers allow), so
the input is read once and the output written once. The launch geometry is chosen from the
row length (:func:`norm_geometry`): a single short row (decode, ``(1, 768)``) gets one block
whose threads each load one vector, so the kernel's latency is one load, one block reduction
and one store. Its launch plan (kernel, grid, block) is kept in the runtime's plan cache,
keyed by (device, ``"rms_norm_cuda"``, dtype, shape and 16-byte alignment).

``add_rms_norm`` is the same kernel with a residual: ``s = x + residual`` is rounded to the
dtype, stored to ``residual_out`` and normalised (so the result equals an unfused ``add``
followed by ``rms_norm``). Without a residual it is ``rms_norm``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..runtime import _plan as plan_cache
from ..runtime._rows import CTYPE, MAX_BLOCKS, kernel_function, row_launch, vec_width

__all__ = ["layer_norm_cuda", "norm_cuda", "norm_geometry"]

_NVS = (0, 1, 2, 4, 8)  # vectors held per thread; 0 = row too long to hold: two passes
_MAX_THREADS = 1024
_MAX_HELD = 32  # floats of a row a thread may hold (64 registers at 1024 threads)
# Many rows: smaller blocks (several resident per SM, cheaper block reductions).
_MANY_ROWS = 256
_SOURCE = "norms/norms.cu"


def _names() -> tuple[str, ...]:
    """Every instantiation in ``norms.cu`` (one module)."""
    out = []
    for c in CTYPE.values():
        vecs = (1, 16 // (4 if c == "float" else 2))
        out += [f"add_rms_norm<{c}, {v}, {nv}>" for v in vecs for nv in _NVS if nv * v <= _MAX_HELD]
        out.append(f"layer_norm<{c}>")
    return tuple(out)


def layer_norm_cuda(device_index: int, out: Any, x: Any, extra: tuple[Any, ...],
                    tail: tuple[Any, ...]) -> Any:
    """A ``cuda(native_stream)`` launch function for ``layer_norm`` (Tensors ``out``, ``x``)."""
    fn = kernel_function(device_index, _SOURCE, f"layer_norm<{CTYPE[x.dtype]}>", _names())
    return row_launch(fn, out, x, extra, tail)


def norm_geometry(rows: int, cols: int, vec: int) -> tuple[int, int, int]:
    """``(blocks, threads, nv)`` for ``rows`` rows of ``cols`` elements loaded ``vec`` at a time.

    ``nv`` is the number of vectors each thread holds (at most 32 floats a thread, so a
    1024-thread block fits the register file; 0: the row does not fit, the kernel streams
    it twice). Pure logic, tested on the cpu backend.
    """
    nvec = -(-cols // vec)
    cap = 256 if rows >= _MANY_ROWS else _MAX_THREADS
    nvs = [nv for nv in _NVS[1:] if nv * vec <= _MAX_HELD]
    for nv in nvs:
        if nvec <= cap * nv:
            break
    else:
        nv = 0 if nvec > _MAX_THREADS * nvs[-1] else nvs[-1]
    if nv == 0:
        threads = _MAX_THREADS
    else:
        per = -(-nvec // nv)
        threads = max(32, min(_MAX_THREADS, (per + 31) // 32 * 32))
    return min(max(rows, 1), MAX_BLOCKS), threads, nv


def norm_cuda(device_index: int, out: Any, x: Any, weight: Any, eps: float,
              residual: Any = None, residual_out: Any = None) -> Any:
    """A ``cuda(native_stream)`` launch function for (add_)rms_norm over the last dim.

    Args:
        device_index: the CUDA device.
        out, x, weight: CuPy arrays (out and x of one shape, weight ``(D,)``).
        eps: added to the mean square.
        residual, residual_out: CuPy arrays of x's shape, or both ``None`` (plain rms_norm).
    """
    arrays = (out, x, weight) if residual is None else (out, x, weight, residual, residual_out)
    misaligned = 0
    for a in arrays:
        misaligned |= a.data.ptr
    key = (("cuda", device_index), "rms_norm_cuda", (), (x.dtype, x.shape, (misaligned & 15) == 0))
    plan = plan_cache.lookup(key)
    if plan is None:
        plan = plan_cache.store(key, _norm_plan(device_index, x, arrays))
    fn, grid, block, rows, cols = plan
    null = _NULL  # a null pointer: no residual
    args = (out, null if residual_out is None else residual_out, x,
            null if residual is None else residual, weight, rows, cols, np.float32(eps))

    def cuda(native: Any) -> None:
        if rows > 0:
            fn(grid, block, args, stream=native)

    return cuda


_NULL = np.uint64(0)


def _norm_plan(device_index: int, x: Any, arrays: tuple[Any, ...]) -> tuple[Any, ...]:
    """(kernel, grid, block, rows, cols) of one (device, dtype, shape, alignment)."""
    cols = int(x.shape[-1])
    rows = int(x.size // cols) if cols else 0
    vec = vec_width(x.dtype, cols, arrays)
    blocks, threads, nv = norm_geometry(rows, cols, vec)
    fn = kernel_function(device_index, _SOURCE, f"add_rms_norm<{CTYPE[x.dtype]}, {vec}, {nv}>", _names())
    return fn, (blocks,), (threads,), np.int64(rows), np.int32(cols)
