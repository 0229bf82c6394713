"""GEMM as a DeviceOp: ``gemm`` and ``matmul``.

| launcher                                                       | computes                                   |
|----------------------------------------------------------------|--------------------------------------------|
| ``gemm(a, b, out=None, *, bias, activation, alpha, beta, tf32, trans_b)`` | ``out = act(alpha a @ b + beta out + bias)`` |
| ``matmul(a, b, out=None, *, trans_b)``                         | ``out = a @ b``                            |

Shapes, dtypes and the epilogue follow :mod:`deviceops.kernels.gemm` (``a`` ``(*batch, M, K)``, ``b``
``(K, N)`` or ``(*batch, K, N)``, float32/float16/bfloat16, float32 accumulation). The
``cpu`` backend runs :func:`._cpu.gemm_cpu` (float32 BLAS; float16/bfloat16 weights widened once and cached, see
:mod:`..runtime._cpu`; :func:`._reference.gemm_reference`, the float64 oracle, in the
reference mode and for ``tf32``); the ``cuda`` backend runs the launch plan of :mod:`._cuda`
(raw PTX, no cuBLAS) on the executing stream, without checking again what this op's plan
checked. Split-K shapes use the stream's workspace (:mod:`..runtime._workspace`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from deviceops.extend import ExecutionContext, ShapeError, Tensor, launch

from ..runtime._builder import Body, Check
from ..runtime._cpu import reference_mode, weight_cache
from ..runtime._op import KernelOp
from ..runtime._spec import KernelSpec
from ..runtime._workspace import workspace_for
from ._check import ACTIVATIONS, gemm_check
from ._cpu import gemm_cpu
from ._cuda import _launch
from ._plan import gemm_workspace_nbytes
from ._reference import gemm_reference

__all__ = ["gemm", "matmul"]


def _gemm_op(name: str, a: Any, b: Any, out: Any, bias: Any, activation: str | None,
             alpha: float, beta: float, tf32: bool, trans_b: bool = False) -> KernelOp:
    if activation not in ACTIVATIONS:
        known = ", ".join(repr(k) for k in ACTIVATIONS)
        raise ValueError(f"{name}: unknown activation {activation!r}; use one of {known}")
    alpha, beta, tf32, trans_b = float(alpha), float(beta), bool(tf32), bool(trans_b)
    if not (math.isfinite(alpha) and math.isfinite(beta)):
        raise ValueError(f"{name}: alpha {alpha} and beta {beta} must be finite")
    if beta != 0.0 and out is None:
        raise ValueError(f"{name}: beta={beta} reads the previous output; pass out=")
    return _GEMM.op((a, b, out, bias), (name, activation, alpha, beta, tf32, trans_b), name)


def _gemm_parts(name: str, activation: str | None, alpha: float, beta: float, tf32: bool,
                trans_b: bool) -> tuple[Check, Body]:
    def check(ts: Mapping[str, Tensor | None]) -> tuple[tuple[int, ...], np.dtype[Any]]:
        at, bt, ot, bias_t = ts["a"], ts["b"], ts["out"], ts["bias"]
        assert at is not None and bt is not None
        res = gemm_check(
            at.shape, at.dtype, bt.shape, bt.dtype,
            out_shape=None if ot is None else ot.shape,
            out_dtype=None if ot is None else ot.dtype,
            bias_shape=None if bias_t is None else bias_t.shape,
            bias_dtype=None if bias_t is None else bias_t.dtype,
            activation=activation, op=name, trans_b=trans_b,
        )  # fmt: skip
        if ot is not None:
            for k, t in (("a", at), ("b", bt), ("bias", bias_t)):
                if t is not None and t._storage is ot._storage:
                    raise ShapeError(f"{name}: out {ot.shape} shares memory with {k} {t.shape}; "
                                     "write to a separate tensor", op=name)
        return res

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        at, bt, ot = ts["a"], ts["b"], ts["out"]
        bias_t = ts.get("bias")
        stream = ctx.stream
        yields = stream.yields  # (a yielding stream: no persistent grid)
        ws = workspace_for(stream, gemm_workspace_nbytes(at.shape, bt.shape, at.dtype, trans_b), name)
        reads = [at, bt] + ([bias_t] if bias_t is not None else []) + ([ot] if beta != 0.0 else [])
        writes = [ot] + ([ws] if ws is not None else [])
        aa, ba, oa = at.array, bt.array, ot.array
        biasa = None if bias_t is None else bias_t.array

        if reference_mode():
            def cpu() -> None:
                oa[...] = gemm_reference(aa, ba, bias=biasa, activation=activation, alpha=alpha,
                                         beta=beta, c=oa if beta != 0.0 else None, tf32=tf32,
                                         trans_b=trans_b)
        elif ba.dtype == np.float32 or not stream.device.is_cpu:
            def cpu() -> None:
                gemm_cpu(aa, ba, oa, bias=biasa, activation=activation, alpha=alpha, beta=beta,
                         tf32=tf32, trans_b=trans_b)
        else:  # a float16/bfloat16 weight: its float32 copy is cached until it is written
            bref, ver = weakref.ref(bt._storage), bt._storage.ver

            def cpu() -> None:  # (the write count read when the task runs: replays too)
                gemm_cpu(aa, ba, oa, bias=biasa, activation=activation, alpha=alpha, beta=beta,
                         tf32=tf32, trans_b=trans_b, b32=weight_cache.get(bref(), ver[0], ba))

        def cuda(native: Any) -> None:
            _launch(aa, ba, oa, biasa, activation, alpha, beta, tf32, trans_b,
                    None if ws is None else ws.array, native, True, yields)  # (checked: this plan)

        launch(ctx, name, reads, writes, cpu, cuda)

    return check, body


_GEMM = KernelSpec("gemm", ("a", "b", "out", "bias"), _gemm_parts, replay=True)


def gemm(
    a: Any,
    b: Any,
    out: Any = None,
    *,
    bias: Any = None,
    activation: str | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    tf32: bool = False,
    trans_b: bool = False,
) -> KernelOp:
    """``out = act(alpha * a @ b + beta * out + bias)``; produces ``out`` in the form given.

    Args:
        a: ``(*batch, M, K)`` Tensor, Partition, or DeviceOp producing one; float32,
            float16 or bfloat16, C-contiguous.
        b: ``(K, N)`` (shared by every batch entry) or ``(*batch, K, N)``, same dtype;
            with ``trans_b=True``, ``(N, K)`` or ``(*batch, N, K)``.
        out: optional ``(*batch, M, N)`` output of the same dtype (Tensor or Partition;
            a Partition is returned as a Partition, its tiling does not change the GEMM's
            own). Allocated when ``None`` (not allowed inside graph capture). Must not
            share memory with ``a``, ``b`` or ``bias``.
        bias: optional ``(N,)`` vector added to every row.
        activation: ``None``, ``"relu"``, ``"gelu"`` (tanh approximation), ``"silu"``
            or ``"gelu_erf"`` (exact GELU, ``0.5 x (1 + erf(x / sqrt 2))``: BERT's).
        alpha: scale of ``a @ b``.
        beta: scale of the previous ``out`` (read only when ``beta != 0``; needs ``out``).
        tf32: float32 inputs on tensor cores with operands rounded to tf32.
        trans_b: ``b`` is given as ``(N, K)`` (how checkpoints store a Linear weight) and
            read as its transpose without a copy, on every path.

    Returns:
        A :class:`KernelOp` producing ``out``.

    Raises:
        ShapeError: shapes do not fit (the message names them); before any launch.
        DTypeError: unsupported or mismatched dtypes; before any launch.
        ValueError: unknown activation, or ``beta != 0`` without ``out``.
        CaptureError: inside a graph capture, ``out`` is ``None`` or the stream's
            workspace is too small (see the module docstring).

    Example:
        >>> y = kernels.gemm(x, w, bias=b, activation="gelu").sync()
    """
    return _gemm_op("gemm", a, b, out, bias, activation, alpha, beta, tf32, trans_b)


def matmul(a: Any, b: Any, out: Any = None, *, trans_b: bool = False) -> KernelOp:
    """``out = a @ b`` (float32 accumulation); produces ``out`` in the form given.

    Same shapes, dtypes and argument forms as :func:`gemm` without the epilogue.

    Args:
        a: ``(*batch, M, K)`` Tensor, Partition, or DeviceOp producing one.
        b: ``(K, N)`` or ``(*batch, K, N)``, same dtype; ``(N, K)`` / ``(*batch, N, K)``
            with ``trans_b=True`` (read as its transpose, no copy).
        out: optional ``(*batch, M, N)`` output; allocated when ``None``.
        trans_b: ``b`` is given transposed (a Linear weight as stored).

    Returns:
        A :class:`KernelOp` producing ``out``.
    """
    return _gemm_op("matmul", a, b, out, None, None, 1.0, 0.0, False, trans_b)
