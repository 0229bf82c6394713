"""The quant family on the ``cpu`` backend: the weight dequantized per block by NumPy
(:func:`dequantize_blocks`), then float32 BLAS.

:func:`dequantize_blocks` is written from the block layouts of :mod:`._plan` (independently of
the ``gguf`` package, which the float64 reference uses) and is the readable statement of what
the CUDA kernels compute per block: the scales are fp16 widened to float32, products formed in
float32 (``d * sc`` first for the K-quants, as ggml does).

The float32 copy of a quantized weight is kept in :data:`dequant_cache` (keyed by the
storage and its write count, as the runtime's weight cache keys widened GEMM weights: a write
into the weight makes it dequantize afresh), bounded by ``DEVICEOPS_CPU_WEIGHT_CACHE_MB``
(default 1024). So on the cpu backend a native model holds both its packed weights (what a
GPU holds) and float32 copies of those it multiplies, and runs at float32 BLAS speed.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..runtime._cpu import WeightCache, _limit_from_env, blas, f32
from ._plan import QuantFormat, unpack

__all__ = ["dequant_cache", "dequantize_blocks", "dequantize_cpu", "qmatmul_cpu"]

_f32 = np.float32


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian fp16 from the last axis's 2 bytes, as float32 (shape without that axis)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(_f32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``qs[..., 16]`` -> ``[..., 32]``: low nibbles then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[..., 0:2])
    q = _nibbles(b[..., 2:18]).astype(_f32) - _f32(8)
    return q * d[..., None]


def _q4_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    q = _nibbles(b[..., 4:20]).astype(_f32)
    return q * d[..., None] + m[..., None]


def _q5_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[..., 0:2])
    qh = np.ascontiguousarray(b[..., 2:6]).view("<u4")[..., 0]
    bits = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    q = (_nibbles(b[..., 6:22]) | (bits << 4)).astype(_f32) - _f32(16)
    return q * d[..., None]


def _q8_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[..., 0:2])
    return np.ascontiguousarray(b[..., 2:34]).view(np.int8).astype(_f32) * d[..., None]


def _scale_min_k4(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 scale bytes -> 8 six-bit scales and 8 six-bit mins (``get_scale_min_k4``)."""
    s = sc.astype(np.uint8)
    lo_s = s[..., 0:4] & 63
    lo_m = s[..., 4:8] & 63
    hi_s = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return (np.concatenate([lo_s, hi_s], axis=-1).astype(_f32),
            np.concatenate([lo_m, hi_m], axis=-1).astype(_f32))


def _q4_k(b: np.ndarray) -> np.ndarray:
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _scale_min_k4(b[..., 4:16])  # [..., 8]
    qs = b[..., 16:144].reshape(*b.shape[:-1], 4, 32)  # 4 pairs of 32-element sub-blocks
    q = np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(*b.shape[:-1], 8, 32).astype(_f32)
    scale = d[..., None] * sc  # (d * sc) and (dmin * m) first, as ggml
    mins = dmin[..., None] * mn
    return (scale[..., None] * q - mins[..., None]).reshape(*b.shape[:-1], 256)


def _q6_k(b: np.ndarray) -> np.ndarray:
    lead = b.shape[:-1]
    ql = b[..., 0:128].reshape(*lead, 2, 64)
    qh = b[..., 128:192].reshape(*lead, 2, 32)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(_f32).reshape(*lead, 2, 8)
    d = _f16(b[..., 208:210])
    # element 128 h + 32 t + l (t < 4, l < 32): ql[h, 32 (t & 1) + l] (low nibble for t < 2,
    # high for t >= 2) | ((qh[h, l] >> 2 t) & 3) << 4, minus 32; scale sc[h, 2 t + l // 16]
    quarters = []
    for t in range(4):
        low = ql[..., 32 * (t & 1):32 * (t & 1) + 32]
        nib = (low & 0x0F) if t < 2 else (low >> 4)
        quarters.append((nib | (((qh >> (2 * t)) & 3) << 4)).astype(_f32) - _f32(32))
    q = np.stack(quarters, axis=-2)  # (..., 2, 4, 32)
    s = sc.reshape(*lead, 2, 4, 2)  # [h, t, l // 16]
    s = np.repeat(s, 16, axis=-1)  # (..., 2, 4, 32)
    scale = d[..., None, None, None] * s
    return (scale * q).reshape(*lead, 256)


_BY_NAME: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q6_K": _q6_k,
}


def dequantize_blocks(blocks: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    """float32 ``(N, K)`` from block bytes ``(N, row_bytes)`` uint8 of format ``fmt``."""
    n, rb = blocks.shape
    nb = rb // fmt.nbytes
    b = np.ascontiguousarray(blocks).reshape(n, nb, fmt.nbytes)
    return np.ascontiguousarray(_BY_NAME[fmt.name](b).reshape(n, nb * fmt.block), dtype=_f32)


#: float32 copies of quantized weights (module docstring)
dequant_cache = WeightCache(_limit_from_env())


def dequantize_cpu(w: np.ndarray, f: QuantFormat, k: int, ids: np.ndarray | None = None) -> np.ndarray:
    """float32 rows of the packed weight ``w`` (all of them, or ``w[clip(ids)]``)."""
    blocks = unpack(w, f.name, k)
    if ids is not None:
        rows = np.clip(np.asarray(ids).astype(np.int64).reshape(-1), 0, w.shape[0] - 1)
        return dequantize_blocks(blocks[rows], f).reshape(*np.shape(ids), k)
    return dequantize_blocks(blocks, f)


def qmatmul_cpu(x: np.ndarray, w: np.ndarray, out: np.ndarray, f: QuantFormat, out_col: int,
                bias: np.ndarray | None, w32: np.ndarray | None = None) -> None:
    """``out[:, out_col:out_col + N] = x @ dequant(w).T (+ bias)`` in float32.

    Args:
        x: ``(M, K)``; w: the packed ``(N, W)`` weight; out: ``(M, >= out_col + N)``.
        f: the format; out_col: the first column written; bias: ``(N,)`` or ``None``.
        w32: the weight already dequantized (``(N, K)`` float32), or ``None``.
    """
    k = x.shape[1]
    wf = dequantize_cpu(w, f, k) if w32 is None else w32
    xx = f32(x)
    v = blas.matmul(wf, xx.T).T if xx.shape[0] <= 64 else blas.matmul(xx, wf.T)
    if bias is not None:
        v = v + f32(bias)
    out[:, out_col:out_col + wf.shape[0]] = v
