"""The GEMM on the ``cpu`` backend: float32 BLAS (see :mod:`..runtime._cpu`)."""

from __future__ import annotations

import numpy as np

from ..runtime._cpu import act_np, blas, f32
from ._reference import gemm_reference

__all__ = ["gemm_cpu"]

_F32 = np.dtype(np.float32)

_SKINNY_ROWS = 64


def _skinny_trans_b(a2: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``a2 @ w.T`` for a few rows (2 ≤ M ≤ 64) of ``a2`` ``(M, K)`` and a weight ``w``
    ``(N, K)``, float32. OpenBLAS's GEMM with a handful of rows is 2-6x slower than its
    GEMV per byte of weight (measured, K = 576..1536, N = 576..49152), so: two GEMVs for
    M = 2, else the product with the operands swapped, ``(w @ a2.T).T`` (the weight as
    the long side), which reads the weight once at near-GEMV speed."""
    m = a2.shape[0]
    if m <= 2:
        out = np.empty((m, w.shape[0]), _F32)
        for i in range(m):
            blas.matmul(w, a2[i], out=out[i])
        return out
    return blas.matmul(w, a2.T).T


def gemm_cpu(a: np.ndarray, b: np.ndarray, out: np.ndarray, *, bias: np.ndarray | None,
             activation: str | None, alpha: float, beta: float, tf32: bool, trans_b: bool,
             b32: np.ndarray | None = None) -> None:
    """``out = act(alpha * a @ b + beta * out + bias)`` in float32 through BLAS.

    Same semantics as :func:`._reference.gemm_reference` (which runs for ``tf32``).

    Args:
        a, b, out, bias: the operands (shapes as :func:`deviceops.kernels.gemm`).
        activation, alpha, beta, tf32, trans_b: as :func:`deviceops.kernels.gemm`.
        b32: ``b`` already widened to float32 (a cached weight copy), or ``None``.
    """
    if tf32:
        out[...] = gemm_reference(a, b, bias=bias, activation=activation, alpha=alpha,
                                  beta=beta, c=out if beta != 0.0 else None, tf32=True,
                                  trans_b=trans_b)
        return
    bb = f32(b) if b32 is None else b32
    aa = f32(a)
    plain = (out.dtype == _F32 and alpha == 1.0 and beta == 0.0 and bias is None
             and activation is None)
    rows = aa.size // aa.shape[-1] if aa.shape[-1] else 0
    if trans_b and bb.ndim == 2 and 2 <= rows <= _SKINNY_ROWS:
        v = _skinny_trans_b(aa.reshape(rows, aa.shape[-1]), bb).reshape(out.shape)
        if plain:
            out[...] = v
            return
    else:
        if trans_b:
            bb = np.swapaxes(bb, -1, -2)
        if plain:
            blas.matmul(aa, bb, out=out)
            return
        v = blas.matmul(aa, bb)
    if alpha != 1.0:
        v *= np.float32(alpha)
    if beta != 0.0:
        v += np.float32(beta) * f32(out)
    if bias is not None:
        v += f32(bias)
    out[...] = act_np(v, activation)
