"""The quant family's float64 references: the weight dequantized by the ``gguf`` package
(``gguf.quants.dequantize``, llama.cpp's Python port), then float64 math, one rounding to the
output dtype. Tests compare the ``cpu`` path and every CUDA kernel with these; the ``cpu``
backend runs them in the reference mode (``DEVICEOPS_CPU_KERNELS=reference``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._formats import get_format, unpack

__all__ = ["dequantize_reference", "qmatmul_reference"]


def dequantize_reference(w: np.ndarray, fmt: str, k: int) -> np.ndarray:
    """float64 ``(N, K)`` of a packed weight (:mod:`._formats`), by ``gguf.quants.dequantize``."""
    import gguf

    get_format(fmt, "dequantize_reference")
    blocks = unpack(np.asarray(w), fmt, k)
    t = gguf.GGMLQuantizationType[fmt]
    return np.asarray(gguf.quants.dequantize(np.ascontiguousarray(blocks), t), dtype=np.float64)


def qmatmul_reference(x: np.ndarray, w: np.ndarray, fmt: str, *, bias: np.ndarray | None = None,
                      out_dtype: Any = None) -> np.ndarray:
    """``x @ dequant(w).T (+ bias)`` in float64, rounded once to ``out_dtype`` (default x's).

    Args:
        x: ``(M, K)``.
        w: the packed ``(N, W)`` int32 weight of ``fmt``.
        fmt: the format's name.
        bias: ``(N,)`` or ``None``.
        out_dtype: the result's dtype (default ``x.dtype``).
    """
    x64 = np.asarray(x).astype(np.float64)
    v = x64 @ dequantize_reference(w, fmt, x64.shape[-1]).T
    if bias is not None:
        v = v + np.asarray(bias).astype(np.float64)
    return v.astype(out_dtype or np.asarray(x).dtype)
