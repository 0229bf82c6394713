"""Token sampling's NumPy reference (float64) and the counter-based RNG both backends share:
:func:`uniform` is the same integer hash of ``(seed, counter)`` as ``sampling.cu``."""

from __future__ import annotations

import numpy as np

__all__ = ["sample_reference", "uniform"]

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


