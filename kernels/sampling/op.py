"""Token sampling over logits: temperature, top-k, top-p and a counter-based device RNG;
around it, OpenAI's logits adjustments (:func:`penalize`: presence and frequency penalties,
``logit_bias``), a grammar's allowed-token mask (:func:`mask_logits`) and the sampled token's
log-probability with the top-K (:func:`logprobs`).

CUDA source: ``sampling.cu`` (``sample<T>``, one block per row, :mod:`._cuda`); the ``cpu``
backend runs :func:`._reference.sample_reference` (float64). Both draw the row's uniform number from the same
integer hash of ``(seed[b], counter[b])`` (:func:`._reference.uniform`), so both backends pick the same
token except where float32 rounding moves a boundary.

Every per-row parameter lives in device memory and ``counter`` is advanced in place by the
kernel, so one captured CUDA graph draws fresh numbers at every replay, and a batch can mix
greedy and sampled rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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

from ..runtime._builder import Body, check_out, noop
from ..runtime._checks import MultiCheck, Outputs
from ..runtime._cpu import reference_mode
from ..runtime._op import KernelOp
from ..runtime._spec import KernelSpec
from ._cpu import logprobs_cpu, mask_logits_cpu, penalize_cpu
from ._cuda import logprobs_cuda, mask_logits_cuda, penalize_cuda, sample_cuda
from ._reference import (
    logprobs_reference,
    mask_logits_reference,
    penalize_reference,
    sample_reference,
)

__all__ = ["MASK_BIT", "logprobs", "mask_logits", "penalize", "sample"]

#: The largest ``k`` of :func:`logprobs` (OpenAI's ``top_logprobs`` goes to 20).
MAX_TOP = 20

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
            cuda = sample_cuda(ctx.device.index, oa, ca, la, ta, ka, pa, sa)

        launch(ctx, name, (lt, tt, kt, pt, st, ct), (o, ct), cpu, cuda)

    return check, body


_SAMPLE = KernelSpec("sample", ("logits", "temperature", "top_k", "top_p", "seed", "counter", "out"),
                     _sample_parts, outputs=True, replay=True)



def penalize(logits: Any, counts: Any, bias: Any, presence: Any, frequency: Any,
             mode: Any) -> KernelOp:
    """OpenAI's presence/frequency penalties and logit bias, in place, on the rows that ask.

    Row ``b`` with ``mode[b] & 1``: ``logits[b] = (logits[b] + bias[b]) - (presence[b] *
    (counts[b] > 0) + frequency[b] * counts[b])``, computed in float32 and stored rounded to
    the logits' dtype; every other row is not touched (on CUDA its blocks return after
    reading ``mode[b]``).

    Args:
        logits: ``(B, V)`` float32/float16/bfloat16, C-contiguous.
        counts: int32 ``(B, V)``: how often each token was generated so far.
        bias: float32 ``(B, V)``: added to the logits (OpenAI's ``logit_bias``, dense).
        presence, frequency: float32 ``(B,)``.
        mode: int32 ``(B,)``; bit 0 turns the row's adjustment on.

    Returns:
        A :class:`KernelOp` producing ``logits`` (adjusted in place) in the form given.

    Raises:
        ShapeError, DTypeError: before any launch.
    """
    return _PENALIZE.op((logits, counts, bias, presence, frequency, mode))


#: The ``mode`` bit of a row :func:`mask_logits` masks (bits 0 and 1 are :func:`penalize`'s
#: and :func:`logprobs`').
MASK_BIT = 4


def mask_logits(logits: Any, bitmask: Any, mode: Any) -> KernelOp:
    """A grammar's allowed-token mask, in place, on the rows that ask.

    Row ``b`` with ``mode[b] & 4`` (:data:`MASK_BIT`): ``logits[b, t] = -inf`` for every token
    ``t`` whose bit ``t % 32`` (least significant first) of ``bitmask[b, t // 32]`` is 0 (the
    layout of llguidance's and xgrammar's bitmasks); every other row is not touched (on CUDA
    its blocks return after reading ``mode[b]``). :func:`sample` never draws a ``-inf``
    logit, so a row keeps at least one allowed token finite or its draw is undefined.

    Args:
        logits: ``(B, V)`` float32/float16/bfloat16, C-contiguous.
        bitmask: int32 ``(B, ceil(V / 32))``, C-contiguous.
        mode: int32 ``(B,)``; bit 2 turns the row's mask on.

    Returns:
        A :class:`KernelOp` producing ``logits`` (masked in place) in the form given.

    Raises:
        ShapeError, DTypeError: before any launch.
    """
    return _MASK.op((logits, bitmask, mode))


def logprobs(logits: Any, tokens: Any, mode: Any, counts: Any, *, k: int = MAX_TOP,
             out: Any = None, ids_out: Any = None) -> KernelOp:
    """The sampled tokens' log-probabilities and the top ``k``; counts the tokens.

    Row ``b`` with ``mode[b] & 1``: ``counts[b, tokens[b]] += 1`` (in place). Row ``b``
    with ``mode[b] & 2``: ``out[b, 0] = log_softmax(logits[b])[tokens[b]]`` and, for ``j <
    k``, ``out[b, 1 + j]`` / ``ids_out[b, j]`` the ``j``-th largest log-probability of the
    row and its token (value descending, ties by lower id; ``-inf`` / ``-1`` past the
    vocabulary). The log-softmax is over the logits as given, computed in float32 (the max,
    then the log of the sum of ``exp(x - max)``). Rows without those bits are not written.
    The CUDA kernel (one block per row) makes ``1 + k`` passes over a row that asks and
    returns at once for the others.

    Args:
        logits: ``(B, V)`` float32/float16/bfloat16, C-contiguous.
        tokens: int32 ``(B,)`` (the tokens sampled from ``logits``).
        mode: int32 ``(B,)``: bit 0 counts, bit 1 computes.
        counts: int32 ``(B, V)``, advanced in place.
        k: ``0 .. 20`` (static).
        out: float32 ``(B, k + 1)``; allocated if ``None`` (rows not asking: uninitialised).
        ids_out: int32 ``(B, k)``; allocated if ``None``.

    Returns:
        A :class:`KernelOp` producing ``(out, ids_out)`` in the form given.

    Raises:
        ValueError: ``k`` outside ``[0, 20]``. ShapeError, DTypeError: before any launch.
    """
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP:
        raise ValueError(f"logprobs: k={k!r} must be an int in [0, {MAX_TOP}]")
    return _LOGPROBS.op((logits, tokens, mode, counts, out, ids_out), (k,))


def _rows(name: str, ts: Mapping[str, Tensor | None]) -> tuple[int, int]:
    """The logits' ``(B, V)``, checked."""
    lt = ts["logits"]
    assert lt is not None
    if lt.dtype not in FLOATING:
        raise DTypeError(f"{name}: logits have dtype {lt.dtype}; supported: float32, "
                         "float16, bfloat16", op=name)
    if lt.ndim != 2 or lt.shape[1] < 1 or lt.shape[1] > 2**31 - 1:
        raise ShapeError(f"{name}: logits have shape {lt.shape}; expected (B, V), 1 <= V < "
                         "2**31", op=name)
    return lt.shape[0], lt.shape[1]


def _args(name: str, ts: Mapping[str, Tensor | None], specs: tuple[tuple[str, Any, bool], ...],
          b: int, v: int) -> None:
    """Each named tensor is ``(B,)`` (or ``(B, V)`` where the flag says) of its dtype."""
    for key, dt, wide in specs:
        t = ts[key]
        assert t is not None
        shape = (b, v) if wide else (b,)
        if t.shape != shape:
            raise ShapeError(f"{name}: {key} has shape {t.shape}, expected {shape} (the logits' "
                             f"rows{' and vocabulary' if wide else ''})", op=name)
        if t.dtype != dt:
            raise DTypeError(f"{name}: {key} has dtype {t.dtype}; it must be {dt}", op=name)
        if wide and not t.array.flags.c_contiguous:
            raise ShapeError(f"{name}: {key} must be C-contiguous", op=name)


def _penalize_parts() -> tuple[MultiCheck, Body]:
    name = "penalize"

    def check(ts: Mapping[str, Tensor | None]) -> Outputs:
        b, v = _rows(name, ts)
        lt = ts["logits"]
        assert lt is not None
        if not lt.array.flags.c_contiguous:
            raise ShapeError(f"{name}: logits must be C-contiguous", op=name)
        _args(name, ts, (("counts", int32, True), ("bias", float32, True),
                         ("presence", float32, False), ("frequency", float32, False),
                         ("mode", int32, False)), b, v)
        return {}

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        lt = ts["logits"]
        ct, bt, pt, ft, mt = (ts[k] for k in ("counts", "bias", "presence", "frequency", "mode"))
        la, ca, ba, pa, fa, ma = (t.array for t in (lt, ct, bt, pt, ft, mt))

        if reference_mode():
            def cpu() -> None:
                la[...] = penalize_reference(la, ca, ba, pa, fa, ma)
        else:
            def cpu() -> None:
                penalize_cpu(la, ca, ba, pa, fa, ma, la)

        cuda: Any = noop
        if not ctx.device.is_cpu:
            cuda = penalize_cuda(ctx.device.index, la, ca, ba, pa, fa, ma)
        launch(ctx, name, (lt, ct, bt, pt, ft, mt), (lt,), cpu, cuda)

    return check, body


def _mask_parts() -> tuple[MultiCheck, Body]:
    name = "mask_logits"

    def check(ts: Mapping[str, Tensor | None]) -> Outputs:
        b, v = _rows(name, ts)
        lt, mt = ts["logits"], ts["bitmask"]
        assert lt is not None and mt is not None
        if not lt.array.flags.c_contiguous:
            raise ShapeError(f"{name}: logits must be C-contiguous", op=name)
        w = -(-v // 32)
        if mt.shape != (b, w):
            raise ShapeError(f"{name}: bitmask has shape {mt.shape}, expected ({b}, {w}) (one "
                             f"bit per token of logits {lt.shape}, 32 to an int32)", op=name)
        if mt.dtype != int32:
            raise DTypeError(f"{name}: bitmask has dtype {mt.dtype}; it must be int32", op=name)
        if not mt.array.flags.c_contiguous:
            raise ShapeError(f"{name}: bitmask must be C-contiguous", op=name)
        _args(name, ts, (("mode", int32, False),), b, v)
        return {}

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        lt, mt, mo = ts["logits"], ts["bitmask"], ts["mode"]
        la, ma, moa = lt.array, mt.array, mo.array

        if reference_mode():
            def cpu() -> None:
                la[...] = mask_logits_reference(la, ma, moa)
        else:
            def cpu() -> None:
                mask_logits_cpu(la, ma, moa)

        cuda: Any = noop
        if not ctx.device.is_cpu:
            cuda = mask_logits_cuda(ctx.device.index, la, ma, moa)
        launch(ctx, name, (lt, mt, mo), (lt,), cpu, cuda)

    return check, body


def _logprobs_parts(k: int) -> tuple[MultiCheck, Body]:
    name = "logprobs"

    def check(ts: Mapping[str, Tensor | None]) -> Outputs:
        b, v = _rows(name, ts)
        _args(name, ts, (("tokens", int32, False), ("mode", int32, False),
                         ("counts", int32, True)), b, v)
        check_out(name, ts["out"], (b, k + 1), float32, f"the token's and the top {k} "
                  "log-probabilities of each row")
        ids = ts["ids_out"]
        if ids is not None and (ids.shape != (b, k) or ids.dtype != int32):
            raise ShapeError(f"{name}: ids_out has shape {ids.shape} {ids.dtype}, expected "
                             f"({b}, {k}) int32", op=name)
        return {"out": ((b, k + 1), float32), "ids_out": ((b, k), int32)}

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        lt, tt, mt, ct, o, it = (ts[x] for x in ("logits", "tokens", "mode", "counts", "out",
                                                 "ids_out"))
        la, ta, ma, ca, oa, ia = (t.array for t in (lt, tt, mt, ct, o, it))
        fn = logprobs_reference if reference_mode() else logprobs_cpu

        def cpu() -> None:
            fn(la, ta, ma, ca, oa, ia)

        cuda: Any = noop
        if not ctx.device.is_cpu:
            cuda = logprobs_cuda(ctx.device.index, oa, ia, ca, la, ta, ma)
        launch(ctx, name, (lt, tt, mt, ct), (ct, o, it), cpu, cuda)

    return check, body


def _both(v: dict[str, Any]) -> tuple[Any, Any]:
    return v["out"], v["ids_out"]


_PENALIZE = KernelSpec("penalize", ("logits", "counts", "bias", "presence", "frequency", "mode"),
                       _penalize_parts, returns="logits", outputs=True, replay=True)
_MASK = KernelSpec("mask_logits", ("logits", "bitmask", "mode"), _mask_parts, returns="logits",
                   outputs=True, replay=True)
_LOGPROBS = KernelSpec("logprobs", ("logits", "tokens", "mode", "counts", "out", "ids_out"),
                       _logprobs_parts, returns=_both, outputs=True, replay=True)
