"""Quantized weights kept in their GGUF block formats (``load_gguf(..., weights="native")``).

A GGUF matrix of one of the formats the quant kernels run (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K,
Q6_K: :data:`deviceops.kernels.quant.FORMATS`) is read as a :class:`QuantArray` (its block
bytes, no expansion) instead of a float array; the architecture's ``bind`` uploads it in the
kernels' packed layout (:func:`deviceops.kernels.quant.pack`: int32 rows padded to 16 bytes)
and builds :class:`~deviceops.nn.layers.QuantLinear` / :class:`~deviceops.nn.layers.QuantEmbedding`
modules on it. (It lives with the architectures, which bind it; the loader above them makes it.) Other tensors (norms, biases, F16/F32 matrices, formats without a kernel) are
dequantized as with the default ``weights="expanded"``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deviceops.kernels import quant

__all__ = ["NATIVE_FORMATS", "QuantArray", "WEIGHT_MODES", "check_weights_mode"]

#: GGUF tensor types kept as they are with ``weights="native"``
NATIVE_FORMATS = tuple(quant.FORMATS)
#: what ``weights=`` may say: ``"expanded"`` (every tensor dequantized to the model's dtype,
#: the default) or ``"native"`` (quantized matrices kept in their block format)
WEIGHT_MODES = ("expanded", "native")


def check_weights_mode(weights: str, what: str) -> str:
    """``weights`` if it is one of :data:`WEIGHT_MODES`, else ``ValueError`` naming them."""
    if weights not in WEIGHT_MODES:
        raise ValueError(f"{what}: weights={weights!r} is not one of {', '.join(map(repr, WEIGHT_MODES))} "
                         "('native' keeps quantized GGUF matrices in their block format)")
    return weights


@dataclass(frozen=True)
class QuantArray:
    """A host ``(N, K)`` matrix as GGUF blocks.

    Attributes:
        fmt: the block format (``"Q4_K"``).
        blocks: uint8 ``(N, row_bytes)``: each row's blocks, as in the file.
        shape: ``(N, K)``.
    """

    fmt: str
    blocks: np.ndarray
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        f = quant.get_format(self.fmt, "QuantArray")
        n, k = self.shape
        if self.blocks.dtype != np.uint8 or self.blocks.shape != (n, k // f.block * f.nbytes) or k % f.block:
            raise ValueError(f"QuantArray: {self.fmt} blocks {self.blocks.dtype} {self.blocks.shape} do not "
                             f"encode a {self.shape} matrix")

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks."""
        return int(self.blocks.nbytes)

    def rows(self, index: np.ndarray) -> QuantArray:
        """The rows ``index`` (a permutation or selection), still quantized."""
        b = np.ascontiguousarray(self.blocks[np.asarray(index)])
        return QuantArray(self.fmt, b, (int(b.shape[0]), self.shape[1]))

    def packed(self) -> np.ndarray:
        """The int32 device layout (:func:`deviceops.kernels.quant.pack`)."""
        return quant.pack(self.blocks, self.fmt)

    def dequantize(self) -> np.ndarray:
        """float32 ``(N, K)`` (``gguf.quants.dequantize``)."""
        import gguf

        t = gguf.GGMLQuantizationType[self.fmt]
        return np.asarray(gguf.quants.dequantize(self.blocks, t), np.float32).reshape(self.shape)

    @staticmethod
    def concat(parts: list[QuantArray]) -> QuantArray:
        """Row-wise concatenation of same-format, same-K parts."""
        fmt, k = parts[0].fmt, parts[0].shape[1]
        if any(p.fmt != fmt or p.shape[1] != k for p in parts):
            raise ValueError("QuantArray.concat: parts differ in format or K")
        b = np.concatenate([p.blocks for p in parts], axis=0)
        return QuantArray(fmt, b, (int(b.shape[0]), k))
