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

This module holds the kernel loading, launch geometry, the op and its launch-plan memo (the
hot path); the argument checks are in :mod:`._elementwise_check`, the ``cpu`` tasks (NumPy)
in :mod:`._elementwise_reference`.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import numpy as np

from deviceops.extend import (
    FRESH,
    DeviceOp,
    ExecutionContext,
    Partition,
    Storage,
    Tensor,
    allocate,
    bfloat16,
    check_device,
    float16,
    float32,
    int32,
    int64,
    launch,
    normalize_dtype,
    ordered,
    take_spare,
    trace_state,
    tracing,
)
from deviceops.extend import drive as _drive

from ._elementwise_check import _binary_check, _saxpy_check, _saxpy_scalar, _scalar_arg
from ._elementwise_reference import _cpu_task
from ._fastlaunch import Launcher, launch_packed, launch_pdl, pdl_enabled
from ._launch import KernelOp, as_tensor
from ._module import expanded_source, load_module

__all__ = ["add", "mul", "saxpy"]

_CTYPE = {float32: "float", float16: "f16", bfloat16: "bf16", int32: "int", int64: "long long"}
_KERNELS = ("saxpy", "add", "mul", "saxpy_flat", "add_flat", "mul_flat")
_funcs: dict[tuple[int, str, Any], Any] = {}
_geom: dict[tuple[tuple[int, ...], tuple[int, ...] | None], tuple[Any, ...]] = {}


def _function(device_index: int, kernel: str, dtype: np.dtype[Any]) -> Any:
    key = (device_index, kernel, dtype)
    fn = _funcs.get(key)
    if fn is None:
        names = tuple(f"{k}<{_CTYPE[d]}>" for k in _KERNELS for d in _CTYPE)
        mod = load_module(expanded_source("elementwise.cu"), device_id=device_index, name_expressions=names)
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


def _tensor_of(arg: Any, op: str, name: str) -> Tensor:
    if type(arg) is Tensor:
        return arg
    return as_tensor(arg, op, name)


