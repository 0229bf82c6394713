"""The KernelOp builder: how a launcher's check and launch body become a DeviceOp.

A launcher (``rms_norm``, ``gemm``, ...) describes its kernel with two functions:

* ``check(tensors) -> (out_shape, out_dtype)``: validates shapes, dtypes and layouts
  (raising :class:`~deviceops.ShapeError` / :class:`~deviceops.DTypeError` naming the op,
  the argument and the fix) and says what the output is;
* ``body(ctx, tensors)``: launches, through :func:`deviceops._launch.launch`.

:func:`build_op` turns them into a :class:`._launch.KernelOp` whose output argument is
``out`` (allocated when ``None``); :mod:`._multi_op` does the same for several outputs.
When every argument is a Tensor, the check's result comes from the plan cache
(:mod:`._plan`); Partition and DeviceOp arguments are checked once their values are known,
still before anything of the op is launched.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from deviceops._context import ExecutionContext
from deviceops._errors import DeviceError, DTypeError, ShapeError
from deviceops._tensor import Partition, Tensor, allocate, check_device

from ._launch import KernelOp, as_tensor, contiguous, is_deferred
from ._plan import cached, static_key

__all__ = ["OPTIONAL_ARGS", "Body", "Check", "build_op", "check_out", "checked", "noop",
           "plain_args", "require_tensors", "same_device"]

Check = Callable[[Mapping[str, Tensor | None]], tuple[tuple[int, ...], np.dtype[Any]]]
Body = Callable[[ExecutionContext, dict[str, Tensor]], None]


def same_device(name: str, ts: Mapping[str, Tensor | None]) -> None:
    """Raise :class:`~deviceops.DeviceError` if the given tensors live on different devices."""
    given = [(k, t) for k, t in ts.items() if t is not None]
    if not given:
        return
    k0, t0 = given[0]
    for k, t in given[1:]:
        if t.device is not t0.device:
            raise DeviceError(f"{name}: {k} is on {t.device} but {k0} is on {t0.device}", op=name)


def checked(name: str, ts: Mapping[str, Tensor | None], check: Callable[[Any], Any]) -> Any:
    """Every given tensor C-contiguous and on one device, then ``check(ts)``'s result."""
    for k, t in ts.items():
        if t is not None:
            contiguous(t, name, k)
    same_device(name, ts)
    return check(ts)


def check_out(name: str, out: Tensor | None, shape: tuple[int, ...], dtype: np.dtype[Any],
              why: str) -> None:
    """Validate a caller-provided output against the expected shape and dtype."""
    if out is None:
        return
    if out.shape != shape:
        raise ShapeError(f"{name}: out has shape {out.shape}, expected {shape} ({why})", op=name)
    if out.dtype != dtype:
        raise DTypeError(f"{name}: out has dtype {out.dtype}, expected {dtype} ({why})", op=name)


OPTIONAL_ARGS = ("out", "bias", "kv_len", "block_table")


def require_tensors(name: str, args: Mapping[str, Any], optional: tuple[str, ...] = OPTIONAL_ARGS
                    ) -> None:
    """Refuse, at construction, a tensor argument that is ``None`` (unless optional: named
    in ``optional``, ``out`` or ``*_out``) or not a Tensor/Partition/DeviceOp.

    Raises:
        TypeError: naming the kernel and the argument. DeviceOp arguments are then
            consumed (the error is the report: no "never executed" warning).
    """
    for k, v in args.items():
        if v is None:
            if k in optional or k == "out" or k.endswith("_out"):
                continue
        elif is_deferred(v) or isinstance(v, Tensor | Partition):
            continue
        for o in args.values():
            if is_deferred(o):
                o._consume()
        as_tensor(v, name, k)  # raises the TypeError naming the argument


def build_op(name: str, args: dict[str, Any], check: Check, body: Body,
             optional: tuple[str, ...] = OPTIONAL_ARGS) -> KernelOp:
    """A KernelOp for a kernel whose output argument is ``args["out"]``.

    Arguments given as Tensors/Partitions are validated by ``check`` now, DeviceOp
    arguments once they have executed (still before anything of this op is launched).
    ``check`` also validates every tensor's layout and returns the output's shape and
    dtype; when ``out`` is ``None`` it is allocated (refused inside graph capture).
    ``body(ctx, tensors)`` launches. The op produces ``out`` in the form given.
    Every argument not named in ``optional`` is required: ``None`` or a value that is
    not a Tensor/Partition/DeviceOp raises ``TypeError`` naming it, at construction.

    When every argument is a Tensor (or ``None``), the check's result is looked up in the
    plan cache (:mod:`._plan`) first, and the op launches without re-deriving anything.
    """
    keys = tuple(args)
    vals = tuple(args.values())
    i_out = keys.index("out")
    if not plain_args(name, args, optional):
        return _general_op(name, keys, vals, i_out, check, body)
    given = {k: v for k, v in args.items() if v is not None}
    oshape, odt = cached(static_key(check), vals, lambda: checked(name, args, check))
    first = next(iter(given.values()))
    dev = first._storage.device
    out0 = vals[i_out]

    def run(ctx: ExecutionContext, *vs: Any) -> Any:
        stream = ctx.stream
        if stream.device is not dev:
            check_device(first, stream, name)
        if out0 is not None:
            body(ctx, given)
            return out0
        out_t = allocate(stream, oshape, odt, name)
        body(ctx, {**given, "out": out_t})
        return out_t

    return KernelOp.plain(name, run, vals)


def plain_args(name: str, args: Mapping[str, Any], optional: tuple[str, ...]) -> bool:
    """True if every argument is a Tensor or an allowed ``None`` (the plan-cache fast path).

    Raises:
        TypeError: a required argument is ``None`` or of a wrong kind (see
            :func:`require_tensors`).
    """
    for k, v in args.items():
        if v is None:
            if k in optional or k == "out" or k.endswith("_out"):
                continue
        elif type(v) is Tensor:
            continue
        require_tensors(name, args, optional)  # raises for a bad argument
        return False
    return True


def _general_op(name: str, keys: tuple[str, ...], vals: tuple[Any, ...], i_out: int,
                check: Check, body: Body) -> KernelOp:
    """build_op with Partition or DeviceOp arguments (checked once their values are known)."""

    def tensors(vs: tuple[Any, ...]) -> dict[str, Tensor | None]:
        return {k: None if v is None else as_tensor(v, name, k) for k, v in zip(keys, vs, strict=True)}

    def full_check(ts: Mapping[str, Tensor | None]) -> tuple[tuple[int, ...], np.dtype[Any]]:
        out: tuple[tuple[int, ...], np.dtype[Any]] = checked(name, ts, check)
        return out

    early = None if any(is_deferred(v) for v in vals) else full_check(tensors(vals))

    def run(ctx: ExecutionContext, *vs: Any) -> Any:
        ts = tensors(vs)
        oshape, odt = early if early is not None else full_check(ts)
        stream = ctx.stream
        for t in ts.values():
            if t is not None:
                check_device(t, stream, name)
        out_v = vs[i_out]
        if out_v is None:
            out_v = ts["out"] = allocate(stream, oshape, odt, name)
        body(ctx, {k: t for k, t in ts.items() if t is not None})
        return out_v

    return KernelOp(name, run, vals)


def noop(*_: Any) -> None:
    """A launch function that does nothing (the other backend's half of a launch)."""
