"""The quant family on the ``cpu`` backend: the weight dequantized per block by NumPy
(:mod:`._dequant_np`), then float32 BLAS.

The float32 copy of a quantized weight is kept in :data:`dequant_cache` (keyed by the
storage and its write count, as the runtime's weight cache keys widened GEMM weights: a write
into the weight makes it dequantize afresh), bounded by ``DEVICEOPS_CPU_WEIGHT_CACHE_MB``
(default 1024). So on the cpu backend a native model holds both its packed weights (what a
GPU holds) and float32 copies of those it multiplies, and runs at float32 BLAS speed.
"""

from __future__ import annotations

import numpy as np

from ..runtime._cpu import WeightCache, _limit_from_env, blas, f32
from ._dequant_np import dequantize_blocks
from ._formats import QuantFormat, unpack

__all__ = ["dequant_cache", "dequantize_cpu", "qmatmul_cpu"]

_F32 = np.dtype(np.float32)

#: float32 copies of quantized weights (module docstring)
dequant_cache = WeightCache(_limit_from_env())


def dequantize_cpu(w: np.ndarray, f: QuantFormat, k: int, ids: np.ndarray | None = None) -> np.ndarray:
    """float32 rows of the packed weight ``w`` (all of them, or ``w[clip(ids)]``)."""
    blocks = unpack(w, f.name, k)
    if ids is not None:
        rows = np.clip(np.asarray(ids).astype(np.int64).reshape(-1), 0, w.shape[0] - 1)
        return dequantize_blocks(blocks[rows], f).reshape(*np.shape(ids), k)
    return dequantize_blocks(blocks, f)


def qmatmul_cpu(x: np.ndarray, w: np.ndarray, out: np.ndarray, f: QuantFormat, out_col: int,
                bias: np.ndarray | None, w32: np.ndarray | None = None) -> None:
    """``out[:, out_col:out_col + N] = x @ dequant(w).T (+ bias)`` in float32.

    Args:
        x: ``(M, K)``; w: the packed ``(N, W)`` weight; out: ``(M, >= out_col + N)``.
        f: the format; out_col: the first column written; bias: ``(N,)`` or ``None``.
        w32: the weight already dequantized (``(N, K)`` float32), or ``None``.
    """
    k = x.shape[1]
    wf = dequantize_cpu(w, f, k) if w32 is None else w32
    xx = f32(x)
    v = blas.matmul(wf, xx.T).T if xx.shape[0] <= 64 else blas.matmul(xx, wf.T)
    if bias is not None:
        v = v + f32(bias)
    out[:, out_col:out_col + wf.shape[0]] = v
