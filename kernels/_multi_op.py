"""A kernel op with several outputs (or an output that defaults to an input), and the
argument checks the transformer kernels share.

:func:`multi_op` generalises :func:`._builder.build_op` (one ``out``) to ops such as
``add_rms_norm`` (``out`` and ``residual_out``, the latter defaulting to ``residual``) and
``rope_kv_write`` (``q_out`` allocated, the caches written in place).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from deviceops._context import ExecutionContext
from deviceops._dtypes import FLOATING
from deviceops._errors import DTypeError, ShapeError
from deviceops._tensor import Tensor, allocate, check_device

from ._builder import OPTIONAL_ARGS, checked, plain_args, require_tensors
from ._launch import KernelOp, as_tensor, is_deferred
from ._plan import cached, static_key

__all__ = ["Body", "MultiCheck", "Outputs", "distinct", "floating", "multi_op", "same"]

Outputs = dict[str, tuple[tuple[int, ...], np.dtype[Any]]]
MultiCheck = Callable[[Mapping[str, Tensor | None]], Outputs]
Body = Callable[[ExecutionContext, dict[str, Tensor]], None]


def multi_op(name: str, args: dict[str, Any], check: MultiCheck, body: Body,
             result: Callable[[dict[str, Any]], Any],
             defaults: Mapping[str, str] | None = None) -> KernelOp:
    """A KernelOp whose outputs are the keys ``check`` returns (allocated when ``None``).

    ``defaults`` maps an output left ``None`` to another argument it then aliases (e.g.
    ``residual_out`` -> ``residual``). ``result(values)`` builds the op's output from the
    argument values as given (allocated outputs filled in).
    """
    keys = tuple(args)
    vals = tuple(args.values())
    dflt = dict(defaults or {})
    if plain_args(name, args, OPTIONAL_ARGS):
        return _plain_multi(name, args, check, body, result, dflt)
    require_tensors(name, args)  # None for a required tensor: TypeError naming it (issue 16)

    def tensors(vs: tuple[Any, ...]) -> dict[str, Tensor | None]:
        ts = {k: None if v is None else as_tensor(v, name, k) for k, v in zip(keys, vs, strict=True)}
        for k, src in dflt.items():
            if ts[k] is None:
                ts[k] = ts[src]
        return ts

    def full_check(ts: Mapping[str, Tensor | None]) -> Outputs:
        out: Outputs = checked(name, ts, check)
        return out

    early = None if any(is_deferred(v) for v in vals) else full_check(tensors(vals))

    def run(ctx: ExecutionContext, *vs: Any) -> Any:
        ts = tensors(vs)
        outs = early if early is not None else full_check(ts)
        stream = ctx.stream
        for t in ts.values():
            if t is not None:
                check_device(t, stream, name)
        given = dict(zip(keys, vs, strict=True))
        for k, src in dflt.items():
            if given[k] is None:
                given[k] = given[src]
        for k, (shape, dt) in outs.items():
            if given[k] is None:
                given[k] = ts[k] = allocate(stream, shape, dt, name)
        body(ctx, {k: t for k, t in ts.items() if t is not None})
        return result(given)

    return KernelOp(name, run, vals)


def _plain_multi(name: str, args: dict[str, Any], check: MultiCheck, body: Body,
                 result: Callable[[dict[str, Any]], Any], dflt: Mapping[str, str]) -> KernelOp:
    """multi_op when every argument is a Tensor or ``None``: the check's result comes from
    the plan cache, the launch reuses the argument dict built here."""
    ts: dict[str, Any] = dict(args)
    for k, src in dflt.items():
        if ts[k] is None:
            ts[k] = ts[src]
    vals = tuple(ts.values())  # the key sees the defaulted outputs' aliasing too
    outs = cached(static_key(check), vals, lambda: checked(name, ts, check))
    given = {k: t for k, t in ts.items() if t is not None}
    first = next(iter(given.values()))
    dev = first._storage.device
    missing = [(k, shape, dt) for k, (shape, dt) in outs.items() if ts[k] is None]
    res = None if missing else result(ts)

    def run(ctx: ExecutionContext, *vs: Any) -> Any:
        stream = ctx.stream
        if stream.device is not dev:
            check_device(first, stream, name)
        if not missing:
            body(ctx, given)
            return res
        now = dict(ts)
        for k, shape, dt in missing:
            now[k] = allocate(stream, shape, dt, name)
        body(ctx, {k: t for k, t in now.items() if t is not None})
        return result(now)

    return KernelOp.plain(name, run, tuple(args.values()))


# -- shared checks ---------------------------------------------------------------------------


def floating(name: str, what: str, t: Tensor) -> None:
    """Refuse a non-floating tensor ``what`` of op ``name`` (``DTypeError``)."""
    if t.dtype not in FLOATING:
        raise DTypeError(f"{name}: {what} has dtype {t.dtype}; supported: float32, float16, "
                         "bfloat16", op=name)


def same(name: str, what: str, t: Tensor, shape: tuple[int, ...], dtype: np.dtype[Any],
         why: str) -> None:
    """Refuse ``t`` unless it has ``shape`` and ``dtype`` (``ShapeError`` / ``DTypeError``)."""
    if t.shape != shape:
        raise ShapeError(f"{name}: {what} has shape {t.shape}, expected {shape} ({why})", op=name)
    if t.dtype != dtype:
        raise DTypeError(f"{name}: {what} has dtype {t.dtype}, expected {dtype} ({why})", op=name)


def distinct(name: str, ts: Mapping[str, Tensor | None], pairs: tuple[tuple[str, str], ...],
             fix: str) -> None:
    """Refuse (``ShapeError``) each pair of given tensors that share storage."""
    for a, b in pairs:
        ta, tb = ts.get(a), ts.get(b)
        if ta is not None and tb is not None and ta._storage is tb._storage:
            raise ShapeError(f"{name}: {a} {ta.shape} shares memory with {b} {tb.shape}; {fix}",
                             op=name)
