"""Elementwise kernels: ``saxpy``, ``add``, ``mul`` (CUDA source: ``src/elementwise.cu``).

| kernel                       | computes                  | writes             |
|------------------------------|---------------------------|--------------------|
| ``saxpy(z, a, x)``           | ``z = a * x + z``         | ``z`` (as given)   |
| ``add(x, y, out=None)``      | ``out = x + y``           | ``out`` or new     |
| ``mul(x, y, out=None)``      | ``out = x * y``           | ``out`` or new     |

All dtypes; float16/bfloat16 compute in float32; integer ``saxpy`` computes in
float64 and truncates toward zero. Shapes must match exactly (no broadcasting).
When the written argument is a :class:`~deviceops.Partition`, one CUDA block
runs per tile (``partition.grid``); otherwise tiles of 1024 elements.

Example:
    >>> stream = deviceops.default_device().new_stream()
    >>> z = api.zeros((16, 16)).sync_on(stream)
    >>> x = api.ones((16, 16)).sync_on(stream)
    >>> kernels.saxpy(z.partition((4, 4)), 2.0, x).sync_on(stream)  # z is now all 2.0
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from deviceops._context import ExecutionContext
from deviceops._dtypes import bfloat16, float16, float32, int32, int64, is_floating
from deviceops._errors import DTypeError, ShapeError
from deviceops._launch import launch
from deviceops._tensor import Partition, Tensor, allocate, check_device

from ._launch import KernelOp, as_tensor, contiguous, is_deferred
from ._module import load_module, read_source

__all__ = ["add", "mul", "saxpy"]

_CTYPE = {float32: "float", float16: "f16", bfloat16: "bf16", int32: "int", int64: "long long"}
_KERNELS = ("saxpy", "add", "mul")
_funcs: dict[tuple[int, str, Any], Any] = {}
_geom: dict[tuple[tuple[int, ...], tuple[int, ...] | None], tuple[Any, ...]] = {}


def _function(device_index: int, kernel: str, dtype: np.dtype[Any]) -> Any:
    key = (device_index, kernel, dtype)
    fn = _funcs.get(key)
    if fn is None:
        names = tuple(f"{k}<{_CTYPE[d]}>" for k in _KERNELS for d in _CTYPE)
        mod = load_module(read_source("elementwise.cu"), device_id=device_index, name_expressions=names)
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


def _check_pair(name: str, a: Tensor, b: Tensor, an: str, bn: str) -> None:
    if a.shape != b.shape:
        raise ShapeError(f"{name}: {an} shape {a.shape} != {bn} shape {b.shape} (no broadcasting)", op=name)
    if a.dtype != b.dtype:
        raise DTypeError(f"{name}: {an} dtype {a.dtype} != {bn} dtype {b.dtype}", op=name)
    if a.device is not b.device:
        raise ShapeError(f"{name}: {an} is on {a.device}, {bn} on {b.device}", op=name)


def _tile_of(arg: Any) -> tuple[int, ...] | None:
    return arg.tile_shape if isinstance(arg, Partition) else None


# -- saxpy ---------------------------------------------------------------------
def _saxpy_check(z: Tensor, x: Tensor) -> None:
    _check_pair("saxpy", z, x, "z", "x")
    contiguous(z, "saxpy", "z")
    contiguous(x, "saxpy", "x")


def _saxpy_run(ctx: ExecutionContext, z_arg: Any, a: float, x_arg: Any, checked: bool) -> Any:
    z = as_tensor(z_arg, "saxpy", "z")
    x = as_tensor(x_arg, "saxpy", "x")
    if not checked:
        _saxpy_check(z, x)
    stream = ctx.stream
    check_device(z, stream, "saxpy")
    za, xa, dt = z.array, x.array, z.dtype
    if stream.device.is_cpu:
        def cpu() -> None:
            if is_floating(dt):
                za[...] = (np.float32(a) * xa.astype(np.float32) + za.astype(np.float32)).astype(dt)
            else:
                za[...] = (np.float64(np.float32(a)) * xa.astype(np.float64) + za).astype(dt)

        launch(ctx, "saxpy", (x, z), (z,), cpu, _noop)
    else:
        fn = _function(stream.device.index, "saxpy", dt)
        grid, block, rows, cols, tr, tc = _geometry(z.shape, _tile_of(z_arg))
        args = (za, np.float32(a), xa, rows, cols, tr, tc)
        launch(ctx, "saxpy", (x, z), (z,), _noop, lambda s: fn(grid, block, args, stream=s))
    return z_arg


def _noop(*_: Any) -> None:
    pass


def saxpy(z: Any, a: float, x: Any) -> KernelOp:
    """``z = a * x + z``, in place; produces ``z`` in the form given.

    Args:
        z: Tensor, Partition (sets the launch grid) or DeviceOp producing one.
        a: scalar multiplier.
        x: Tensor or DeviceOp producing one, same shape and dtype as ``z``.
    """
    checked = not (is_deferred(z) or is_deferred(x))
    if checked:
        _saxpy_check(as_tensor(z, "saxpy", "z"), as_tensor(x, "saxpy", "x"))
    a = float(a)
    return KernelOp("saxpy", lambda ctx, z_, x_: _saxpy_run(ctx, z_, a, x_, checked), (z, x))


# -- add / mul -----------------------------------------------------------------
def _binary(name: str, x_arg: Any, y_arg: Any, out_arg: Any) -> KernelOp:
    deferred = any(is_deferred(v) for v in (x_arg, y_arg, out_arg))

    def check(x: Tensor, y: Tensor, out: Tensor | None) -> None:
        _check_pair(name, x, y, "x", "y")
        contiguous(x, name, "x")
        contiguous(y, name, "y")
        if out is not None:
            _check_pair(name, out, x, "out", "x")
            contiguous(out, name, "out")

    if not deferred:
        check(as_tensor(x_arg, name, "x"), as_tensor(y_arg, name, "y"),
              None if out_arg is None else as_tensor(out_arg, name, "out"))

    def run(ctx: ExecutionContext, xv: Any, yv: Any, ov: Any) -> Any:
        x, y = as_tensor(xv, name, "x"), as_tensor(yv, name, "y")
        o = None if ov is None else as_tensor(ov, name, "out")
        if deferred:
            check(x, y, o)
        stream = ctx.stream
        check_device(x, stream, name)
        if o is None:
            o = allocate(stream, x.shape, x.dtype, name)
            ov = o
        oa, xa, ya = o.array, x.array, y.array
        if stream.device.is_cpu:
            ufunc = np.add if name == "add" else np.multiply
            dt = x.dtype

            def cpu() -> None:
                if dt in (float16, bfloat16):
                    oa[...] = ufunc(xa.astype(np.float32), ya.astype(np.float32)).astype(dt)
                else:
                    ufunc(xa, ya, out=oa)

            launch(ctx, name, (x, y), (o,), cpu, _noop)
        else:
            fn = _function(stream.device.index, name, x.dtype)
            grid, block, rows, cols, tr, tc = _geometry(o.shape, _tile_of(ov))
            args = (oa, xa, ya, rows, cols, tr, tc)
            launch(ctx, name, (x, y), (o,), _noop, lambda s: fn(grid, block, args, stream=s))
        return ov

    return KernelOp(name, run, (x_arg, y_arg, out_arg))


def add(x: Any, y: Any, out: Any = None) -> KernelOp:
    """``out = x + y`` elementwise; allocates ``out`` if not given.

    Args:
        x, y: Tensors (or DeviceOps producing them) of equal shape and dtype.
        out: optional Tensor/Partition to write (a Partition sets the grid).
    """
    return _binary("add", x, y, out)


def mul(x: Any, y: Any, out: Any = None) -> KernelOp:
    """``out = x * y`` elementwise; allocates ``out`` if not given."""
    return _binary("mul", x, y, out)
