"""Norm kernels as DeviceOps: RMS norm, layer norm, residual add fused with RMS norm.

The ``cpu`` backend runs the float32 paths of :mod:`._cpu` (the float64 references of
:mod:`._norm_reference` in the reference mode; tests compare with them); on CUDA,
``rms_norm`` and ``add_rms_norm`` run the one-block-per-row kernel of ``norms.cu``,
``layer_norm`` its row kernel (:mod:`._cuda`). Argument checks: :mod:`._check`.

| launcher                                             | computes (over the last dim)                      |
|------------------------------------------------------|---------------------------------------------------|
| ``rms_norm(x, weight, *, eps, out)``                 | ``x / sqrt(mean(x**2) + eps) * weight``           |
| ``layer_norm(x, weight, bias, *, eps, out)``         | ``(x - mean) / sqrt(var + eps) * weight + bias``  |
| ``add_rms_norm(x, residual, weight, *, eps, out,``   | ``s = x + residual`` (to ``residual_out``),       |
| ``residual_out)``                                    | ``out = rms_norm(s) * weight``                    |

Floating inputs are float32, float16 or bfloat16, C-contiguous; the CUDA kernels accumulate
in float32 and round once on store. Outputs have the input's shape and dtype; ``out`` may be
the input itself (in place). A :class:`~deviceops.Partition` ``out`` is accepted and
returned as a Partition; these kernels choose their own launch geometry (one warp or block
per row), not the partition's tiles.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from deviceops.extend import ExecutionContext, ShapeError, Tensor, launch

from ..runtime._builder import Body, Check, check_out, noop
from ..runtime._checks import MultiCheck, Outputs, distinct, floating, same, same_as_x
from ..runtime._cpu import reference_mode
from ..runtime._op import KernelOp
from ..runtime._spec import KernelSpec
from ._check import _eps, _vector
from ._cpu import add_rms_norm_cpu, layer_norm_cpu, rms_norm_cpu
from ._cuda import layer_norm_cuda, norm_cuda
from ._reference import add_rms_norm_reference, layer_norm_reference, rms_norm_reference

__all__ = ["add_rms_norm", "layer_norm", "rms_norm"]

def rms_norm(x: Any, weight: Any, *, eps: float = 1e-6, out: Any = None) -> KernelOp:
    """RMS norm over the last dim: ``x / sqrt(mean(x**2) + eps) * weight``.

    Args:
        x: ``(..., D)`` Tensor, Partition or DeviceOp producing one (float32, float16,
            bfloat16; C-contiguous).
        weight: ``(D,)`` of x's dtype.
        eps: added to the mean square (``>= 0``).
        out: optional output of x's shape and dtype (may be ``x``); allocated if ``None``.

    Returns:
        A :class:`KernelOp` producing ``out`` in the form given.

    Raises:
        ShapeError, DTypeError: before any launch.
    """
    return _RMS_NORM.op((x, weight, out), (_eps("rms_norm", eps),))


def _norm_check(name: str, vectors: tuple[str, ...]) -> Check:
    """The check of a row norm: ``x`` as :func:`_same_as_x`, then each of ``vectors``
    (``weight``, ``bias``) a ``(D,)`` of x's dtype when given."""
    base = same_as_x(name)

    def check(ts: Mapping[str, Tensor | None]) -> tuple[tuple[int, ...], np.dtype[Any]]:
        res = base(ts)
        x = ts["x"]
        assert x is not None and ts["weight"] is not None
        for v in vectors:
            _vector(name, v, ts[v], x)
        return res

    return check


def _rms_norm_parts(e: float) -> tuple[Check, Body]:
    name = "rms_norm"
    check = _norm_check(name, ("weight",))

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        x, w, o = ts["x"], ts["weight"], ts["out"]
        xa, wa, oa = x.array, w.array, o.array

        if reference_mode():
            def cpu() -> None:
                oa[...] = rms_norm_reference(xa, wa, e)
        else:
            def cpu() -> None:
                rms_norm_cpu(xa, wa, e, oa)

        # cuda: the one-block-per-row kernel shared with add_rms_norm (norms/_cuda.py)
        cuda = norm_cuda(ctx.device.index, oa, xa, wa, e) if not ctx.device.is_cpu else noop
        launch(ctx, name, (x, w), (o,), cpu, cuda)

    return check, body


_RMS_NORM = KernelSpec("rms_norm", ("x", "weight", "out"), _rms_norm_parts, replay=True)


def layer_norm(x: Any, weight: Any, bias: Any = None, *, eps: float = 1e-5, out: Any = None) -> KernelOp:
    """Layer norm over the last dim: ``(x - mean) / sqrt(var + eps) * weight + bias``.

    The variance is the biased (population) one, as in ``torch.nn.LayerNorm``.

    Args:
        x: ``(..., D)`` Tensor, Partition or DeviceOp producing one (float32, float16,
            bfloat16; C-contiguous).
        weight: ``(D,)`` of x's dtype.
        bias: optional ``(D,)`` of x's dtype.
        eps: added to the variance (``>= 0``).
        out: optional output of x's shape and dtype (may be ``x``); allocated if ``None``.

    Returns:
        A :class:`KernelOp` producing ``out`` in the form given.

    Raises:
        ShapeError, DTypeError: before any launch.
    """
    return _LAYER_NORM.op((x, weight, bias, out), (_eps("layer_norm", eps),))


