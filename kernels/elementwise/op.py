"""The elementwise family as DeviceOps: ``saxpy``, ``add``, ``mul`` and the activations
``softmax``, ``gelu``, ``silu``, ``swiglu``.

| kernel                         | computes                                                  | writes           |
|--------------------------------|-----------------------------------------------------------|------------------|
| ``saxpy(z, a, x)``             | ``z = a * x + z``                                         | ``z`` (as given) |
| ``add(x, y, out=None)``        | ``out = x + y``                                           | ``out`` or new   |
| ``mul(x, y, out=None)``        | ``out = x * y``                                           | ``out`` or new   |
| ``softmax(x, *, out)``         | ``exp(x - max) / sum(exp(x - max))`` over the last dim    | ``out`` or new   |
| ``gelu(x, *, out)``            | tanh-approximate GELU (as the GEMM epilogue)              | ``out`` or new   |
| ``silu(x, *, out)``            | ``x * sigmoid(x)``                                        | ``out`` or new   |
| ``swiglu(gate_up, *, out)``    | ``silu(gate_up[..., :F]) * gate_up[..., F:]``             | ``out`` or new   |
| ``geglu(gate_up, *, out)``     | ``gelu(gate_up[..., :F]) * gate_up[..., F:]`` (tanh)      | ``out`` or new   |

``saxpy``/``add``/``mul``: all dtypes; float16/bfloat16 compute in float32; integer ``saxpy``
computes in float64 and truncates toward zero. Shapes must match exactly (no broadcasting).
When the written argument is a :class:`~deviceops.Partition`, one CUDA block runs per tile
(``partition.grid``); otherwise the flat kernels. They are written out as one op class
(:class:`_ElementwiseOp`, no per-call validation of a repeated launch: :mod:`._plan`), since
per-op host cost is what a chain of tiny ops measures.

Activations: float32, float16 or bfloat16, C-contiguous; float32 math, one rounding on
store. ``out`` may be the input itself for ``softmax``, ``gelu`` and ``silu`` (not for
``swiglu``, whose output is half the input's last dim); they are :class:`KernelSpec` s
(checks cached in the plan cache, launches replayed).

Example:
    >>> stream = deviceops.default_device().new_stream()
    >>> z = api.zeros((16, 16)).sync_on(stream)
    >>> x = api.ones((16, 16)).sync_on(stream)
    >>> kernels.saxpy(z.partition((4, 4)), 2.0, x).sync_on(stream)  # z is now all 2.0
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from deviceops.extend import (
    FRESH,
    DeviceOp,
    ExecutionContext,
    Partition,
    ShapeError,
    Storage,
    Tensor,
    allocate,
    check_device,
    launch,
    ordered,
    take_spare,
    trace_state,
    tracing,
)
from deviceops.extend import drive as _drive

from ..runtime._builder import Body, Check, check_out, noop
from ..runtime._checks import MultiCheck, Outputs, distinct, floating, same_as_x
from ..runtime._cpu import reference_mode
from ..runtime._driver import launch_packed
from ..runtime._op import KernelOp, as_tensor
from ..runtime._spec import KernelSpec
from ._check import _binary_check, _saxpy_check, _saxpy_scalar, _scalar_arg
from ._cpu import _cpu_task, activation_cpu, geglu_cpu, swiglu_cpu
from ._cuda import _driver_args, _submit, _tile_of, activation_cuda, softmax_cuda, swiglu_cuda
from ._plan import _EwPlan, _recall, _remember, recall_alloc, remember_alloc
from ._reference import (
    geglu_reference,
    gelu_reference,
    silu_reference,
    softmax_reference,
    swiglu_reference,
)

__all__ = ["add", "geglu", "gelu", "mul", "saxpy", "silu", "softmax", "swiglu"]

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
            # the launch plan of an identical earlier launch (see ._plan); the storages come
            # from this op's own arguments (the plan holds none)
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
            remember_alloc(name, x, y, _EwPlan(stream.device, ln, grid, block, args[1:],
                                               (wa.shape, wa.dtype)))
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


def _noop(*_: Any) -> None:
    pass


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
            plan = recall_alloc(name, x, y)
            if plan is not None:  # the inputs of the last allocating launch: validated
                return _ElementwiseOp(name, (x, y, None), 0.0, False, plan)
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



def softmax(x: Any, *, out: Any = None) -> KernelOp:
    """Softmax over the last dim, ``exp(x - max) / sum(exp(x - max))``.

    Args:
        x: ``(..., D)`` Tensor, Partition or DeviceOp producing one (float32, float16,
            bfloat16; C-contiguous).
        out: optional output of x's shape and dtype (may be ``x``); allocated if ``None``.

    Returns:
        A :class:`KernelOp` producing ``out`` in the form given.

    Raises:
        ShapeError, DTypeError: before any launch.
    """
    return _SOFTMAX.op((x, out))


def _softmax_parts() -> tuple[Check, Body]:
    name = "softmax"

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        x, o = ts["x"], ts["out"]
        xa, oa = x.array, o.array

        if reference_mode():
            def cpu() -> None:
                oa[...] = softmax_reference(xa)
        else:
            def cpu() -> None:
                activation_cpu("softmax", xa, oa)

        cuda = softmax_cuda(ctx.device.index, o, x) if not ctx.device.is_cpu else noop
        launch(ctx, name, (x,), (o,), cpu, cuda)

    return same_as_x(name), body


_SOFTMAX = KernelSpec("softmax", ("x", "out"), _softmax_parts, replay=True)


def _elementwise_parts(name: str, ref: Any) -> tuple[Check, Body]:
    def check(ts: Mapping[str, Tensor | None]) -> tuple[tuple[int, ...], np.dtype[Any]]:
        xt = ts["x"]
        assert xt is not None
        floating(name, "x", xt)
        check_out(name, ts["out"], xt.shape, xt.dtype, f"the shape and dtype of x {xt.shape} {xt.dtype}")
        return xt.shape, xt.dtype

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        xt, o = ts["x"], ts["out"]
        xa, oa = xt.array, o.array

        if reference_mode():
            def cpu() -> None:
                oa[...] = ref(xa)
        else:
            def cpu() -> None:
                activation_cpu(name, xa, oa)

        cuda = activation_cuda(ctx.device.index, name, xa, oa) if not ctx.device.is_cpu else noop

        launch(ctx, name, (xt,), (o,), cpu, cuda)

    return check, body


def gelu(x: Any, *, out: Any = None) -> KernelOp:
    """GELU, **tanh approximation**: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``.

    The same definition as the GEMM epilogue's ``activation="gelu"`` (and torch's
    ``gelu(approximate="tanh")``), not the exact erf form.

    Args:
        x: Tensor, Partition or DeviceOp producing one, any shape (float32, float16,
            bfloat16; C-contiguous).
        out: optional output of x's shape and dtype (may be ``x``); allocated if ``None``.

    Returns:
        A :class:`KernelOp` producing ``out`` in the form given.
    """
    return _GELU.op((x, out))


def silu(x: Any, *, out: Any = None) -> KernelOp:
    """SiLU (swish): ``x * sigmoid(x)``, elementwise.

    Args:
        x: Tensor, Partition or DeviceOp producing one, any shape (float32, float16,
            bfloat16; C-contiguous).
        out: optional output of x's shape and dtype (may be ``x``); allocated if ``None``.

    Returns:
        A :class:`KernelOp` producing ``out`` in the form given.
    """
    return _SILU.op((x, out))


_GELU = KernelSpec("gelu", ("x", "out"), lambda: _elementwise_parts("gelu", gelu_reference),
                   replay=True)
_SILU = KernelSpec("silu", ("x", "out"), lambda: _elementwise_parts("silu", silu_reference),
                   replay=True)


def swiglu(gate_up: Any, *, out: Any = None) -> KernelOp:
    """SwiGLU of a fused gate/up projection: ``silu(gate_up[..., :F]) * gate_up[..., F:]``.

    Args:
        gate_up: ``(..., 2F)`` Tensor, Partition or DeviceOp producing one (float32,
            float16, bfloat16; C-contiguous).
        out: optional ``(..., F)`` of gate_up's dtype, not sharing memory with it;
            allocated if ``None``.

    Returns:
        A :class:`KernelOp` producing ``out`` in the form given.

    Raises:
        ShapeError, DTypeError: before any launch.
    """
    return _SWIGLU.op((gate_up, out))


def geglu(gate_up: Any, *, out: Any = None) -> KernelOp:
    """GEGLU (tanh GELU) of a fused gate/up projection: ``gelu(gate_up[..., :F]) *
    gate_up[..., F:]`` with :func:`gelu`'s tanh approximation (Gemma's MLP).

    Args:
        gate_up: ``(..., 2F)`` Tensor, Partition or DeviceOp producing one (float32,
            float16, bfloat16; C-contiguous).
        out: optional ``(..., F)`` of gate_up's dtype, not sharing memory with it;
            allocated if ``None``.

    Returns:
        A :class:`KernelOp` producing ``out`` in the form given.

    Raises:
        ShapeError, DTypeError: before any launch.
    """
    return _GEGLU.op((gate_up, out))


def _swiglu_parts(name: str = "swiglu") -> tuple[MultiCheck, Body]:
    glu_ref, glu_cpu = (swiglu_reference, swiglu_cpu) if name == "swiglu" else (
        geglu_reference, geglu_cpu)

    def check(ts: Mapping[str, Tensor | None]) -> Outputs:
        gt = ts["gate_up"]
        assert gt is not None
        floating(name, "gate_up", gt)
        if gt.ndim < 1 or gt.shape[-1] % 2 or gt.shape[-1] < 2:
            raise ShapeError(f"{name}: gate_up has shape {gt.shape}; expected (..., 2F) with the "
                             "gate in the first half of the last dim, up in the second", op=name)
        oshape = (*gt.shape[:-1], gt.shape[-1] // 2)
        check_out(name, ts["out"], oshape, gt.dtype, f"half the last dim of gate_up {gt.shape}")
        distinct(name, ts, (("out", "gate_up"),), "write to a separate tensor")
        return {"out": (oshape, gt.dtype)}

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        gt, o = ts["gate_up"], ts["out"]
        ga, oa = gt.array, o.array

        if reference_mode():
            def cpu() -> None:
                oa[...] = glu_ref(ga)
        else:
            def cpu() -> None:
                glu_cpu(ga, oa)

        cuda = swiglu_cuda(ctx.device.index, ga, oa, name) if not ctx.device.is_cpu else noop

        launch(ctx, name, (gt,), (o,), cpu, cuda)

    return check, body


_SWIGLU = KernelSpec("swiglu", ("gate_up", "out"), _swiglu_parts, outputs=True, replay=True)
_GEGLU = KernelSpec("geglu", ("gate_up", "out"), lambda: _swiglu_parts("geglu"), outputs=True,
                    replay=True)
