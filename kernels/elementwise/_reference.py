"""NumPy references of the activation family: ``softmax``, ``gelu``, ``silu``, ``swiglu``,
``geglu``.

Float64 math, cast once to the input dtype; ``gelu`` and ``silu`` use the GEMM epilogue's
definitions (:func:`..runtime._cpu.act_np`).
"""

from __future__ import annotations

import numpy as np

from ..runtime._cpu import act_np as _act_np


def softmax_reference(x: np.ndarray) -> np.ndarray:
    """Softmax over the last dim in float64, returned in ``x.dtype``."""
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=-1, keepdims=True))
    return np.asarray(e / e.sum(axis=-1, keepdims=True)).astype(x.dtype)


def gelu_reference(x: np.ndarray) -> np.ndarray:
    """Tanh-approximate GELU in float64 (the GEMM epilogue's definition), in ``x.dtype``."""
    return np.asarray(_act_np(x.astype(np.float64), "gelu")).astype(x.dtype)


def silu_reference(x: np.ndarray) -> np.ndarray:
    """``x * sigmoid(x)`` in float64, returned in ``x.dtype``."""
    return np.asarray(_act_np(x.astype(np.float64), "silu")).astype(x.dtype)


def swiglu_reference(gate_up: np.ndarray) -> np.ndarray:
    """``silu(g) * u`` of the halves of the last dim in float64, in ``gate_up.dtype``."""
    f = gate_up.shape[-1] // 2
    g, u = gate_up[..., :f].astype(np.float64), gate_up[..., f:].astype(np.float64)
    return np.asarray(g / (1.0 + np.exp(-g)) * u).astype(gate_up.dtype)


def geglu_reference(gate_up: np.ndarray) -> np.ndarray:
    """``gelu_tanh(g) * u`` of the halves of the last dim in float64, in ``gate_up.dtype``."""
    f = gate_up.shape[-1] // 2
    g, u = gate_up[..., :f].astype(np.float64), gate_up[..., f:].astype(np.float64)
    return np.asarray(_act_np(g, "gelu") * u).astype(gate_up.dtype)
