"""NumPy references of the norm family: ``rms_norm``, ``layer_norm``, ``add_rms_norm``.

Float64 math, cast once to the input dtype; tests compare the CUDA kernels and the ``cpu``
backend's float32 paths (:mod:`._cpu`) with them; the ``cpu`` backend runs these in the
reference mode (``DEVICEOPS_CPU_KERNELS=reference``).
"""

from __future__ import annotations

import numpy as np


def rms_norm_reference(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` in float64, returned in ``x.dtype``."""
    x64 = x.astype(np.float64)
    inv = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return np.asarray(x64 * inv * weight.astype(np.float64)).astype(x.dtype)


def layer_norm_reference(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None,
                         eps: float) -> np.ndarray:
    """Layer norm over the last dim (biased variance) in float64, returned in ``x.dtype``."""
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=-1, keepdims=True)
    var = ((x64 - mean) ** 2).mean(axis=-1, keepdims=True)
    y = (x64 - mean) / np.sqrt(var + eps) * weight.astype(np.float64)
    if bias is not None:
        y = y + bias.astype(np.float64)
    return np.asarray(y).astype(x.dtype)


def add_rms_norm_reference(x: np.ndarray, residual: np.ndarray, weight: np.ndarray,
                           eps: float) -> tuple[np.ndarray, np.ndarray]:
    """``(out, s)``: ``s = x + residual`` rounded to the dtype, ``out = rms_norm(s) * weight``."""
    s = (x.astype(np.float64) + residual.astype(np.float64)).astype(x.dtype)
    s64 = s.astype(np.float64)
    inv = 1.0 / np.sqrt(np.mean(s64 * s64, axis=-1, keepdims=True) + eps)
    return np.asarray(s64 * inv * weight.astype(np.float64)).astype(x.dtype), s
