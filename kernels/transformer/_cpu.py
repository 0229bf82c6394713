"""The transformer kernels on the ``cpu`` backend: float32 RoPE and q/k RMSNorm (see
:mod:`..runtime._cpu`)."""

from __future__ import annotations

import numpy as np

from ..runtime._cpu import f32

__all__ = ["qk_rms_norm_cpu", "rope_cpu", "rope_kv_write_cpu"]

_F32 = np.dtype(np.float32)

_inv_freq: dict[tuple[int, float], np.ndarray] = {}


def _cos_sin32(pos: np.ndarray, d: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """``cos`` and ``sin`` of the angles ``pos * theta**(-2j/d)`` (computed in float64)."""
    f = _inv_freq.get((d, theta))
    if f is None:
        j = np.arange(d // 2, dtype=np.float64)
        f = _inv_freq[(d, theta)] = float(theta) ** (-2.0 * j / d)
    a = pos.astype(np.float64)[..., None] * f
    return np.cos(a).astype(_F32), np.sin(a).astype(_F32)


def _rotate32(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Llama's rotate-half RoPE of ``x`` (float32): ``[x1 c - x2 s, x2 c + x1 s]``."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    out = np.empty(x.shape, _F32)
    lo, hi = out[..., :h], out[..., h:]
    np.multiply(x1, cos, out=lo)
    lo -= x2 * sin
    np.multiply(x2, cos, out=hi)
    hi += x1 * sin
    return out


def _positions(start: np.ndarray, length: int) -> np.ndarray:
    return start.astype(np.int64)[:, None] + np.arange(length, dtype=np.int64)[None, :]


def rope_cpu(x: np.ndarray, start: np.ndarray, theta: float, out: np.ndarray) -> None:
    """RoPE of ``x`` ``(B, L, H, D)`` (token ``(b, i)`` at ``start[b] + i``) in float32."""
    cos, sin = _cos_sin32(_positions(start, x.shape[1]), x.shape[-1], theta)
    out[...] = _rotate32(f32(x), cos[:, :, None], sin[:, :, None])


def rope_kv_write_cpu(qkv: np.ndarray, start: np.ndarray, k_cache: np.ndarray,
                      v_cache: np.ndarray, q_out: np.ndarray, n_heads: int, n_kv_heads: int,
                      theta: float, block_table: np.ndarray | None = None) -> None:
    """:func:`._rope_reference.rope_kv_write_reference` in float32, cache writes vectorized."""
    b_, l_, w = qkv.shape
    hq, hkv = n_heads, n_kv_heads
    d = w // (hq + 2 * hkv)
    heads = qkv.reshape(b_, l_, hq + 2 * hkv, d)
    pos = _positions(start, l_)  # (B, L)
    cos, sin = _cos_sin32(pos, d, theta)
    rot = _rotate32(f32(heads[:, :, : hq + hkv]), cos[:, :, None], sin[:, :, None])
    q_out[...] = rot[:, :, :hq].transpose(0, 2, 1, 3)
    k = rot[:, :, hq:]  # (B, L, Hkv, D)
    v = heads[:, :, hq + hkv:]
    s_len = k_cache.shape[2]
    if b_ * l_ <= 8:  # decode: a few tokens, plain indexing beats the vectorized form
        for bi_ in range(b_):
            for i_ in range(l_):
                p_ = int(pos[bi_, i_])
                if block_table is None:
                    if 0 <= p_ < s_len:
                        k_cache[bi_, :, p_] = k[bi_, i_]
                        v_cache[bi_, :, p_] = v[bi_, i_]
                    continue
                if not 0 <= p_ < block_table.shape[1] * s_len:
                    continue
                blk_ = int(block_table[bi_, p_ // s_len])
                if 0 <= blk_ < k_cache.shape[0]:
                    k_cache[blk_, :, p_ % s_len] = k[bi_, i_]
                    v_cache[blk_, :, p_ % s_len] = v[bi_, i_]
        return
    if block_table is None:
        ok = (pos >= 0) & (pos < s_len)
        bi, ii = np.nonzero(ok)
        p = pos[bi, ii]
        k_cache[bi, :, p] = k[bi, ii]
        v_cache[bi, :, p] = v[bi, ii]
        return
    ok = (pos >= 0) & (pos < block_table.shape[1] * s_len)
    bi, ii = np.nonzero(ok)
    p = pos[bi, ii]
    blk = block_table[bi, p // s_len].astype(np.int64)
    good = (blk >= 0) & (blk < k_cache.shape[0])
    bi, ii, p, blk = bi[good], ii[good], p[good], blk[good]
    k_cache[blk, :, p % s_len] = k[bi, ii]
    v_cache[blk, :, p % s_len] = v[bi, ii]


def qk_rms_norm_cpu(qkv: np.ndarray, wq: np.ndarray, wk: np.ndarray, hq: int, hkv: int,
                    eps: float) -> None:
    """In place: every q and k head of the fused QKV rows RMS-normed in float32."""
    d = qkv.shape[-1] // (hq + 2 * hkv)
    x = qkv.reshape(-1, hq + 2 * hkv, d)
    for lo, hi, w in ((0, hq, wq), (hq, hq + hkv, wk)):
        h = f32(x[:, lo:hi])
        ms = np.einsum("thd,thd->th", h, h)[..., None] / np.float32(d)
        x[:, lo:hi] = h / np.sqrt(ms + np.float32(eps)) * f32(w)
