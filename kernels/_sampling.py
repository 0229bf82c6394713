"""Token sampling over logits: temperature, top-k, top-p and a counter-based device RNG.

CUDA source: ``src/sampling.cu`` (``sample<T>``, one block per row); the ``cpu`` backend
runs :func:`sample_reference` (float64). Both draw the row's uniform number from the same
integer hash of ``(seed[b], counter[b])`` (:func:`uniform`), so both backends pick the same
token except where float32 rounding moves a boundary.

Every per-row parameter lives in device memory and ``counter`` is advanced in place by the
kernel, so one captured CUDA graph draws fresh numbers at every replay, and a batch can mix
greedy and sampled rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from deviceops.extend import (
    FLOATING,
    DTypeError,
    ExecutionContext,
    ShapeError,
    Tensor,
    float32,
    int32,
    int64,
    launch,
)

from ._builder import Body, check_out, noop
from ._launch import KernelOp
from ._multi_op import MultiCheck, Outputs
from ._norms import CTYPE, tk_function
from ._spec import KernelSpec

__all__ = ["sample", "sample_reference", "uniform"]

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


def _threads(v: int) -> int:
    return 1024 if v >= 8192 else max(32, min(1024, -(-v // 32) * 32))


def sample(logits: Any, temperature: Any, top_k: Any, top_p: Any, seed: Any, counter: Any, *,
           out: Any = None) -> KernelOp:
    """Draw one token per row of ``logits``; advances ``counter`` in place.

    Row ``b`` draws ``u = uniform(seed[b], counter[b])`` (:func:`uniform`, a counter-based
    hash, identical on both backends), then ``counter[b] += 1`` (every row, greedy ones
    too), so a captured graph draws new numbers at each replay. With
    ``temperature[b] <= 0`` the token is the argmax (first maximum). Otherwise the
    distribution is the softmax of ``logits / temperature`` restricted to

    * top-k: values ``>=`` the ``k``-th largest (ties at the threshold are kept, as in
      Hugging Face's warper; ``top_k <= 0`` or ``>= V`` turns it off), then
    * top-p: the smallest set of largest values whose probability (renormalised over the
      top-k set) reaches ``top_p`` (ties at the threshold kept; ``top_p >= 1`` is off);

    and the token is the first index, in index order, where the running sum of the kept
    weights exceeds ``u`` times their total (inverse CDF). The CUDA kernel (one block per
    row) finds thresholds with radix selects, not a sort; under top-k or top-p it first
    compacts the largest values (``k`` of them, or 2048 under top-p alone) into shared
    memory and works on that list, falling back to whole-row passes when they do not fit
    or (top-p alone) do not hold ``top_p`` of the mass. NaN logits are not
    supported (the row then returns its argmax, the first NaN).

    Args:
        logits: ``(B, V)`` (float32, float16, bfloat16; C-contiguous).
        temperature: float32 ``(B,)``.
        top_k: int32 ``(B,)``.
        top_p: float32 ``(B,)``.
        seed: int64 ``(B,)``.
        counter: int64 ``(B,)``, read and advanced in place.
        out: optional int32 ``(B,)``; allocated if ``None``.

    Returns:
        A :class:`KernelOp` producing ``out`` (int32 token ids) in the form given.

    Raises:
        ShapeError, DTypeError: before any launch.
    """
    return _SAMPLE.op((logits, temperature, top_k, top_p, seed, counter, out))


def _sample_parts() -> tuple[MultiCheck, Body]:
    name = "sample"

    def check(ts: Mapping[str, Tensor | None]) -> Outputs:
        lt = ts["logits"]
        assert lt is not None
        if lt.dtype not in FLOATING:
            raise DTypeError(f"{name}: logits have dtype {lt.dtype}; supported: float32, "
                             "float16, bfloat16", op=name)
        if lt.ndim != 2 or lt.shape[1] < 1:
            raise ShapeError(f"{name}: logits have shape {lt.shape}; expected (B, V), V >= 1",
                             op=name)
        if lt.shape[1] > 2**31 - 1:
            raise ShapeError(f"{name}: rows of {lt.shape[1]} logits are too long", op=name)
        b = lt.shape[0]
        for k, dt in (("temperature", float32), ("top_k", int32), ("top_p", float32),
                      ("seed", int64), ("counter", int64)):
            t = ts[k]
            assert t is not None
            if t.shape != (b,):
                raise ShapeError(f"{name}: {k} has shape {t.shape}, expected ({b},) (one per "
                                 f"row of logits {lt.shape})", op=name)
            if t.dtype != dt:
                raise DTypeError(f"{name}: {k} has dtype {t.dtype}; it must be {dt} ({b},)",
                                 op=name)
        check_out(name, ts["out"], (b,), int32, f"one int32 token per row of logits {lt.shape}")
        return {"out": ((b,), int32)}

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        lt, o = ts["logits"], ts["out"]
        tt, kt, pt, st, ct = (ts[k] for k in ("temperature", "top_k", "top_p", "seed", "counter"))
        la, oa, ta, ka, pa, sa, ca = (t.array for t in (lt, o, tt, kt, pt, st, ct))

        def cpu() -> None:
            oa[...] = sample_reference(la, ta, ka, pa, sa, ca)

        cuda: Any = noop
        if not ctx.device.is_cpu:
            b, v = lt.shape
            fn = tk_function(ctx.device.index, f"sample<{CTYPE[lt.dtype]}>")
            args = (oa, ca, la, ta, ka, pa, sa, np.int32(v))
            threads = _threads(v)

            def cuda(native: Any) -> None:
                if b > 0:
                    fn((b,), (threads,), args, stream=native)

        launch(ctx, name, (lt, tt, kt, pt, st, ct), (o, ct), cpu, cuda)

    return check, body


_SAMPLE = KernelSpec("sample", ("logits", "temperature", "top_k", "top_p", "seed", "counter", "out"),
                     _sample_parts, outputs=True, replay=True)

