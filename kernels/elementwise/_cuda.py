"""The elementwise family on CUDA: kernel loading and launch geometry of ``saxpy``/``add``/
``mul`` (``elementwise.cu``) and the launches of ``softmax``, ``gelu``, ``silu`` and ``swiglu``
(``activations.cu``). Launches go through the driver (:class:`..runtime._driver.Launcher`,
:func:`..runtime._driver.fast_kernel`) on the stream handed in."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from deviceops.extend import Partition, Tensor, bfloat16, float16, float32, int32, int64

from ..runtime._driver import Launcher, launch_pdl, pdl_enabled
from ..runtime._module import expanded_source, load_module
from ..runtime._rows import CTYPE, MAX_BLOCKS, THREADS, grid, kernel_function, row_launch, vec_width

_CTYPE = {float32: "float", float16: "f16", bfloat16: "bf16", int32: "int", int64: "long long"}
_KERNELS = ("saxpy", "add", "mul", "saxpy_flat", "add_flat", "mul_flat")
_funcs: dict[tuple[int, str, Any], Any] = {}
_geom: dict[tuple[tuple[int, ...], tuple[int, ...] | None], tuple[Any, ...]] = {}


def _function(device_index: int, kernel: str, dtype: np.dtype[Any]) -> Any:
    key = (device_index, kernel, dtype)
    fn = _funcs.get(key)
    if fn is None:
        names = tuple(f"{k}<{_CTYPE[d]}>" for k in _KERNELS for d in _CTYPE)
        mod = load_module(expanded_source("elementwise/elementwise.cu"), device_id=device_index, name_expressions=names)
        fn = _funcs[key] = mod.get_function(f"{kernel}<{_CTYPE[dtype]}>")
    return fn


def _geometry(shape: tuple[int, ...], tile: tuple[int, ...] | None) -> tuple[Any, ...]:
    """(grid, block, rows, cols, tr, tc) for a tensor of ``shape`` split into ``tile``."""
    key = (shape, tile)
    g = _geom.get(key)
    if g is None:
        cols = shape[-1] if shape else 1
        rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
        if tile is None:
            tr, tc = 1, 1024
        else:
            tc = tile[-1]
            tr = math.prod(tile[:-1]) if len(tile) > 1 else 1
        gx, gy = max(1, -(-cols // tc)), max(1, min(-(-rows // tr), 65535))
        threads = min(256, max(32, tr * tc))
        g = _geom[key] = ((gx, gy), (threads,), np.int64(rows), np.int64(cols), np.int32(tr), np.int32(tc))
    return g


def _tile_of(arg: Any) -> tuple[int, ...] | None:
    return arg.tile_shape if isinstance(arg, Partition) else None


# -- fast launch -------------------------------------------------------------
_launchers: dict[tuple[int, str, Any], Launcher] = {}
_fgeom: dict[tuple[tuple[int, ...], tuple[int, ...] | None], tuple[Any, ...]] = {}
_CODES = {"saxpy": "pfpqqii", "add": "pppqqii", "mul": "pppqqii",
          "saxpy_flat": "pfpq", "add_flat": "pppq", "mul_flat": "pppq"}
_FLAT_NAMES = {"saxpy": "saxpy_flat", "add": "add_flat", "mul": "mul_flat"}
_FLAT_BLOCK = 256
_FLAT_MAX_BLOCKS = 132 * 32  # grid-stride beyond this


def _launcher(device_index: int, kernel: str, dtype: np.dtype[Any]) -> Launcher:
    key = (device_index, kernel, dtype)
    ln = _launchers.get(key)
    if ln is None:
        fn = _function(device_index, kernel, dtype)
        ln = _launchers[key] = Launcher(fn, _CODES[kernel], kernel, device_index)
    return ln


def _fast_geometry(shape: tuple[int, ...], tile: tuple[int, ...] | None) -> tuple[Any, ...]:
    """(flat, grid, block, geometry args) for :class:`Launcher`.

    Unpartitioned tensors use the flat kernels (one element per thread,
    geometry args ``(n,)``); a Partition uses the tiled kernels, one block per
    tile (geometry args ``(rows, cols, tr, tc)``).
    """
    key = (shape, tile)
    g = _fgeom.get(key)
    if g is None:
        if tile is None:
            n = math.prod(shape)
            blocks = max(1, min(-(-n // _FLAT_BLOCK), _FLAT_MAX_BLOCKS))
            g = (True, (blocks, 1, 1), (_FLAT_BLOCK, 1, 1), (n,))
        else:
            (gx, gy), (threads,), rows, cols, tr, tc = _geometry(shape, tile)
            g = (False, (gx, gy, 1), (threads, 1, 1), (int(rows), int(cols), int(tr), int(tc)))
        _fgeom[key] = g
    return g



def _driver_args(name: str, device_index: int, wa: Any, w_arg: Any, a: float, x: Tensor,
                 y: Tensor | None) -> tuple[Any, Any, Any, tuple[Any, ...]]:
    """``(launcher, grid, block, arguments)`` of a cuda launch writing ``wa`` (the output's
    array; ``w_arg`` its Tensor or Partition form): the flat kernel for an unpartitioned
    output, the tiled one otherwise; ``y`` None: saxpy (``a``, ``x``)."""
    flat, grid, block, geo = _fast_geometry(wa.shape, _tile_of(w_arg))
    ln = _launcher(device_index, _FLAT_NAMES[name] if flat else name, wa.dtype)
    if y is None:
        return ln, grid, block, (wa.data.ptr, a, x._array.data.ptr, *geo)
    return ln, grid, block, (wa.data.ptr, x._array.data.ptr, y._array.data.ptr, *geo)


def _submit(stream: Any, ln: Any, grid: Any, block: Any, args: tuple[Any, ...]) -> None:
    """The driver call of an elementwise launch (programmatic dependent launch while
    capturing on sm_90: the flat and the tiled kernels wait for their predecessor first)."""
    if stream.capture is not None and pdl_enabled(ln.device_index):
        launch_pdl(ln, grid, block, args, stream.native.ptr)
    else:
        ln(grid, block, args, stream.native.ptr)



_ACT_SOURCE = "elementwise/activations.cu"


def _act_names() -> tuple[str, ...]:
    """Every instantiation in ``activations.cu`` (one module)."""
    out = [f"{k}<{c}>" for k in ("softmax", "gelu", "silu") for c in CTYPE.values()]
    for c in CTYPE.values():
        out += [f"{k}<{c}, {v}>" for k in ("swiglu", "geglu")
                for v in (1, 16 // (4 if c == "float" else 2))]
    return tuple(out)


def softmax_cuda(device_index: int, out: Tensor, x: Tensor) -> Any:
    """A ``cuda(native_stream)`` launch function of ``softmax`` over the last dim."""
    fn = kernel_function(device_index, _ACT_SOURCE, f"softmax<{CTYPE[x.dtype]}>", _act_names())
    return row_launch(fn, out, x, (), ())


def activation_cuda(device_index: int, name: str, xa: Any, oa: Any) -> Any:
    """A ``cuda(native_stream)`` launch function of ``gelu`` or ``silu`` (CuPy arrays)."""
    n = xa.size
    fn = kernel_function(device_index, _ACT_SOURCE, f"{name}<{CTYPE[xa.dtype]}>", _act_names())
    blocks = min(max(1, -(-n // 256)), MAX_BLOCKS)

    def cuda(native: Any) -> None:
        if n > 0:
            fn((blocks,), (256,), (oa, xa, np.int64(n)), stream=native)

    return cuda


def swiglu_cuda(device_index: int, ga: Any, oa: Any, kind: str = "swiglu") -> Any:
    """A ``cuda(native_stream)`` launch function of ``swiglu`` (or ``kind`` ``"geglu"``;
    CuPy arrays)."""
    f = ga.shape[-1] // 2
    rows = ga.size // (2 * f)
    vec = vec_width(ga.dtype, f, (ga, oa))
    units = rows * (f // vec)
    fn = kernel_function(device_index, _ACT_SOURCE, f"{kind}<{CTYPE[ga.dtype]}, {vec}>", _act_names())
    args = (oa, ga, np.int64(rows), np.int32(f))
    blocks = grid(units)

    def cuda(native: Any) -> None:
        if units > 0:
            fn((blocks,), (THREADS,), args, stream=native)

    return cuda
