"""The CUDA half of ``rms_norm`` and ``add_rms_norm``: one kernel, one block per row.

CUDA source: ``src/transformer.cu``. A row is held in registers between the reduction and the
store (``NV`` vectors of ``VEC`` elements per thread; 16-byte loads where the row length
and the pointers allow), so the input is read once and the output written once. The
launch geometry is chosen from the row length (:func:`norm_geometry`): a single short row
(decode, ``(1, 768)``) gets one block whose threads each load one vector, so the kernel's
latency is one load, one block reduction and one store.

``add_rms_norm`` is the same kernel with a residual: ``s = x + residual`` is rounded to the
dtype, stored to ``residual_out`` and normalised (so the result equals an unfused ``add``
followed by ``rms_norm``). Without a residual it is ``rms_norm``.

This module also loads ``src/transformer.cu`` (with ``src/sampling.cu``) for every kernel in
it (:func:`tk_function`: rope, rope_kv_write, swiglu, merge_heads, sample) and holds the
elementwise launch geometry of those kernels (``_THREADS``, ``_grid``) and :func:`vec_width`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from deviceops.extend import bfloat16, float16, float32

from ._fastlaunch import fast_kernel
from ._module import expanded_source, load_module, read_source

__all__ = ["CTYPE", "MOVE_TYPES", "norm_cuda", "norm_geometry", "tk_function", "vec_width"]

_CTYPE = {float32: "float", float16: "f16", bfloat16: "bf16"}
_NVS = (0, 1, 2, 4, 8)  # vectors held per thread; 0 = row too long to hold: two passes
_MAX_THREADS = 1024
_MAX_HELD = 32  # floats of a row a thread may hold (64 registers at 1024 threads)
_MAX_BLOCKS = 1 << 20
# Many rows: smaller blocks (several resident per SM, cheaper block reductions).
_MANY_ROWS = 256


def _names() -> tuple[str, ...]:
    """Every instantiation in ``src/transformer.cu`` (one module for the transformer kernels)."""
    out = []
    for c in _CTYPE.values():
        vecs = (1, 16 // (4 if c == "float" else 2))
        out += [f"add_rms_norm<{c}, {v}, {nv}>" for v in vecs for nv in _NVS if nv * v <= _MAX_HELD]
        out += [f"{k}<{c}, {v}>" for k in ("rope", "rope_kv_write", "swiglu") for v in vecs]
        out.append(f"sample<{c}>")
    out += [f"merge_heads<{e}>" for e in MOVE_TYPES.values()]
    return tuple(out)


# bytes moved per access -> the CUDA type (merge_heads copies bits)
MOVE_TYPES = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short"}
CTYPE = _CTYPE

_funcs: dict[tuple[int, str], Any] = {}
_THREADS = 256  # threads of the elementwise transformer.cu kernels (rope, swiglu, merge_heads)


def _grid(units: int) -> int:
    return min(max(1, -(-units // _THREADS)), _MAX_BLOCKS)


def tk_function(device_index: int, expr: str) -> Any:
    """The compiled kernel ``expr`` (e.g. ``"rope<f16, 8>"``) of ``src/transformer.cu`` +
    ``src/sampling.cu`` (one module)."""
    key = (device_index, expr)
    fn = _funcs.get(key)
    if fn is None:
        src = expanded_source("transformer.cu") + "\n" + read_source("sampling.cu")
        mod = load_module(src, device_id=device_index, name_expressions=_names())
        fn = _funcs[key] = fast_kernel(mod.get_function(expr), expr, device_index)
    return fn


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
    return min(max(rows, 1), _MAX_BLOCKS), threads, nv


def vec_width(dtype: np.dtype[Any], cols: int, arrays: tuple[Any, ...]) -> int:
    """Elements per 16-byte access if ``cols`` is a multiple of it and every array is aligned, else 1."""
    vec = 16 // dtype.itemsize
    if cols % vec or any(a.data.ptr % 16 for a in arrays):
        return 1
    return vec


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
    key = (device_index, x.dtype, x.shape, (misaligned & 15) == 0)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _norm_plan(device_index, x, arrays)
    fn, grid, block, rows, cols = plan
    null = _NULL  # a null pointer: no residual
    args = (out, null if residual_out is None else residual_out, x,
            null if residual is None else residual, weight, rows, cols, np.float32(eps))

    def cuda(native: Any) -> None:
        if rows > 0:
            fn(grid, block, args, stream=native)

    return cuda


_NULL = np.uint64(0)
_plans: dict[tuple[Any, ...], tuple[Any, ...]] = {}


def _norm_plan(device_index: int, x: Any, arrays: tuple[Any, ...]) -> tuple[Any, ...]:
    """(kernel, grid, block, rows, cols) of one (device, dtype, shape, alignment)."""
    cols = int(x.shape[-1])
    rows = int(x.size // cols) if cols else 0
    vec = vec_width(x.dtype, cols, arrays)
    blocks, threads, nv = norm_geometry(rows, cols, vec)
    fn = tk_function(device_index, f"add_rms_norm<{_CTYPE[x.dtype]}, {vec}, {nv}>")
    return fn, (blocks,), (threads,), np.int64(rows), np.int32(cols)
