"""The GEMM's NumPy reference (float64 math, one rounding to the input dtype).

Tests compare every CUDA path and the ``cpu`` backend's float32 path (:mod:`._cpu`) with
:func:`gemm_reference`; the ``cpu`` backend runs it in the reference mode
(``DEVICEOPS_CPU_KERNELS=reference``) and for ``tf32``.
"""

from __future__ import annotations

import numpy as np

from deviceops.extend import ShapeError

from ..runtime._cpu import act_np
from ._check import gemm_check

__all__ = ["gemm_reference"]

def _round_tf32(x: np.ndarray) -> np.ndarray:
    """Round float32 values to tf32 (10 explicit mantissa bits), ties away from zero."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    finite = np.isfinite(x)
    r = ((u + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).astype(np.uint32)
    r = np.where(finite, r, u)
    return r.view(np.float32)


_act_np = act_np  # (the name the tests use)


def gemm_reference(
    a: np.ndarray,
    b: np.ndarray,
    *,
    bias: np.ndarray | None = None,
    activation: str | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: np.ndarray | None = None,
    tf32: bool = False,
    trans_b: bool = False,
) -> np.ndarray:
    """NumPy GEMM with the CUDA paths' semantics (computed in float64).

    Args:
        a: ``(*batch, M, K)``.
        b: ``(K, N)`` or ``(*batch, K, N)``, same dtype; ``(N, K)`` / ``(*batch, N, K)``
            with ``trans_b``.
        bias: ``(N,)`` or None.
        activation: None, ``"relu"``, ``"gelu"`` (tanh approximation), ``"silu"``,
            ``"gelu_erf"`` (exact GELU).
        alpha: scale of ``a @ b``.
        beta: scale of ``c``; ``c`` is read only when ``beta != 0``.
        c: the previous output ``(*batch, M, N)`` (required when ``beta != 0``).
        tf32: round float32 operands to tf32 first (the ``tf32=True`` CUDA mode).
        trans_b: ``b`` is given as ``(..., N, K)`` and read as its transpose.

    Returns:
        ``act(alpha * a @ b + beta * c + bias)`` in the input dtype.
    """
    oshape, odt = gemm_check(
        a.shape, a.dtype, b.shape, b.dtype,
        bias_shape=None if bias is None else bias.shape,
        bias_dtype=None if bias is None else bias.dtype,
        activation=activation, op="gemm", trans_b=trans_b,
    )  # fmt: skip
    a64 = np.asarray(a).astype(np.float64)
    b64 = np.asarray(b).astype(np.float64)
    if tf32 and odt == np.float32:
        a64 = _round_tf32(np.asarray(a, np.float32)).astype(np.float64)
        b64 = _round_tf32(np.asarray(b, np.float32)).astype(np.float64)
    if trans_b:
        b64 = np.swapaxes(b64, -1, -2)
    v = float(alpha) * np.matmul(a64, b64)
    if beta != 0.0:
        if c is None:
            raise ShapeError("gemm: beta != 0 needs the previous output c", op="gemm")
        if tuple(c.shape) != oshape:
            raise ShapeError(f"gemm: c has shape {c.shape}, expected {oshape}", op="gemm")
        v = v + float(beta) * np.asarray(c).astype(np.float64)
    if bias is not None:
        v = v + np.asarray(bias).astype(np.float64)
    v = _act_np(v, activation)
    return np.asarray(v.astype(odt)).reshape(oshape)
