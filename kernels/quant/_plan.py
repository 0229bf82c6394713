"""The quant family's host planning: the GGUF block formats it runs, the device layout of a
quantized weight (:func:`pack`), and the GEMV's row tiles (:func:`row_tile`).

| format | block (elements) | block bytes | bits/weight | block layout (ggml, little-endian)                       |
|--------|------------------|-------------|-------------|----------------------------------------------------------|
| Q4_0   | 32               | 18          | 4.5         | ``d`` f16, ``qs[16]``: ``(nibble - 8) d``                 |
| Q4_1   | 32               | 20          | 5.0         | ``d`` f16, ``m`` f16, ``qs[16]``: ``nibble d + m``        |
| Q5_0   | 32               | 22          | 5.5         | ``d`` f16, ``qh[4]``, ``qs[16]``: ``(nibble | hbit << 4 - 16) d`` |
| Q8_0   | 32               | 34          | 8.5         | ``d`` f16, ``qs[32]`` int8: ``q d``                       |
| Q4_K   | 256              | 144         | 4.5         | ``d``, ``dmin`` f16, ``scales[12]`` (8 six-bit scale/min pairs), ``qs[128]``: ``d sc nibble - dmin m`` per 32 |
| Q6_K   | 256              | 210         | 6.56        | ``ql[128]``, ``qh[64]``, ``scales[16]`` int8, ``d`` f16: ``d sc (q6 - 32)`` per 16 |

In a 32-element block of Q4_0/Q4_1/Q5_0, element ``j < 16`` is the low nibble of ``qs[j]``
and ``j + 16`` its high nibble (Q5_0: the fifth bit of element ``j`` is bit ``j`` of ``qh``).

**A quantized weight** is an ``(N, K)`` matrix (a Linear weight as checkpoints store it:
``N`` out features, ``K`` in features, ``K`` a multiple of the format's block) kept as its
GGUF blocks: row ``n`` is the ``K / block`` blocks of that row, in order, exactly the bytes of
the GGUF file. On every backend it is an **int32 tensor** ``(N, W)``: each row's bytes padded
with zeros to a multiple of 16 bytes (``W = ceil(row_bytes / 16) * 4``), so every row starts
16-byte aligned (the CUDA kernels' wide loads) and the tensor's dtype is one deviceops has.
:func:`pack` makes it from the GGUF bytes (``(N, row_bytes)`` uint8, as ``gguf`` reads them),
:func:`unpack` gives them back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["FORMATS", "ROW_TILES", "QuantFormat", "get_format", "pack", "packed_words", "row_bytes", "row_tile",
           "unpack"]


@dataclass(frozen=True)
class QuantFormat:
    """One GGUF block format.

    Attributes:
        name: the ggml name (``"Q4_K"``).
        block: elements per block (32, or 256 for the K-quants).
        nbytes: bytes per block.
        code: the format's number in the CUDA source (``QF_*`` in ``quant_formats.cuh``).
    """

    name: str
    block: int
    nbytes: int
    code: int

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per matrix element (scales included)."""
        return 8.0 * self.nbytes / self.block


FORMATS: dict[str, QuantFormat] = {f.name: f for f in (
    QuantFormat("Q4_0", 32, 18, 0),
    QuantFormat("Q4_1", 32, 20, 1),
    QuantFormat("Q5_0", 32, 22, 2),
    QuantFormat("Q8_0", 32, 34, 3),
    QuantFormat("Q4_K", 256, 144, 4),
    QuantFormat("Q6_K", 256, 210, 5),
)}


def get_format(fmt: str, op: str = "quant") -> QuantFormat:
    """The :class:`QuantFormat` named ``fmt``.

    Raises:
        ValueError: an unknown format (the message lists the known ones).
    """
    f = FORMATS.get(fmt) if isinstance(fmt, str) else None
    if f is None:
        raise ValueError(f"{op}: unknown quantized format {fmt!r}; use one of {', '.join(FORMATS)}")
    return f


def row_bytes(fmt: QuantFormat, k: int) -> int:
    """Bytes of one row of ``k`` elements (``k`` a multiple of ``fmt.block``)."""
    return k // fmt.block * fmt.nbytes


def packed_words(fmt: QuantFormat, k: int) -> int:
    """int32 words of one packed row: the row's bytes padded to a multiple of 16."""
    return -(-row_bytes(fmt, k) // 16) * 4


def pack(blocks: np.ndarray, fmt: str) -> np.ndarray:
    """The device layout (module docstring) of GGUF block bytes ``blocks`` ``(N, row_bytes)``.

    Args:
        blocks: uint8 ``(N, row_bytes)`` (``gguf.GGUFReader`` tensors' ``.data``), ``row_bytes``
            a multiple of the format's block bytes.
        fmt: the format's name.

    Returns:
        int32 ``(N, W)``, C-contiguous.

    Raises:
        ValueError: an unknown format, or ``blocks`` not uint8 ``(N, whole blocks)``.
    """
    f = get_format(fmt, "quant.pack")
    b = np.asarray(blocks)
    if b.dtype != np.uint8 or b.ndim != 2 or b.shape[1] % f.nbytes or b.shape[1] == 0:
        raise ValueError(f"quant.pack: blocks must be uint8 (N, whole {fmt} blocks of {f.nbytes} bytes); "
                         f"got {b.dtype} {b.shape}")
    k = b.shape[1] // f.nbytes * f.block
    w = packed_words(f, k)
    out = np.zeros((b.shape[0], w * 4), np.uint8)
    out[:, :b.shape[1]] = b
    return out.view(np.int32)


def unpack(packed: np.ndarray, fmt: str, k: int) -> np.ndarray:
    """The GGUF block bytes ``(N, row_bytes)`` uint8 of a packed weight (a view, no copy)."""
    f = get_format(fmt, "quant.unpack")
    p = np.ascontiguousarray(packed)
    return p.view(np.uint8)[:, :row_bytes(f, k)]


#: the activation row counts the CUDA GEMV is compiled for (one launch takes up to 32 rows)
ROW_TILES = (1, 2, 4, 8, 16, 32)


def row_tile(m: int) -> int:
    """The compiled row count used for ``m`` activation rows (more than 32: tiles of 32)."""
    return next((t for t in ROW_TILES if t >= m), ROW_TILES[-1])