class _ElementwiseOp(KernelOp):
    """``saxpy``/``add``/``mul``: one launch, on the hot path of every benchmark.

    Written out (no closures, no per-call validation when the arguments were
    concrete at construction, driver launch through :class:`Launcher`), because
    per-op host cost is what a chain of tiny ops measures.
    """

    __slots__ = ("_a", "_deferred", "_plan")

    def __init__(self, name: str, args: tuple[Any, ...], a: float, deferred: bool,
                 plan: _EwPlan | None = None) -> None:
        self._state = FRESH  # (DeviceOp.__init__, written out: this is the per-op hot path)
        self._ran_on = 0
        self._name = name
        self._run = _noop
        self._a = a
        self._deferred = deferred
        self._plan = plan
        if deferred:
            self._set_args(args)
        else:
            self._args = args
            self._dpos = ()

    def _finish(self, ctx: ExecutionContext, vals: list[Any]) -> Any:
        if not vals:
            return self._execute(ctx)
        args = list(self._args)
        for i, v in zip(self._dpos, vals, strict=True):
            args[i] = v
        return self._body(ctx, args)

    def _execute(self, ctx: ExecutionContext) -> Any:
        if self._dpos:
            return _drive(self, ctx)
        plan = self._plan
        stream = ctx.stream
        if plan is not None and plan.device is stream.device and trace_state.current is None:
            if plan.alloc is not None:
                # an allocating add/mul whose inputs and launch plan match an earlier one
                w = take_spare(stream, plan.spare)  # type: ignore[arg-type]
                if w is None:
                    shape, dt = plan.alloc
                    w = allocate(stream, shape, dt, self._name)
                a = self._args
                ordered(stream, (a[0]._storage, a[1]._storage), (w._storage,), plan.ln,
                        plan.grid, plan.block, (w._array.data.ptr, *plan.args), stream.native.ptr)
                return w
            # the launch plan of an identical earlier launch (see _memo); the storages come
            # from this op's own arguments (the memo holds none)
            a = self._args
            if self._name == "saxpy":
                w_arg, xt = a
                ws = (w_arg if type(w_arg) is Tensor else w_arg.tensor)._storage
                rs: tuple[Storage, ...] = (xt._storage, ws)
            else:
                w_arg = a[2]
                ws = (w_arg if type(w_arg) is Tensor else w_arg.tensor)._storage
                rs = (a[0]._storage, a[1]._storage)
            entry = plan.entry
            if stream.capture is None and entry is not None:
                # the packed parameters of that launch: the driver call without re-hashing them
                ordered(stream, rs, (ws,), launch_packed, plan.ln, plan.grid, plan.block, 0,
                        stream.native.ptr, entry)
            else:
                ordered(stream, rs, (ws,), _submit, stream, plan.ln, plan.grid, plan.block,
                        plan.args)
            return w_arg
        return self._body(ctx, self._args)

    def _body(self, ctx: ExecutionContext, vals: Any) -> Any:
        name = self._name
        stream = ctx.stream
        if name == "saxpy":
            w_arg, x_arg = vals
            w = _tensor_of(w_arg, name, "z")
            x = _tensor_of(x_arg, name, "x")
            y = None
            if self._deferred:
                _saxpy_check(w, x)
                _saxpy_scalar(self._a, w.dtype)
        else:
            x_arg, y_arg, w_arg = vals
            x = _tensor_of(x_arg, name, "x")
            y = _tensor_of(y_arg, name, "y")
            if w_arg is None:
                if self._deferred:
                    _binary_check(name, x, y, None)
                w_arg = w = allocate(stream, x.shape, x.dtype, name)
            else:
                w = _tensor_of(w_arg, name, "out")
                if self._deferred:
                    _binary_check(name, x, y, w)
        if w._storage.device is not stream.device or x._storage.device is not stream.device:
            check_device(w, stream, name)
            check_device(x, stream, name)
        if y is not None and y._storage.device is not stream.device:
            check_device(y, stream, name)
        if stream.device.is_cpu or tracing():
            return self._launch_general(ctx, w_arg, w, x, y)
        # cuda, untraced: the driver call, ordered like a launch (extend.ordered)
        wa = w._array
        ln, grid, block, args = _driver_args(name, stream.device.index, wa, w_arg, self._a, x, y)
        ws = w._storage
        rs: tuple[Storage, ...] = (x._storage, ws) if y is None else (x._storage, y._storage)
        ordered(stream, rs, (ws,), _submit, stream, ln, grid, block, args)
        if not self._deferred and y is not None and self._args[2] is None:  # allocated out
            _alloc_memo[name] = (weakref.ref(x), weakref.ref(y), _EwPlan(
                stream.device, ln, grid, block, args[1:], (wa.shape, wa.dtype)))
        elif not self._deferred and type(w_arg) in (Tensor, Partition):
            _remember(name, w, x, y, self._a, _EwPlan(stream.device, ln, grid, block, args),
                      _tile_of(w_arg))
        return w_arg

    def _launch_general(self, ctx: ExecutionContext, w_arg: Any, w: Tensor, x: Tensor, y: Tensor | None) -> Any:
        """cpu backend, or tracing: through :func:`deviceops.extend.launch`."""
        name, stream = self._name, ctx.stream
        reads = (x, w) if y is None else (x, y)
        if stream.device.is_cpu:
            launch(ctx, name, reads, (w,), _cpu_task(name, self._a, w, x, y), _noop)
            return w_arg
        ln, grid, block, args = _driver_args(name, stream.device.index, w._array, w_arg, self._a, x, y)
        sptr = stream.native.ptr
        launch(ctx, name, reads, (w,), _noop, lambda _s: ln(grid, block, args, sptr))
        return w_arg


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


def _noop(*_: Any) -> None:
    pass


def _submit(stream: Any, ln: Any, grid: Any, block: Any, args: tuple[Any, ...]) -> None:
    """The driver call of an elementwise launch (programmatic dependent launch while
    capturing on sm_90: the flat and the tiled kernels wait for their predecessor first)."""
    if stream.capture is not None and pdl_enabled(ln.device_index):
        launch_pdl(ln, grid, block, args, stream.native.ptr)
    else:
        ln(grid, block, args, stream.native.ptr)


