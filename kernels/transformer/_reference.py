"""NumPy references of ``rope``, ``rope_kv_write``, ``merge_heads`` and ``split_qkv`` (float64 math, cast once).

:func:`rope_kv_write_reference` writes the caches in place, contiguous ``(B, Hkv, S, D)`` or
paged (a block pool and a block table), skipping positions outside the cache as the CUDA
kernel does.
"""

from __future__ import annotations

import numpy as np


def rope_cos_sin(pos: np.ndarray, d: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """``cos`` and ``sin`` of ``pos * theta**(-2j/d)`` for ``j < d/2``: shape ``(*pos.shape, d/2)``."""
    j = np.arange(d // 2, dtype=np.float64)
    a = pos.astype(np.float64)[..., None] * (float(theta) ** (-2.0 * j / d))
    return np.cos(a), np.sin(a)


def _rotate(x64: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    h = x64.shape[-1] // 2
    x1, x2 = x64[..., :h], x64[..., h:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _positions(start: np.ndarray, length: int) -> np.ndarray:
    return start.astype(np.int64)[:, None] + np.arange(length, dtype=np.int64)[None, :]  # (B, L)


def rope_reference(x: np.ndarray, start: np.ndarray, theta: float) -> np.ndarray:
    """RoPE of ``x`` ``(B, L, H, D)``, token ``(b, i)`` at ``start[b] + i``; in ``x.dtype``."""
    cos, sin = rope_cos_sin(_positions(start, x.shape[1]), x.shape[-1], theta)  # (B, L, D/2)
    return _rotate(x.astype(np.float64), cos[:, :, None], sin[:, :, None]).astype(x.dtype)


def rope_kv_write_reference(qkv: np.ndarray, start: np.ndarray, k_cache: np.ndarray,
                            v_cache: np.ndarray, q_out: np.ndarray, n_heads: int,
                            n_kv_heads: int, theta: float,
                            block_table: np.ndarray | None = None) -> None:
    """Write RoPE(q) to ``q_out`` and RoPE(k), v to the caches (in place; see rope_kv_write).

    With ``block_table`` ``(B, MB)`` the caches are a block pool ``(NB, Hkv, BS, D)``.
    """
    b_, l_, w = qkv.shape
    d = w // (n_heads + 2 * n_kv_heads)
    heads = qkv.reshape(b_, l_, n_heads + 2 * n_kv_heads, d).astype(np.float64)
    pos = _positions(start, l_)  # (B, L)
    cos, sin = rope_cos_sin(pos, d, theta)
    rot = _rotate(heads[:, :, : n_heads + n_kv_heads], cos[:, :, None], sin[:, :, None])
    q_out[...] = rot[:, :, :n_heads].transpose(0, 2, 1, 3).astype(q_out.dtype)
    k = rot[:, :, n_heads:].astype(k_cache.dtype)  # (B, L, Hkv, D)
    v = heads[:, :, n_heads + n_kv_heads:].astype(v_cache.dtype)
    s_len = k_cache.shape[2]
    for b in range(b_):
        for i in range(l_):
            p = int(pos[b, i])
            if block_table is None:
                if 0 <= p < s_len:
                    k_cache[b, :, p] = k[b, i]
                    v_cache[b, :, p] = v[b, i]
                continue
            if not 0 <= p < block_table.shape[1] * s_len:
                continue
            blk = int(block_table[b, p // s_len])
            if 0 <= blk < k_cache.shape[0]:
                k_cache[blk, :, p % s_len] = k[b, i]
                v_cache[blk, :, p % s_len] = v[b, i]


def merge_heads_reference(x: np.ndarray) -> np.ndarray:
    """``(B, H, L, D) -> (B, L, H * D)``."""
    b, h, length, d = x.shape
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(b, length, h * d)


def split_qkv_reference(qkv: np.ndarray, n_heads: int, n_kv_heads: int
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(B, L, (Hq + 2 Hkv) D)`` -> q ``(B, Hq, L, D)``, k and v ``(B, Hkv, L, D)`` (copies)."""
    b, length, width = qkv.shape
    d = width // (n_heads + 2 * n_kv_heads)
    heads = qkv.reshape(b, length, n_heads + 2 * n_kv_heads, d).transpose(0, 2, 1, 3)
    return (np.ascontiguousarray(heads[:, :n_heads]),
            np.ascontiguousarray(heads[:, n_heads:n_heads + n_kv_heads]),
            np.ascontiguousarray(heads[:, n_heads + n_kv_heads:]))


def qk_rms_norm_reference(qkv: np.ndarray, wq: np.ndarray, wk: np.ndarray, hq: int, hkv: int,
                          eps: float) -> np.ndarray:
    """The fused QKV rows with every q and k head RMS-normed (float64 math), in ``qkv.dtype``;
    v heads unchanged."""
    d = qkv.shape[-1] // (hq + 2 * hkv)
    x = qkv.astype(np.float64).reshape(-1, hq + 2 * hkv, d)
    for lo, hi, w in ((0, hq, wq), (hq, hq + hkv, wk)):
        h = x[:, lo:hi]
        x[:, lo:hi] = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps) * w.astype(np.float64)
    return x.reshape(qkv.shape).astype(qkv.dtype)
