"""The norms on the ``cpu`` backend: float32 NumPy (see :mod:`..runtime._cpu`)."""

from __future__ import annotations

import numpy as np

from ..runtime._cpu import f32

__all__ = ["add_rms_norm_cpu", "layer_norm_cpu", "rms_norm_cpu"]

_F32 = np.dtype(np.float32)

def _rms(s32: np.ndarray, w32: np.ndarray, eps: float) -> np.ndarray:
    d = s32.shape[-1]
    ms = np.add.reduce(np.square(s32), axis=-1, keepdims=True)  # (pairwise summation)
    ms *= np.float32(1.0 / d) if d else np.float32(0.0)
    ms += np.float32(eps)
    np.sqrt(ms, out=ms)
    y = s32 / ms
    y *= w32
    return y


def rms_norm_cpu(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> None:
    """``out = x / sqrt(mean(x**2, -1) + eps) * weight`` in float32."""
    out[...] = _rms(f32(x), f32(weight), eps)


def add_rms_norm_cpu(x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: float,
                     out: np.ndarray, residual_out: np.ndarray) -> None:
    """``residual_out = x + residual`` (rounded to the dtype), ``out = rms_norm(it) * weight``.

    ``out`` may be ``x`` and ``residual_out`` may be ``residual`` or ``x`` (both results are
    computed before either is written).
    """
    s = np.add(f32(x), f32(residual))
    if x.dtype != _F32:
        s = s.astype(x.dtype).astype(_F32)  # the stored sum, rounded once
    y = _rms(s, f32(weight), eps)
    residual_out[...] = s
    out[...] = y


def layer_norm_cpu(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, eps: float,
                   out: np.ndarray) -> None:
    """Layer norm over the last dim (biased variance) in float32."""
    x32 = f32(x)
    mean = x32.mean(axis=-1, keepdims=True)
    c = x32 - mean
    var = np.square(c).mean(axis=-1, keepdims=True)
    y = c / np.sqrt(var + np.float32(eps)) * f32(weight)
    if bias is not None:
        y += f32(bias)
    out[...] = y
