"""The elementwise family on the ``cpu`` backend: NumPy ``saxpy``, ``add`` and ``mul`` tasks, and the
float32 activations (``softmax``, ``gelu``, ``silu``, ``swiglu``; see :mod:`..runtime._cpu`).

float16/bfloat16 compute in float32 (as the CUDA kernels do); integer ``saxpy`` computes in
float64 and truncates toward zero.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from deviceops.extend import Tensor, bfloat16, float16, is_floating

from ..runtime._cpu import act_np, f32

_F32 = np.dtype(np.float32)


def _cpu_task(name: str, a: float, w: Tensor, x: Tensor, y: Tensor | None) -> Any:
    wa, xa, dt = w._array, x._array, w._array.dtype
    if name == "saxpy":
        def saxpy_cpu() -> None:
            if is_floating(dt):
                wa[...] = (np.float32(a) * xa.astype(np.float32) + wa.astype(np.float32)).astype(dt)
            else:
                wa[...] = (np.float64(np.float32(a)) * xa.astype(np.float64) + wa).astype(dt)

        return saxpy_cpu
    assert y is not None
    ya = y._array
    ufunc = np.add if name == "add" else np.multiply

    def binary_cpu() -> None:
        if dt in (float16, bfloat16):
            wa[...] = ufunc(xa.astype(np.float32), ya.astype(np.float32)).astype(dt)
        else:
            ufunc(xa, ya, out=wa)

    return binary_cpu


def _silu32(g: np.ndarray) -> np.ndarray:
    return g * np.float32(0.5) * (np.float32(1.0) + np.tanh(np.float32(0.5) * g))  # overflow-free


def swiglu_cpu(gate_up: np.ndarray, out: np.ndarray) -> None:
    """``out = silu(g) * u`` of the halves of the last dim, in float32."""
    f = gate_up.shape[-1] // 2
    g, u = f32(gate_up[..., :f]), f32(gate_up[..., f:])
    out[...] = _silu32(g) * u


def geglu_cpu(gate_up: np.ndarray, out: np.ndarray) -> None:
    """``out = gelu_tanh(g) * u`` of the halves of the last dim, in float32."""
    f = gate_up.shape[-1] // 2
    g, u = f32(gate_up[..., :f]), f32(gate_up[..., f:])
    out[...] = act_np(g, "gelu") * u


def activation_cpu(kind: str, x: np.ndarray, out: np.ndarray) -> None:
    """``out = gelu(x)`` (tanh approximation), ``silu(x)`` or ``softmax(x)`` (last dim), float32."""
    x32 = f32(x)
    if kind == "softmax":
        e = np.exp(x32 - x32.max(axis=-1, keepdims=True))
        out[...] = e / e.sum(axis=-1, keepdims=True)
    elif kind == "silu":
        out[...] = _silu32(x32)
    else:
        out[...] = act_np(x32, kind)
