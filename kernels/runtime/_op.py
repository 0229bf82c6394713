"""Kernel launch ops: how a kernel function becomes a DeviceOp.

A kernel launcher (``saxpy``, ``add``, ``gemm``, ...) accepts, for each tensor
argument, a :class:`~deviceops.Tensor`, a :class:`~deviceops.Partition`, or a
DeviceOp producing either; scalars are plain Python numbers. It returns a
:class:`KernelOp` whose execution

1. executes the DeviceOp arguments first, in order, on the same stream
   (iteratively: arguments nested 100,000 deep do not recurse);
2. validates shapes/dtypes/devices (already done at construction for
   arguments that were given as tensors), raising before any launch;
3. allocates outputs that were not given (refused inside graph capture);
4. launches through :func:`deviceops._launch.launch` (hazards, trace);
5. returns the written outputs *in the form they were given*: a Partition
   stays a Partition, a Tensor a Tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deviceops.extend import (
    DeviceOp,
    ExecutionContext,
    Partition,
    ShapeError,
    Tensor,
    host_data_hint,
)
from deviceops.extend import drive as _drive

__all__ = ["KernelOp", "TensorArg", "as_tensor", "is_deferred", "resolve"]

TensorArg = Tensor | Partition | DeviceOp[Any]


def is_deferred(arg: Any) -> bool:
    """True if ``arg`` is a DeviceOp (its value is only known at execution)."""
    return isinstance(arg, DeviceOp)


def as_tensor(arg: Tensor | Partition, op: str, name: str) -> Tensor:
    """The tensor behind a Tensor or Partition argument (``TypeError`` otherwise)."""
    if isinstance(arg, Tensor):
        return arg
    if isinstance(arg, Partition):
        return arg.tensor
    if arg is None:
        raise TypeError(f"{op}: argument {name!r} is required: pass a Tensor, Partition or "
                        "DeviceOp producing one, got None")
    raise TypeError(f"{op}: argument {name!r} must be a Tensor, Partition or DeviceOp "
                    f"producing one, got {type(arg).__name__}{host_data_hint(arg, op)}")


def resolve(arg: Any, ctx: ExecutionContext) -> Any:
    """Execute ``arg`` on ``ctx`` if it is a DeviceOp; return the value."""
    if isinstance(arg, DeviceOp):
        return arg._exec(ctx)
    return arg


def contiguous(t: Tensor, op: str, name: str) -> None:
    """Refuse a non-contiguous tensor, naming the fix."""
    if not t.is_contiguous:
        raise ShapeError(
            f"{op}: {name} of shape {t.shape} with strides {t.array.strides} is not "
            "C-contiguous; make a contiguous copy first (api.dup)",
            op=op,
        )


class KernelOp(DeviceOp[Any]):
    """A kernel launch: executes DeviceOp arguments, then ``run(ctx, *values)``.

    Args:
        name: the kernel's name (errors, traces, ``to_dot``).
        run: validates (if needed), allocates, launches; returns the output.
        args: the launcher's arguments as given (DeviceOps are executed first).
    """

    __slots__ = ("_args", "_dpos", "_name", "_run", "_tin")
    _iterative = True

    def __init__(self, name: str, run: Callable[..., Any], args: tuple[Any, ...]) -> None:
        super().__init__()
        self._name = name
        self._run = run
        self._set_args(args)

    def _set_args(self, args: tuple[Any, ...]) -> None:
        dpos = tuple(i for i, a in enumerate(args) if isinstance(a, DeviceOp))
        if dpos:
            ops = [args[i] for i in dpos]
            if len({id(o) for o in ops if not o._multi_use}) < sum(1 for o in ops if not o._multi_use):
                self._consume()
                for o in ops:
                    o._consume()
                raise ValueError(f"{self._name}: the same DeviceOp is passed as two arguments; "
                                 "a DeviceOp runs once: use op.shared() to pass its output twice")
            try:
                args = tuple(a._adopt(self._name) if isinstance(a, DeviceOp) else a for a in args)
            except BaseException:
                self._consume()  # refused at construction: the error is the report
                for o in ops:
                    o._consume()
                raise
        self._args = args
        self._dpos = dpos
        self._tin: tuple[Tensor, ...] | None = None  # the tensor arguments, on first ask
    def _execute(self, ctx: ExecutionContext) -> Any:
        if not self._dpos:
            return self._run(ctx, *self._args)
        return _drive(self, ctx)

    def _deps(self, ctx: ExecutionContext) -> tuple[DeviceOp[Any], ...]:
        dpos = self._dpos
        if not dpos:
            return ()
        args = self._args
        return tuple(args[i] for i in dpos)

    def _finish(self, ctx: ExecutionContext, vals: list[Any]) -> Any:
        if not vals:
            return self._run(ctx, *self._args)
        args = list(self._args)
        for i, v in zip(self._dpos, vals, strict=True):
            args[i] = v
        return self._run(ctx, *args)

    def _children(self) -> tuple[DeviceOp[Any], ...]:
        return tuple(a for a in self._args if isinstance(a, DeviceOp))

    def _inputs(self) -> tuple[Tensor, ...]:
        tin = getattr(self, "_tin", None)  # (subclasses made without _set_args have none)
        if tin is None:
            tin = self._tin = tuple(a.tensor if isinstance(a, Partition) else a for a in self._args
                                    if isinstance(a, Tensor | Partition))
        return tin

    def _describe(self) -> str:
        return self._name
