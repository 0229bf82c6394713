"""The fused decode step on the ``cpu`` backend: NumPy over the *packed* buffer (unpacked
here with :func:`.pack.unpack_strips` and the same row orders), float32 math rounded to the
model's dtype where the CUDA kernel rounds. It shares no code with the unfused ops, so a
test comparing the two checks the packing, the parameter plumbing and the step's order."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ._plan import gate_up_order, qkv_order, unpack_strips

if TYPE_CHECKING:
    from .op import FusedDecodeModel

__all__ = ["fused_decode_cpu"]


def _unpacked(m: FusedDecodeModel) -> dict[str, Any]:
    """Float32 weights of every layer, unpacked once per model and packed buffer."""
    flat = m.packed.array
    cache = m.cpu_unpacked
    if cache is not None and cache["src"] is flat:
        return cache
    hd, hq, hkv, h, f, v = m.head_dim, m.n_heads, m.n_kv_heads, m.hidden, m.ffn, m.vocab

    def mat(off: int, n: int, k: int, order: np.ndarray | None = None) -> np.ndarray:
        p = flat[off: off + n * k].reshape(n // 16, k // 16, 32, 8)
        return unpack_strips(p, order).astype(np.float32)

    def vec(off: int, n: int) -> np.ndarray | None:
        return None if off < 0 else flat[off: off + n].astype(np.float32)

    nq = (hq + 2 * hkv) * hd
    layers = []
    for off in m.offsets:
        layers.append({
            "qkv": mat(off["wqkv"], nq, h, qkv_order(hq, hkv, hd)),
            "o": mat(off["wo"], h, hq * hd),
            "gu": mat(off["wgu"], 2 * f, h, gate_up_order(f)),
            "down": mat(off["wd"], h, f),
            "bqkv": vec(off["bqkv"], nq), "bo": vec(off["bo"], h),
            "bgu": vec(off["bgu"], 2 * f), "bd": vec(off["bd"], h),
            "n1": vec(off["n1"], h), "n2": vec(off["n2"], h),
        })
    cache = {"src": flat, "layers": layers, "head": mat(m.off_head, v, h),
             "norm": vec(m.off_norm, h)}
    m.cpu_unpacked = cache
    return cache


def _rope(x1: np.ndarray, x2: np.ndarray, pos: np.ndarray, hd: int, theta: float
          ) -> tuple[np.ndarray, np.ndarray]:
    """Rotate-half pairs ``(j, j + D/2)`` of ``x1``/``x2`` ``(B, heads, D/2)`` at ``pos`` ``(B,)``."""
    j = np.arange(hd // 2, dtype=np.float64)
    ang = pos.astype(np.float64)[:, None] * np.exp2(-(2.0 * j / hd) * np.log2(theta))[None, :]
    ang = ang - np.rint(ang / (2 * np.pi)) * (2 * np.pi)
    c = np.cos(ang).astype(np.float32)[:, None, :]
    s = np.sin(ang).astype(np.float32)[:, None, :]
    return x1 * c - x2 * s, x2 * c + x1 * s


def fused_decode_cpu(m: FusedDecodeModel, b: int, state: np.ndarray, table: np.ndarray,
                     kc: list[np.ndarray], vc: list[np.ndarray], logits: np.ndarray) -> None:
    """One step over rows ``0 .. b-1`` (see :class:`.op.FusedDecodeModel`)."""
    dt = m.dtype
    w = _unpacked(m)

    def rnd(x: np.ndarray) -> np.ndarray:
        return np.asarray(x, np.float32).astype(dt).astype(np.float32)

    hd, hq, hkv = m.head_dim, m.n_heads, m.n_kv_heads
    g = hq // hkv
    start, kv_len, tokens = state[0, :b].astype(np.int64), state[1, :b], state[3, :b]
    mb = table.shape[1]

    def norm(s: np.ndarray, scale: np.ndarray) -> np.ndarray:
        inv = 1.0 / np.sqrt((s * s).mean(-1, keepdims=True) + np.float32(m.eps))
        return rnd(s * inv.astype(np.float32) * scale)

    resid = m.embed.array[tokens].astype(np.float32)
    pending: np.ndarray | None = None  # the previous layer's down projection (float32)
    bd_prev: np.ndarray | None = None
    for li, ly in enumerate(w["layers"]):
        if pending is not None:
            resid = rnd(resid + rnd(pending + (0 if bd_prev is None else bd_prev)))
        x = norm(resid, ly["n1"])
        qkv = rnd(x @ ly["qkv"].T + (0 if ly["bqkv"] is None else ly["bqkv"]))
        heads = qkv.reshape(b, hq + 2 * hkv, hd)
        half = hd // 2
        r1, r2 = _rope(heads[:, : hq + hkv, :half], heads[:, : hq + hkv, half:], start, hd, m.theta)
        rot = rnd(np.concatenate([r1, r2], -1))
        q, k, v = rot[:, :hq], rot[:, hq:], heads[:, hq + hkv:]
        kcache, vcache = kc[li], vc[li]
        bs, nb = kcache.shape[2], kcache.shape[0]
        for r in range(b):
            p = int(start[r])
            if 0 <= p < mb * bs:
                blk = int(table[r, p // bs])
                if 0 <= blk < nb:
                    kcache[blk, :, p % bs] = k[r].astype(dt)
                    vcache[blk, :, p % bs] = v[r].astype(dt)
        att = np.zeros((b, hq, hd), np.float32)
        for r in range(b):
            n = int(kv_len[r])
            if n <= 0:
                continue
            pos = np.arange(n)
            blks = table[r, pos // bs].astype(np.int64)
            blks = np.where((blks < 0) | (blks >= nb), 0, blks)
            keys = kcache[blks, :, pos % bs].astype(np.float32)  # (n, hkv, D)
            vals = vcache[blks, :, pos % bs].astype(np.float32)
            for hh in range(hq):
                sc = keys[:, hh // g] @ q[r, hh] / np.float32(np.sqrt(hd))
                e = np.exp(sc - sc.max())
                att[r, hh] = (e / e.sum()) @ vals[:, hh // g]
        merged = rnd(att).reshape(b, hq * hd)
        o = merged @ ly["o"].T
        resid = rnd(resid + rnd(o + (0 if ly["bo"] is None else ly["bo"])))
        x = norm(resid, ly["n2"])
        gu = rnd(x @ ly["gu"].T + (0 if ly["bgu"] is None else ly["bgu"]))
        f = gu.shape[1] // 2
        gate, up = gu[:, :f], gu[:, f:]
        act = rnd(gate / (1.0 + np.exp(-gate)) * up)
        pending, bd_prev = act @ ly["down"].T, ly["bd"]
    if pending is not None:
        resid = rnd(resid + rnd(pending + (0 if bd_prev is None else bd_prev)))
    x = norm(resid, w["norm"])
    logits[:b] = (x @ w["head"].T).astype(dt)
