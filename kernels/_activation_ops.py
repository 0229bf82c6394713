"""Activation kernels as DeviceOps: softmax, GELU, SiLU, SwiGLU.

The ``cpu`` backend runs the float32 paths of :mod:`._cpu_fast` (the float64 references of
:mod:`._activation_reference` in the reference mode; tests compare with them); on
CUDA, ``softmax``, ``gelu`` and ``silu`` run the kernels of :mod:`._nn_cuda`
(``src/nn_ops.cu``), ``swiglu`` the one of ``src/transformer.cu`` (:mod:`._norms`).
Argument checks: :mod:`._nn_check`.

| launcher                      | computes                                                  |
|-------------------------------|-----------------------------------------------------------|
| ``softmax(x, *, out)``        | ``exp(x - max) / sum(exp(x - max))`` over the last dim    |
| ``gelu(x, *, out)``           | tanh-approximate GELU (as the GEMM epilogue)              |
| ``silu(x, *, out)``           | ``x * sigmoid(x)``                                        |
| ``swiglu(gate_up, *, out)``   | ``silu(gate_up[..., :F]) * gate_up[..., F:]``             |

Floating inputs are float32, float16 or bfloat16, C-contiguous; float32 math, one rounding
on store. ``out`` may be the input itself for ``softmax``, ``gelu`` and ``silu`` (not for
``swiglu``, whose output is half the input's last dim). A :class:`~deviceops.Partition`
``out`` is accepted and returned as a Partition; the kernels choose their own geometry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from deviceops.extend import ExecutionContext, ShapeError, Tensor, launch

from ._activation_reference import (
    gelu_reference,
    silu_reference,
    softmax_reference,
    swiglu_reference,
)
from ._builder import Body, Check, check_out, noop
from ._cpu_fast import activation_cpu, reference_mode, swiglu_cpu
from ._launch import KernelOp
from ._multi_op import MultiCheck, Outputs, distinct, floating
from ._nn_check import _float_input, _same_as_x
from ._nn_cuda import _CTYPE, _MAX_BLOCKS, _function, _row_launch
from ._norms import _THREADS, CTYPE, _grid, tk_function, vec_width
from ._spec import KernelSpec

__all__ = ["gelu", "silu", "softmax", "swiglu"]

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

        cuda = _row_launch(ctx, name, o, x, (), ()) if not ctx.device.is_cpu else noop
        launch(ctx, name, (x,), (o,), cpu, cuda)

    return _same_as_x(name), body


_SOFTMAX = KernelSpec("softmax", ("x", "out"), _softmax_parts, replay=True)


def _elementwise_parts(name: str, ref: Any) -> tuple[Check, Body]:
    def check(ts: Mapping[str, Tensor | None]) -> tuple[tuple[int, ...], np.dtype[Any]]:
        xt = ts["x"]
        assert xt is not None
        _float_input(name, "x", xt)
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

        cuda: Any = noop
        if not ctx.device.is_cpu:
            n = xt.size
            fn = _function(ctx.device.index, f"{name}<{_CTYPE[xt.dtype]}>")
            blocks = min(max(1, -(-n // 256)), _MAX_BLOCKS)

            def cuda(native: Any) -> None:
                if n > 0:
                    fn((blocks,), (256,), (oa, xa, np.int64(n)), stream=native)

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


def _swiglu_parts() -> tuple[MultiCheck, Body]:
    name = "swiglu"

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
                oa[...] = swiglu_reference(ga)
        else:
            def cpu() -> None:
                swiglu_cpu(ga, oa)

        cuda: Any = noop
        if not ctx.device.is_cpu:
            f = gt.shape[-1] // 2
            rows = gt.size // (2 * f)
            vec = vec_width(gt.dtype, f, (ga, oa))
            units = rows * (f // vec)
            fn = tk_function(ctx.device.index, f"swiglu<{CTYPE[gt.dtype]}, {vec}>")
            args = (oa, ga, np.int64(rows), np.int32(f))
            grid = _grid(units)

            def cuda(native: Any) -> None:
                if units > 0:
                    fn((grid,), (_THREADS,), args, stream=native)

        launch(ctx, name, (gt,), (o,), cpu, cuda)

    return check, body


_SWIGLU = KernelSpec("swiglu", ("gate_up", "out"), _swiglu_parts, outputs=True, replay=True)