# -- launch-plan memo ----------------------------------------------------------
# The last cuda launch of each kernel, keyed by the identity of its tensors
# (held weakly) and its scalar. A loop that repeats the same launch -- the
# common case for tiny ops -- skips validation, geometry and argument
# packing: the plan is reused as is. Tensors never change their memory or
# layout, so identity is enough. A plan holds pointers and the launcher, never a
# tensor or storage: the memo keeps nothing of the caller's alive.
class _EwPlan:
    """The cuda launch of one elementwise op: launcher, geometry, packed-argument tuple
    (an allocating op's: the arguments after the output pointer, and ``alloc`` = the
    output's ``(shape, dtype)``)."""

    __slots__ = ("alloc", "args", "block", "device", "entry", "grid", "ln", "spare")

    def __init__(self, device: Any, ln: Any, grid: Any, block: Any, args: tuple[Any, ...],
                 alloc: tuple[Any, Any] | None = None) -> None:
        self.device, self.ln, self.grid, self.block = device, ln, grid, block
        self.args, self.alloc = args, alloc
        # an allocating op's spare-array key (deviceops.extend.take_spare)
        self.spare = None if alloc is None else (alloc[0], id(normalize_dtype(alloc[1])))
        # the launcher's packed-parameter entry for ``args`` (kept alive here; None if the
        # launch was not packed by ``ln``, e.g. a PDL launch while capturing)
        self.entry: tuple[Any, ...] | None = ln._cache.get(args) if alloc is None else None


_memo: dict[str, tuple[Any, ...]] = {}


def _remember(name: str, w: Tensor, x: Tensor, y: Tensor | None, a: float, plan: _EwPlan,
              tile: tuple[int, ...] | None) -> None:
    _memo[name] = (weakref.ref(w), weakref.ref(x), None if y is None else weakref.ref(y), a, plan,
                   tile)


# allocating add/mul: the last launch's inputs (weakly) and its plan less the output
_alloc_memo: dict[str, tuple[Any, Any, _EwPlan]] = {}


def _recall(name: str, w: Any, x: Any, y: Any, a: float,
            tile: tuple[int, ...] | None = None) -> _EwPlan | None:
    """The plan of the last launch of ``name`` if it had these tensors, scalar and tiling
    (``tile``: the output Partition's tile shape, ``None`` for a plain Tensor)."""
    m = _memo.get(name)
    if m is None or m[3] != a or m[0]() is not w or m[1]() is not x or m[5] != tile:
        return None
    yr = m[2]
    if (yr() if yr is not None else None) is not y:
        return None
    return m[4]


# -- saxpy ---------------------------------------------------------------------
def saxpy(z: Any, a: float, x: Any) -> KernelOp:
    """``z = a * x + z``, in place; produces ``z`` in the form given.

    Args:
        z: Tensor, Partition (sets the launch grid) or DeviceOp producing one.
        a: scalar multiplier.
        x: Tensor or DeviceOp producing one, same shape and dtype as ``z``.
    """
    if type(a) is not float:
        a = _scalar_arg(a)
    if type(x) is Tensor:
        tz = type(z)
        plan = (_recall("saxpy", z, x, None, a) if tz is Tensor else
                _recall("saxpy", z.tensor, x, None, a, z.tile_shape) if tz is Partition else None)
        if plan is not None:  # identical to the last launch: already validated
            return _ElementwiseOp("saxpy", (z, x), a, False, plan)
    deferred = isinstance(z, DeviceOp) or isinstance(x, DeviceOp)
    if not deferred:
        zt = _tensor_of(z, "saxpy", "z")
        _saxpy_check(zt, _tensor_of(x, "saxpy", "x"))
        _saxpy_scalar(a, zt.dtype)
    elif z is None or x is None:
        _tensor_of(z, "saxpy", "z")
        _tensor_of(x, "saxpy", "x")
    return _ElementwiseOp("saxpy", (z, x), a, deferred)


# -- add / mul -----------------------------------------------------------------
def _binary(name: str, x: Any, y: Any, out: Any) -> KernelOp:
    if type(x) is Tensor and type(y) is Tensor:
        if out is None:
            m = _alloc_memo.get(name)  # (_recall_alloc, written out: the hot path)
            if m is not None and m[0]() is x and m[1]() is y:
                # the inputs of the last allocating launch: validated
                return _ElementwiseOp(name, (x, y, None), 0.0, False, m[2])
        to = type(out)
        plan = (_recall(name, out, x, y, 0.0) if to is Tensor else
                _recall(name, out.tensor, x, y, 0.0, out.tile_shape) if to is Partition else None)
        if plan is not None:  # identical to the last launch: already validated
            return _ElementwiseOp(name, (x, y, out), 0.0, False, plan)
    deferred = isinstance(x, DeviceOp) or isinstance(y, DeviceOp) or isinstance(out, DeviceOp)
    if not deferred:
        _binary_check(name, _tensor_of(x, name, "x"), _tensor_of(y, name, "y"),
                      None if out is None else _tensor_of(out, name, "out"))
    elif x is None or y is None:
        _tensor_of(x, name, "x")
        _tensor_of(y, name, "y")
    return _ElementwiseOp(name, (x, y, out), 0.0, deferred)


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
