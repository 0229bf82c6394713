"""Fresh random matrices in a GGUF block format, for tests and benchmarks: quantized random
data where the ``gguf`` package quantizes the format (Q4_0, Q4_1, Q5_0, Q8_0), crafted blocks
(random bytes with valid, small fp16 scales) for those it cannot (Q4_K, Q6_K) or on request."""

from __future__ import annotations

import numpy as np

from ._formats import get_format, pack

__all__ = ["random_blocks", "random_packed"]

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
    """:func:`random_blocks` in the device layout (int32 ``(n, W)``, :func:`._formats.pack`)."""
    return pack(random_blocks(rng, fmt, n, k, quantize=quantize), fmt)
