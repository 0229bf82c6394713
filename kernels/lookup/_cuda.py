"""The lookup family on CUDA: ``embedding`` (row gather) and ``argmax`` (row-wise over the
last dim), CUDA source ``lookup.cu`` (one module, every instantiation named up front)."""

from __future__ import annotations

from typing import Any

import numpy as np

from deviceops.extend import Tensor

from ..runtime._rows import BITS, CTYPE, ITYPE, MAX_BLOCKS, kernel_function, row_launch

__all__ = ["argmax_cuda", "embedding_cuda"]

_SOURCE = "lookup/lookup.cu"


def _names() -> tuple[str, ...]:
    names = [f"argmax<{c}, {i}>" for c in CTYPE.values() for i in ITYPE.values()]
    names += [f"embedding<{e}, {i}>" for e in BITS.values() for i in ITYPE.values()]
    return tuple(names)


def argmax_cuda(device_index: int, out: Tensor, x: Tensor) -> Any:
    """A ``cuda(native_stream)`` launch function of ``argmax`` over the last dim."""
    expr = f"argmax<{CTYPE[x.dtype]}, {ITYPE[out.dtype]}>"
    return row_launch(kernel_function(device_index, _SOURCE, expr, _names()), out, x, (), ())


def embedding_cuda(device_index: int, oa: Any, ta: Any, ia: Any) -> Any:
    """A ``cuda(native_stream)`` launch function of ``embedding`` (CuPy arrays: out, table, ids)."""
    n_ids, (vocab, dim) = ia.size, ta.shape
    expr = f"embedding<{BITS[ta.dtype.itemsize]}, {ITYPE[ia.dtype]}>"
    fn = kernel_function(device_index, _SOURCE, expr, _names())
    blocks, threads = min(n_ids, MAX_BLOCKS), min(256, -(-dim // 32) * 32)
    args = (oa, ta, ia, np.int64(n_ids), np.int64(vocab), np.int32(dim))

    def cuda(native: Any) -> None:
        if n_ids > 0:
            fn((blocks,), (threads,), args, stream=native)

    return cuda