def _layer_norm_parts(e: float) -> tuple[Check, Body]:
    name = "layer_norm"
    check = _norm_check(name, ("weight", "bias"))

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        x, w, o = ts["x"], ts["weight"], ts["out"]
        b = ts.get("bias")
        xa, wa, oa = x.array, w.array, o.array
        ba = None if b is None else b.array

        if reference_mode():
            def cpu() -> None:
                oa[...] = layer_norm_reference(xa, wa, ba, e)
        else:
            def cpu() -> None:
                layer_norm_cpu(xa, wa, ba, e, oa)

        cuda: Any = noop
        if not ctx.device.is_cpu:
            cuda = layer_norm_cuda(ctx.device.index, o, x, (wa, wa if ba is None else ba),
                                   (np.float32(e), np.int32(ba is not None)))
        launch(ctx, name, (x, w) if b is None else (x, w, b), (o,), cpu, cuda)

    return check, body


_LAYER_NORM = KernelSpec("layer_norm", ("x", "weight", "bias", "out"), _layer_norm_parts,
                         replay=True)


def add_rms_norm(x: Any, residual: Any, weight: Any, *, eps: float = 1e-6, out: Any = None,
                 residual_out: Any = None) -> KernelOp:
    """Residual add fused with RMS norm (one kernel, one read of each input).

    ``s = x + residual`` is rounded to the dtype and written to ``residual_out`` (by
    default ``residual`` itself, in place: the running residual stream); then
    ``out = s / sqrt(mean(s**2) + eps) * weight`` over the last dim, computed from the
    rounded ``s`` (so the result equals ``add`` followed by ``rms_norm``).

    Args:
        x: ``(..., D)`` Tensor, Partition or DeviceOp producing one (float32, float16,
            bfloat16; C-contiguous).
        residual: of x's shape and dtype.
        weight: ``(D,)`` of x's dtype.
        eps: added to the mean square (``>= 0``).
        out: optional output of x's shape and dtype (may be ``x``); allocated if ``None``.
        residual_out: where ``s`` goes, of x's shape and dtype (may be ``residual`` or
            ``x``); ``None`` means ``residual``. Must not share memory with ``out``.

    Returns:
        A :class:`KernelOp` producing the tuple ``(out, residual_out)`` in the forms given.

    Raises:
        ShapeError, DTypeError, ValueError: before any launch.
    """
    e = eps if type(eps) is float else float(eps)
    if not (math.isfinite(e) and e >= 0.0):
        raise ValueError(f"add_rms_norm: eps {eps!r} must be finite and >= 0")
    return _ADD_RMS_NORM.op((x, residual, weight, out, residual_out), (e,))


def _add_rms_norm_parts(e: float) -> tuple[MultiCheck, Body]:
    name = "add_rms_norm"

    def check(ts: Mapping[str, Tensor | None]) -> Outputs:
        xt, rt, wt = ts["x"], ts["residual"], ts["weight"]
        assert xt is not None and rt is not None and wt is not None
        floating(name, "x", xt)
        if xt.ndim < 1 or xt.shape[-1] < 1:
            raise ShapeError(f"{name}: x has shape {xt.shape}; it needs a last dim >= 1", op=name)
        if xt.shape[-1] > 2**31 - 1:
            raise ShapeError(f"{name}: x rows of {xt.shape[-1]} elements are too long", op=name)
        why = f"the shape and dtype of x {xt.shape} {xt.dtype}"
        same(name, "residual", rt, xt.shape, xt.dtype, why)
        same(name, "weight", wt, (xt.shape[-1],), xt.dtype, f"the last dim of x {xt.shape}")
        check_out(name, ts["out"], xt.shape, xt.dtype, why)
        ro = ts["residual_out"]
        assert ro is not None  # (defaults to residual)
        same(name, "residual_out", ro, xt.shape, xt.dtype, why)
        distinct(name, ts, (("out", "residual_out"), ("out", "residual"), ("out", "weight"),
                             ("residual_out", "weight")),
                  "out may be x, residual_out may be residual or x; nothing else may overlap")
        return {"out": (xt.shape, xt.dtype)}

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        xt, rt, wt, o, ro = ts["x"], ts["residual"], ts["weight"], ts["out"], ts["residual_out"]
        xa, ra, wa, oa, roa = xt.array, rt.array, wt.array, o.array, ro.array

        if reference_mode():
            def cpu() -> None:
                y, s = add_rms_norm_reference(xa, ra, wa, e)
                roa[...] = s
                oa[...] = y
        else:
            def cpu() -> None:
                add_rms_norm_cpu(xa, ra, wa, e, oa, roa)

        cuda: Any = noop
        if not ctx.device.is_cpu:
            cuda = norm_cuda(ctx.device.index, oa, xa, wa, e, residual=ra, residual_out=roa)
        launch(ctx, name, (xt, rt, wt), (o, ro), cpu, cuda)

    return check, body


def _out_and_residual(v: dict[str, Any]) -> tuple[Any, Any]:
    return v["out"], v["residual_out"]


_ADD_RMS_NORM = KernelSpec("add_rms_norm", ("x", "residual", "weight", "out", "residual_out"),
                           _add_rms_norm_parts, returns=_out_and_residual, outputs=True,
                           defaults={"residual_out": "residual"}, replay=True)
