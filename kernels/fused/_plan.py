"""Host planning of the fused decode step: weight packing for :func:`~deviceops.kernels.fused.fused_decode`: the tensor-core fragment
layout and the row orders the kernel's epilogues rely on (pure NumPy, no device).

A projection ``W`` ``(N, K)`` (``y = W x``) is cut into ``N / 16`` *strips* of 16 rows. A strip
is stored k-step after k-step (16 columns each); a k-step is 32 lanes x 8 values, lane
``(g, c) = (lane // 4, lane % 4)`` holding ``mma.m16n8k16``'s A fragment in register order::

    W[g, 2c:2c+2], W[g+8, 2c:2c+2], W[g, 2c+8:2c+10], W[g+8, 2c+8:2c+10]

so the kernel reads one k-step of a strip with one 16-byte load per lane. Before cutting,
the rows are reordered (:func:`qkv_order`, :func:`gate_up_order`) so that the pairs an
epilogue combines land on rows ``g`` and ``g + 8`` of one strip: a head's dims ``j`` and
``j + D/2`` (RoPE's rotate-half pairs) and ``gate[j]`` with ``up[j]`` (SwiGLU).
"""

from __future__ import annotations

import numpy as np

__all__ = ["gate_up_order", "pack_strips", "qkv_order", "unpack_strips"]


def _lane_index() -> tuple[np.ndarray, np.ndarray]:
    """(row, col) within a 16x16 k-step of every (lane, slot): ``(32, 8)`` each."""
    rows = np.zeros((32, 8), np.intp)
    cols = np.zeros((32, 8), np.intp)
    for lane in range(32):
        g, c = divmod(lane, 4)
        for slot in range(8):
            reg, half = divmod(slot, 2)
            rows[lane, slot] = g + 8 * (reg & 1)
            cols[lane, slot] = 2 * c + half + 8 * (reg >> 1)
    return rows, cols


_ROWS, _COLS = _lane_index()


def pack_strips(w: np.ndarray, order: np.ndarray | None = None) -> np.ndarray:
    """``w`` ``(N, K)`` (rows reordered by ``order`` first) as ``(N/16, K/16, 32, 8)``.

    Raises:
        ValueError: ``N`` or ``K`` is not a multiple of 16.
    """
    if w.ndim != 2 or w.shape[0] % 16 or w.shape[1] % 16:
        raise ValueError(f"fused_decode: a projection of shape {w.shape} cannot be packed; both "
                         "dims must be multiples of 16")
    if order is not None:
        w = w[order]
    n, k = w.shape
    w4 = w.reshape(n // 16, 16, k // 16, 16).transpose(0, 2, 1, 3)  # (strip, kstep, row, col)
    return np.ascontiguousarray(w4[:, :, _ROWS, _COLS])


def unpack_strips(p: np.ndarray, order: np.ndarray | None = None) -> np.ndarray:
    """The inverse of :func:`pack_strips`: ``(N, K)`` in the original row order."""
    s, ks = p.shape[:2]
    w4 = np.empty((s, ks, 16, 16), p.dtype)
    w4[:, :, _ROWS, _COLS] = p
    w = w4.transpose(0, 2, 1, 3).reshape(s * 16, ks * 16)
    if order is None:
        return w
    out = np.empty_like(w)
    out[order] = w
    return out


def qkv_order(n_heads: int, n_kv_heads: int, head_dim: int) -> np.ndarray:
    """Row order of the fused QKV projection: per head, strips of dims ``8p .. 8p+7`` then
    ``D/2 + 8p .. D/2 + 8p+7`` (``p < D/16``).

    Raises:
        ValueError: ``head_dim`` is not a multiple of 16.
    """
    if head_dim % 16:
        raise ValueError(f"fused_decode: head_dim={head_dim} must be a multiple of 16")
    half = head_dim // 2
    out = []
    for h in range(n_heads + 2 * n_kv_heads):
        for part in range(head_dim // 16):
            base = h * head_dim + 8 * part
            out += [base + i for i in range(8)] + [base + half + i for i in range(8)]
    return np.asarray(out, np.intp)


def gate_up_order(ffn: int) -> np.ndarray:
    """Row order of the fused ``[gate; up]`` projection ``(2F, K)``: strips of gate rows
    ``8p .. 8p+7`` then up rows ``8p .. 8p+7``.

    Raises:
        ValueError: ``ffn`` is not a multiple of 8.
    """
    if ffn % 8:
        raise ValueError(f"fused_decode: intermediate_size={ffn} must be a multiple of 8")
    out = []
    for part in range(ffn // 8):
        out += [8 * part + i for i in range(8)] + [ffn + 8 * part + i for i in range(8)]
    return np.asarray(out, np.intp)
