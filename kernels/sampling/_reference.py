"""Token sampling's NumPy reference (float64) and the counter-based RNG both backends share:
:func:`uniform` is the same integer hash of ``(seed, counter)`` as ``sampling.cu``."""

from __future__ import annotations

import numpy as np

__all__ = ["logprobs_reference", "mask_logits_reference", "penalize_reference", "sample_reference", "top_order", "uniform"]

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def uniform(seed: int, counter: int) -> float:
    """The uniform number in ``[0, 1)`` of draw ``counter`` of stream ``seed`` (24 bits).

    ``mix64(mix64(seed) + (counter + 1) * 0x9E3779B97F4A7C15) >> 40`` over 2**24, all
    arithmetic modulo 2**64 (``mix64`` is splitmix64's finalizer); the CUDA kernel computes
    the same integers.
    """
    z = _mix64((_mix64(int(seed) & _M64) + ((int(counter) + 1) & _M64) * _GOLDEN) & _M64)
    return (z >> 40) / float(1 << 24)


def _row(l64: np.ndarray, temp: float, k: int, p: float, u: float) -> int:
    """One row of :func:`sample_reference`."""
    m = float(l64.max())  # NaN if any is NaN
    with np.errstate(over="ignore", divide="ignore"):
        inv_t = np.float32(1.0) / np.float32(temp) if temp > 0.0 else np.float32(np.inf)
    if not (temp > 0.0 and np.isfinite(m) and np.isfinite(inv_t)):
        return int(np.argmax(l64))  # greedy: the first maximum (NaN counts as the largest)
    v = l64.shape[0]
    keep = np.ones(v, bool)
    if 0 < k < v:
        kth = np.sort(l64)[::-1][k - 1]
        keep = l64 >= kth
    w = np.where(keep, np.exp((l64 - m) / temp), 0.0)
    if p < 1.0:
        order = np.argsort(-l64[keep], kind="stable")
        vals, ws = l64[keep][order], w[keep][order]
        csum = np.cumsum(ws)
        # mass of {x >= vals[j]} counts every tie of vals[j]: take each run's last index
        last = np.r_[vals[1:] != vals[:-1], True]
        need = p * float(w.sum())
        hits = np.nonzero(last & (csum >= need))[0]
        thr = vals[hits[0]] if hits.size else vals[-1]
        keep &= l64 >= thr
        w = np.where(keep, w, 0.0)
    c = np.cumsum(w)
    target = u * float(c[-1])
    i = int(np.searchsorted(c, target, side="right"))
    if i >= v or not keep[i] or w[i] <= 0.0:  # rounding: the last kept index
        i = int(np.nonzero(keep & (w > 0))[0][-1])
    return i


def sample_reference(logits: np.ndarray, temperature: np.ndarray, top_k: np.ndarray,
                     top_p: np.ndarray, seed: np.ndarray, counter: np.ndarray) -> np.ndarray:
    """float64 sampling of each row; advances ``counter`` in place; int32 ``(B,)`` tokens.

    Row b: ``temperature <= 0`` (or NaN/inf logits) gives the first argmax. Otherwise the
    kept set is the values ``>=`` the ``top_k``-th largest (``0`` or ``>= V``: all), then the
    values ``>=`` the largest ``t`` whose kept mass ``{x >= t}`` reaches ``top_p`` of the
    kept total (``top_p >= 1``: off); weights ``exp((x - max) / temperature)``; the token
    is the first index (index order) where the running weight sum exceeds
    ``uniform(seed, counter) * total``.
    """
    out = np.empty(logits.shape[0], np.int32)
    for b in range(logits.shape[0]):
        u = uniform(int(seed[b]), int(counter[b]))
        counter[b] += 1
        out[b] = _row(logits[b].astype(np.float64), float(np.float32(temperature[b])),
                      int(top_k[b]), float(np.float32(top_p[b])), u)
    return out




def penalize_reference(logits: np.ndarray, counts: np.ndarray, bias: np.ndarray,
                       presence: np.ndarray, frequency: np.ndarray, mode: np.ndarray) -> np.ndarray:
    """float64 penalised logits, rounded to ``logits.dtype``; rows without ``mode & 1`` are
    returned unchanged.

    Row b with ``mode[b] & 1``: ``x + bias - (presence * (count > 0) + frequency * count)``
    (OpenAI's presence/frequency penalties and ``logit_bias``), with ``presence`` and
    ``frequency`` read as float32 values.
    """
    out = logits.copy()
    for b in np.nonzero(np.asarray(mode) & 1)[0]:
        c = counts[b].astype(np.float64)
        pen = np.where(c > 0, float(np.float32(presence[b])) + float(np.float32(frequency[b])) * c,
                       0.0)
        out[b] = (logits[b].astype(np.float64) + bias[b].astype(np.float64) - pen).astype(
            logits.dtype)
    return out


def top_order(row: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest values of ``row``, largest first, ties by lower index."""
    order = np.lexsort((np.arange(row.shape[0]), -row))
    return order[:k]


def logprobs_reference(logits: np.ndarray, tokens: np.ndarray, mode: np.ndarray,
                       counts: np.ndarray, values: np.ndarray, ids: np.ndarray) -> None:
    """float64 oracle of :func:`~.op.logprobs`: fills ``values`` ``(B, K + 1)`` and ``ids``
    ``(B, K)`` of the rows with ``mode & 2`` and counts the token of the rows with
    ``mode & 1`` (in place; other rows untouched).

    ``values[b, 0]`` is ``log_softmax(logits[b])[tokens[b]]``; ``values[b, 1 + j]`` and
    ``ids[b, j]`` the ``j``-th largest log-probability and its token (ties: lower id first;
    past the vocabulary: ``-inf`` and ``-1``).
    """
    k = ids.shape[1]
    v = logits.shape[1]
    for b in range(logits.shape[0]):
        md, tok = int(mode[b]), int(tokens[b])
        if md & 1 and 0 <= tok < v:
            counts[b, tok] += 1
        if not md & 2:
            continue
        x = logits[b].astype(np.float64)
        m = float(x.max())
        lse = m + float(np.log(np.exp(x - m).sum()))
        lp = x - lse
        order = top_order(x, k)
        values[b, 0] = lp[tok] if 0 <= tok < v else -np.inf
        values[b, 1:] = -np.inf
        ids[b, :] = -1
        values[b, 1:1 + order.size] = lp[order]
        ids[b, :order.size] = order


def mask_logits_reference(logits: np.ndarray, bitmask: np.ndarray, mode: np.ndarray) -> np.ndarray:
    """The masked logits (a copy): row ``b`` with ``mode[b] & 4`` gets ``-inf`` at every token
    ``t`` whose bit ``t % 32`` (least significant first) of ``bitmask[b, t // 32]`` is 0;
    other rows are returned unchanged."""
    out = logits.copy()
    v = logits.shape[1]
    t = np.arange(v)
    for b in np.nonzero(np.asarray(mode) & 4)[0]:
        words = bitmask[b].astype(np.int64) & 0xFFFFFFFF
        allowed = (words[t // 32] >> (t % 32)) & 1
        out[b, allowed == 0] = -np.inf
    return out
