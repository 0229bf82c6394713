"""Flash attention on the ``cpu`` backend: float32, one batched product per row (see
:mod:`..runtime._cpu`)."""

from __future__ import annotations

import math

import numpy as np

from ..runtime._cpu import f32

__all__ = ["attention_cpu"]

def attention_cpu(q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray, *,
                  causal: bool, scale: float | None, kv_len: np.ndarray | None,
                  block_table: np.ndarray | None, window: int | None = None) -> None:
    """:func:`._reference.attention_reference` in float32, one batched matmul per
    batch row (every head of a key/value head group at once). Shapes checked beforehand;
    ``window`` (with ``causal``): keys older than ``window`` positions are masked too."""
    b, hq, lq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    sc = np.float32(1.0 / math.sqrt(d) if scale is None else scale)
    if block_table is None:
        lk = k.shape[2]
        lens = (np.full(b, lk, np.int64) if kv_len is None
                else np.clip(kv_len.astype(np.int64), 0, lk))
    else:
        assert kv_len is not None
        nb, _h, bs, _d = k.shape
        lens = np.clip(kv_len.astype(np.int64), 0, block_table.shape[1] * bs)
    for bi in range(b):
        n = int(lens[bi])
        if n == 0:
            out[bi] = 0
            continue
        # keys before the first query's window are never read (sliding window)
        lo = max(0, n - lq + 1 - window) if causal and window is not None else 0
        if block_table is None:
            kk, vv = k[bi, :, lo:n], v[bi, :, lo:n]  # (Hkv, n - lo, D)
        else:
            b0, n_blk = lo // bs, -(-n // bs)
            ids = block_table[bi, b0:n_blk].astype(np.int64)
            bad = (ids < 0) | (ids >= nb)
            if bad.any():
                raise IndexError(
                    f"flash_attention: block_table[{bi}] holds block {int(ids[bad][0])}, "
                    f"outside the pool of {nb} blocks (kv_len[{bi}] = {n} reads its entries "
                    f"{b0} .. {n_blk - 1})")
            span = (n_blk - b0) * bs
            kk = k[ids].transpose(1, 0, 2, 3).reshape(hkv, span, d)[:, lo - b0 * bs:n - b0 * bs]
            vv = v[ids].transpose(1, 0, 2, 3).reshape(hkv, span, d)[:, lo - b0 * bs:n - b0 * bs]
        m_keys = n - lo
        qq = f32(q[bi]).reshape(hkv, g * lq, d)
        s = np.matmul(qq, f32(kk).transpose(0, 2, 1))  # (Hkv, g*Lq, n - lo)
        s *= sc
        if causal and (lq > 1 or (window is not None and m_keys > window)):
            # (with Lq = 1 and no window every read key is visible)
            pos = np.arange(lq)[:, None] + (n - lq)  # (Lq, 1) each query's position
            j = np.arange(lo, n)[None, :]
            hidden = j > pos  # (Lq, n - lo)
            if window is not None:
                hidden |= j <= pos - window
            if hidden.any():
                s.reshape(hkv, g, lq, m_keys)[:, :, hidden] = -np.inf
        m = s.max(axis=-1, keepdims=True)
        finite = np.isfinite(m)
        if not finite.all():  # a row with every key masked (or inf scores): as the reference
            m[~finite] = 0.0
        s -= m
        np.exp(s, out=s)
        denom = np.add.reduce(s, axis=-1, keepdims=True)
        o = np.matmul(s, f32(vv))  # (Hkv, g*Lq, D)
        pos = denom > 0
        if pos.all():
            o /= denom
        else:
            np.divide(o, denom, out=o, where=pos)
            o[np.broadcast_to(~pos, o.shape)] = 0.0
        out[bi] = o.reshape(hq, lq, d)
