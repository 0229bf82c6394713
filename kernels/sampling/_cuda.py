"""Token sampling on CUDA: ``sample<T>`` of ``sampling.cu``, one block per row of logits;
``penalize<T>``, ``logprobs<T>`` and ``mask_logits<T>`` of ``logits.cu``."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..runtime._rows import CTYPE, kernel_function

__all__ = ["logprobs_cuda", "mask_logits_cuda", "penalize_cuda", "sample_cuda"]

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


_LOGITS_SOURCE = "sampling/logits.cu"
_LOGITS_NAMES = tuple(f"{k}<{c}>" for k in ("penalize", "logprobs", "mask_logits")
                      for c in CTYPE.values())


def penalize_cuda(device_index: int, la: Any, ca: Any, ba: Any, pa: Any, fa: Any,
                  ma: Any) -> Any:
    """A ``cuda(native_stream)`` launch function of ``penalize`` (CuPy arrays: logits, read
    and written in place, counts, bias, presence, frequency, mode)."""
    b, v = la.shape
    fn = kernel_function(device_index, _LOGITS_SOURCE, f"penalize<{CTYPE[la.dtype]}>",
                         _LOGITS_NAMES)
    args = (la, ca, ba, pa, fa, ma, np.int32(v))
    gx = min(-(-v // 256), 64)

    def cuda(native: Any) -> None:
        if b > 0:
            fn((gx, b), (256,), args, stream=native)

    return cuda


def logprobs_cuda(device_index: int, oa: Any, ia: Any, ca: Any, la: Any, ta: Any,
                  ma: Any) -> Any:
    """A ``cuda(native_stream)`` launch function of ``logprobs`` (CuPy arrays: values out,
    ids out, counts, logits, tokens, mode)."""
    b, v = la.shape
    fn = kernel_function(device_index, _LOGITS_SOURCE, f"logprobs<{CTYPE[la.dtype]}>",
                         _LOGITS_NAMES)
    args = (oa, ia, ca, la, ta, ma, np.int32(v), np.int32(ia.shape[1]))
    threads = _threads(v)

    def cuda(native: Any) -> None:
        if b > 0:
            fn((b,), (threads,), args, stream=native)

    return cuda


def mask_logits_cuda(device_index: int, la: Any, ma: Any, mo: Any) -> Any:
    """A ``cuda(native_stream)`` launch function of ``mask_logits`` (CuPy arrays: logits, read
    and written in place, bitmask, mode)."""
    b, v = la.shape
    fn = kernel_function(device_index, _LOGITS_SOURCE, f"mask_logits<{CTYPE[la.dtype]}>",
                         _LOGITS_NAMES)
    args = (la, ma, mo, np.int32(v), np.int32(ma.shape[1]))
    gx = min(-(-v // 256), 64)

    def cuda(native: Any) -> None:
        if b > 0:
            fn((gx, b), (256,), args, stream=native)

    return cuda
