"""Flash attention: the float64 NumPy reference the ``cpu`` backend runs (semantics:
:mod:`deviceops.kernels.attention`)."""

from __future__ import annotations

import math

import numpy as np

from deviceops.extend import ShapeError

__all__ = ["attention_reference"]


def _logical_kv(
    k: np.ndarray, v: np.ndarray, kv_len: np.ndarray | None, block_table: np.ndarray | None
) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """Per batch row: (k rows, v rows) of the valid keys ``(Hkv, n_b, D)`` and ``n_b``."""
    if block_table is None:
        b, _hkv, lk, _d = k.shape
        lens = np.full(b, lk, np.int64) if kv_len is None else np.clip(kv_len, 0, lk)
        ks = [k[bi, :, : int(lens[bi])] for bi in range(b)]
        vs = [v[bi, :, : int(lens[bi])] for bi in range(b)]
        return ks, vs, lens.astype(np.int64)
    assert kv_len is not None
    nb, hkv, bs, d = k.shape
    b, mb = block_table.shape
    lens = np.clip(kv_len.astype(np.int64), 0, mb * bs)
    ks, vs = [], []
    for bi in range(b):
        n_blk = -(-int(lens[bi]) // bs)
        ids = block_table[bi, :n_blk].astype(np.int64)
        bad = (ids < 0) | (ids >= nb)
        if bad.any():
            raise IndexError(
                f"flash_attention: block_table[{bi}] holds block {int(ids[bad][0])}, outside the "
                f"pool of {nb} blocks (kv_len[{bi}] = {int(lens[bi])} reads its first {n_blk} "
                "entries)"
            )
        kk = k[ids].transpose(1, 0, 2, 3).reshape(hkv, n_blk * bs, d)[:, : int(lens[bi])]
        vv = v[ids].transpose(1, 0, 2, 3).reshape(hkv, n_blk * bs, d)[:, : int(lens[bi])]
        ks.append(kk)
        vs.append(vv)
    return ks, vs, lens


def attention_reference(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    causal: bool = False,
    scale: float | None = None,
    kv_len: np.ndarray | None = None,
    block_table: np.ndarray | None = None,
    window: int | None = None,
) -> np.ndarray:
    """NumPy flash-attention forward (float64 math), returned in ``q.dtype``.

    The tests' oracle (the ``cpu`` backend runs it in the reference mode; its float32 path
    is :func:`._cpu.attention_cpu`). Semantics are in the module docstring
    (GQA, bottom-right causal mask, fully masked rows give zeros, ``kv_len``, paged KV).

    Args:
        q: ``(B, Hq, Lq, D)``.
        k: ``(B, Hkv, Lk, D)``, or the block pool ``(num_blocks, Hkv, block_size, D)``.
        v: same shape as ``k``.
        causal: apply the bottom-right aligned causal mask.
        scale: softmax scale; ``1/sqrt(D)`` when None.
        kv_len: optional integer ``(B,)``: valid keys per batch row (clamped to ``[0, Lk]``).
        block_table: optional integer ``(B, max_blocks)`` (paged KV; needs ``kv_len``).
        window: optional sliding window (with ``causal``): query ``i`` at position
            ``p = i + n - Lq`` sees keys ``p - window < j <= p``.

    Returns:
        ``(B, Hq, Lq, D)`` array of q's dtype.

    Raises:
        ShapeError: incompatible shapes.
        IndexError: a ``block_table`` entry that is read lies outside the pool.
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ShapeError(
            f"flash_attention: q, k, v must be 4-D; got q {q.shape}, k {k.shape}, v {v.shape}",
            op="flash_attention",
        )
    b, hq, lq, d = q.shape
    hkv = k.shape[1]
    bad_batch = block_table is None and k.shape[0] != b
    if block_table is not None and (kv_len is None or block_table.shape[0] != b):
        bad_batch = True
    if k.shape != v.shape or bad_batch or k.shape[3] != d or hkv < 1 or hq % hkv:
        raise ShapeError(
            f"flash_attention: incompatible shapes q {q.shape}, k {k.shape}, v {v.shape}"
            + ("" if block_table is None else f", block_table {block_table.shape}"),
            op="flash_attention",
        )
    g = hq // hkv
    sc = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = np.zeros((b, hq, lq, d), dtype=np.float64)
    ks, vs, lens = _logical_kv(k, v, kv_len, block_table)
    qi = np.arange(lq)[:, None]
    for bi in range(b):
        n = int(lens[bi])
        if n == 0:
            continue
        visible = np.arange(n)[None, :] <= qi + (n - lq)  # (Lq, n)
        if window is not None:
            visible &= np.arange(n)[None, :] > qi + (n - lq) - window
        for hk in range(hkv):
            kk = ks[bi][hk].astype(np.float64)  # (n, D)
            vv = vs[bi][hk].astype(np.float64)  # (n, D)
            qq = q[bi, hk * g : (hk + 1) * g].astype(np.float64)  # (g, Lq, D)
            s = (qq @ kk.T) * sc  # (g, Lq, n)
            if causal:
                s = np.where(visible[None], s, -np.inf)
            m = s.max(axis=-1, keepdims=True)
            m = np.where(np.isfinite(m), m, 0.0)
            p = np.exp(s - m)
            denom = p.sum(axis=-1, keepdims=True)
            o = p @ vv
            out[bi, hk * g : (hk + 1) * g] = np.divide(
                o, denom, out=np.zeros_like(o), where=denom > 0
            )
    return out.astype(q.dtype)
