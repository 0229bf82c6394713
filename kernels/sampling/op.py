"""Token sampling over logits: temperature, top-k, top-p and a counter-based device RNG.

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
from ..runtime._op import KernelOp
from ..runtime._spec import KernelSpec
from ._cuda import sample_cuda
from ._reference import sample_reference

__all__ = ["sample"]

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

