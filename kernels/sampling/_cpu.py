"""The logits adjustments and log-probabilities on the ``cpu`` backend: float32 NumPy (see
:mod:`..runtime._cpu`). ``sample`` itself runs its float64 reference on both modes: its
token choice is a comparison of cumulative weights, which float64 makes stable."""

from __future__ import annotations

import numpy as np

from ..runtime._cpu import f32
from ._reference import top_order

__all__ = ["logprobs_cpu", "mask_logits_cpu", "penalize_cpu"]


def penalize_cpu(logits: np.ndarray, counts: np.ndarray, bias: np.ndarray, presence: np.ndarray,
                 frequency: np.ndarray, mode: np.ndarray, out: np.ndarray) -> None:
    """``out[b] = (x + bias) - (presence * (count > 0) + frequency * count)`` in float32 for
    the rows with ``mode & 1``; the other rows of ``out`` get ``logits`` (``out`` may be
    ``logits``: in place)."""
    rows = np.nonzero(np.asarray(mode) & 1)[0]
    if out is not logits:
        out[...] = logits
    for b in rows:
        c = counts[b]
        cf = c.astype(np.float32)
        pen = np.where(c > 0, np.float32(presence[b]) + np.float32(frequency[b]) * cf,
                       np.float32(0.0))
        x = f32(logits[b]) + bias[b]
        out[b] = (x - pen).astype(out.dtype)


def logprobs_cpu(logits: np.ndarray, tokens: np.ndarray, mode: np.ndarray, counts: np.ndarray,
                 values: np.ndarray, ids: np.ndarray) -> None:
    """:func:`~._reference.logprobs_reference` in float32 (max, then the log of the sum of
    ``exp(x - max)``, as the CUDA kernel)."""
    k = ids.shape[1]
    v = logits.shape[1]
    for b in range(logits.shape[0]):
        md, tok = int(mode[b]), int(tokens[b])
        if md & 1 and 0 <= tok < v:
            counts[b, tok] += 1
        if not md & 2:
            continue
        x = f32(logits[b])
        m = x.max()
        lse = m + np.log(np.exp(x - m).sum(dtype=np.float32))
        order = top_order(x, k)
        values[b, 0] = x[tok] - lse if 0 <= tok < v else -np.inf
        values[b, 1:] = -np.inf
        ids[b, :] = -1
        values[b, 1:1 + order.size] = x[order] - lse
        ids[b, :order.size] = order


def mask_logits_cpu(logits: np.ndarray, bitmask: np.ndarray, mode: np.ndarray) -> None:
    """:func:`~._reference.mask_logits_reference` in place: the bits unpacked a row at a time
    (``bitmask`` int32, little-endian words: byte ``j`` holds tokens ``8j .. 8j+7``)."""
    v = logits.shape[1]
    for b in np.nonzero(np.asarray(mode) & 4)[0]:
        words = np.ascontiguousarray(bitmask[b], dtype="<i4")
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:v]
        logits[b, bits == 0] = -np.inf
