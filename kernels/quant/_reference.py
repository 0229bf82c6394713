"""The quant family's float64 references and the fresh random test data they are checked on
(:func:`random_blocks`: quantized random data where ``gguf`` quantizes the format, Q4_0, Q4_1,
Q5_0, Q8_0; crafted blocks, random bytes with valid small fp16 scales, for the K-quants or on
request). The references: the weight dequantized by the ``gguf`` package
(``gguf.quants.dequantize``, llama.cpp's Python port), then float64 math, one rounding to the
output dtype. Tests compare the ``cpu`` path and every CUDA kernel with these; the ``cpu``
backend runs them in the reference mode (``DEVICEOPS_CPU_KERNELS=reference``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._plan import get_format, pack, unpack

__all__ = ["dequantize_reference", "qmatmul_reference", "random_blocks", "random_packed"]


def dequantize_reference(w: np.ndarray, fmt: str, k: int) -> np.ndarray:
    """float64 ``(N, K)`` of a packed weight (:mod:`._plan`), by ``gguf.quants.dequantize``."""
    import gguf

    get_format(fmt, "dequantize_reference")
    blocks = unpack(np.asarray(w), fmt, k)
    t = gguf.GGMLQuantizationType[fmt]
    return np.asarray(gguf.quants.dequantize(np.ascontiguousarray(blocks), t), dtype=np.float64)


def qmatmul_reference(x: np.ndarray, w: np.ndarray, fmt: str, *, bias: np.ndarray | None = None,
                      out_dtype: Any = None) -> np.ndarray:
    """``x @ dequant(w).T (+ bias)`` in float64, rounded once to ``out_dtype`` (default x's).

    Args:
        x: ``(M, K)``.
        w: the packed ``(N, W)`` int32 weight of ``fmt``.
        fmt: the format's name.
        bias: ``(N,)`` or ``None``.
        out_dtype: the result's dtype (default ``x.dtype``).
    """
    x64 = np.asarray(x).astype(np.float64)
    v = x64 @ dequantize_reference(w, fmt, x64.shape[-1]).T
    if bias is not None:
        v = v + np.asarray(bias).astype(np.float64)
    return v.astype(out_dtype or np.asarray(x).dtype)


#: byte offsets of each format's fp16 scales within a block
_F16_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}
#: magnitude of crafted scales: products of order 1 for unit activations
_SCALE = {"Q4_0": 0.05, "Q4_1": 0.05, "Q5_0": 0.03, "Q8_0": 0.004, "Q4_K": 0.004, "Q6_K": 0.002}
_QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q8_0")


def random_blocks(rng: np.random.Generator, fmt: str, n: int, k: int, *, quantize: bool = True) -> np.ndarray:
    """uint8 ``(n, row_bytes)``: an ``(n, k)`` matrix in ``fmt`` (``k`` a multiple of its block).

    ``quantize``: quantize ``N(0, 1/k)`` data with ``gguf`` where it can; else (or ``False``)
    craft the blocks.
    """
    f = get_format(fmt, "random_blocks")
    if quantize and fmt in _QUANTIZABLE:
        import gguf

        w = rng.standard_normal((n, k)).astype(np.float32) / np.float32(np.sqrt(k))
        return np.asarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType[fmt]))
    nb = k // f.block
    b = rng.integers(0, 256, (n, nb, f.nbytes), dtype=np.uint8)
    for off in _F16_AT[fmt]:
        s = rng.uniform(-_SCALE[fmt], _SCALE[fmt], (n, nb)).astype(np.float16)
        if fmt == "Q4_K" and off == 0:
            s = np.abs(s)
        b[:, :, off:off + 2] = s.view(np.uint8).reshape(n, nb, 2)
    return b.reshape(n, nb * f.nbytes)


def random_packed(rng: np.random.Generator, fmt: str, n: int, k: int, *, quantize: bool = True) -> np.ndarray:
    """:func:`random_blocks` in the device layout (int32 ``(n, W)``, :func:`._plan.pack`)."""
    return pack(random_blocks(rng, fmt, n, k, quantize=quantize), fmt)
