"""Token sampling on CUDA: ``sample<T>`` of ``sampling.cu``, one block per row of logits."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..runtime._rows import CTYPE, kernel_function

__all__ = ["sample_cuda"]

_SOURCE = "sampling/sampling.cu"
_NAMES = tuple(f"sample<{c}>" for c in CTYPE.values())


def _threads(v: int) -> int:
    return 1024 if v >= 8192 else max(32, min(1024, -(-v // 32) * 32))


def sample_cuda(device_index: int, oa: Any, ca: Any, la: Any, ta: Any, ka: Any, pa: Any,
                sa: Any) -> Any:
    """A ``cuda(native_stream)`` launch function of ``sample`` (CuPy arrays: out, counter,
    logits, temperature, top_k, top_p, seed)."""
    b, v = la.shape
    fn = kernel_function(device_index, _SOURCE, f"sample<{CTYPE[la.dtype]}>", _NAMES)
    args = (oa, ca, la, ta, ka, pa, sa, np.int32(v))
    threads = _threads(v)

    def cuda(native: Any) -> None:
        if b > 0:
            fn((b,), (threads,), args, stream=native)

    return cuda
