"""The KernelOp builder: how a launcher's check and launch body become a DeviceOp.

A launcher (``rms_norm``, ``gemm``, ...) describes its kernel with two functions:

* ``check(tensors) -> (out_shape, out_dtype)``: validates shapes, dtypes and layouts
  (raising :class:`~deviceops.ShapeError` / :class:`~deviceops.DTypeError` naming the op,
  the argument and the fix) and says what the output is;
* ``body(ctx, tensors)``: launches, through :func:`deviceops.extend.launch`.

:func:`build_op` turns them into a :class:`._op.KernelOp` whose output argument is
``out`` (allocated when ``None``); :func:`multi_op` does the same for several outputs (or an
output that defaults to an input); both are one implementation (:func:`_general_op`), which
:class:`._spec.KernelSpec` also uses for Partition and DeviceOp arguments: those are checked
once their values are known, still before anything of the op is launched. Tensor arguments
are checked at construction.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from deviceops.extend import (
    DeviceError,
    DTypeError,
    ExecutionContext,
    Partition,
    ShapeError,
    Tensor,
    allocate,
    check_device,
)

from ._op import KernelOp, as_tensor, contiguous, is_deferred

__all__ = ["OPTIONAL_ARGS", "Body", "Check", "MultiCheck", "Outputs", "build_op", "check_out",
           "checked", "multi_op", "noop", "plain_args", "require_tensors", "same_device"]

Check = Callable[[Mapping[str, Tensor | None]], tuple[tuple[int, ...], np.dtype[Any]]]
Outputs = dict[str, tuple[tuple[int, ...], np.dtype[Any]]]
MultiCheck = Callable[[Mapping[str, Tensor | None]], Outputs]
Body = Callable[[ExecutionContext, dict[str, Tensor]], None]


def same_device(name: str, ts: Mapping[str, Tensor | None]) -> None:
    """Raise :class:`~deviceops.DeviceError` if the given tensors live on different devices."""
    given = [(k, t) for k, t in ts.items() if t is not None]
    if not given:
        return
    k0, t0 = given[0]
    for k, t in given[1:]:
        if t.device is not t0.device:
            raise DeviceError(f"{name}: {k} is on {t.device} but {k0} is on {t0.device}; an op "
                              f"runs on one device: copy one first with api.to_device(t, "
                              f"{str(t0.device)!r})", op=name, device=str(t.device))


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

    An op built here checks on every call; the library's launchers are
    :class:`._spec.KernelSpec` s, whose checks are cached and whose launches replay.
    """
    return multi_op(name, args, check, body, _the_out, optional=optional, single=True)


def _the_out(given: dict[str, Any]) -> Any:
    return given["out"]


def multi_op(name: str, args: dict[str, Any], check: Callable[[Any], Any], body: Body,
             result: Callable[[dict[str, Any]], Any],
             defaults: Mapping[str, str] | None = None, *,
             optional: tuple[str, ...] = OPTIONAL_ARGS, single: bool = False) -> KernelOp:
    """A KernelOp whose outputs are the keys ``check`` returns (allocated when ``None``).

    ``check`` returns :data:`Outputs` (``{name: (shape, dtype)}``), or with ``single`` the
    ``(shape, dtype)`` of ``out`` alone (:func:`build_op`). ``defaults`` maps an output left
    ``None`` to another argument it then aliases (e.g. ``residual_out`` -> ``residual``).
    ``result(values)`` builds the op's output from the argument values as given (allocated
    outputs filled in).
    """
    plain_args(name, args, optional)  # a required None or a wrong kind raises TypeError
    return _general_op(name, args, check, single, body, result, dict(defaults or {}))


def _outputs(name: str, ts: Mapping[str, Tensor | None], check: Callable[[Any], Any],
             single: bool) -> Outputs:
    """The full check of ``ts`` as :data:`Outputs` (``single``: ``check`` gives ``out``'s)."""
    got = checked(name, ts, check)
    return {"out": got} if single else got


def _general_op(name: str, args: dict[str, Any], check: Callable[[Any], Any], single: bool,
                body: Body, result: Callable[[dict[str, Any]], Any],
                dflt: Mapping[str, str]) -> KernelOp:
    """Partition or DeviceOp arguments: checked once their values are known."""
    keys = tuple(args)
    vals = tuple(args.values())

    def tensors(vs: tuple[Any, ...]) -> dict[str, Tensor | None]:
        ts = {k: None if v is None else as_tensor(v, name, k) for k, v in zip(keys, vs, strict=True)}
        for k, src in dflt.items():
            if ts[k] is None:
                ts[k] = ts[src]
        return ts

    early = None if any(is_deferred(v) for v in vals) else _outputs(name, tensors(vals), check,
                                                                    single)

    def run(ctx: ExecutionContext, *vs: Any) -> Any:
        ts = tensors(vs)
        outs = early if early is not None else _outputs(name, ts, check, single)
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


def noop(*_: Any) -> None:
    """A launch function that does nothing (the other backend's half of a launch)."""
