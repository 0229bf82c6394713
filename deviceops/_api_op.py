"""The DeviceOp behind ``deviceops.api``'s functions, and their tensor arguments.

An :class:`_ApiOp` runs one function of the execution context, after the op
producing its tensor argument when it has one (iteratively: see ``_drive``).
:func:`_produce` allocates a tensor and enqueues the work that fills it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ._context import ExecutionContext
from ._launch import launch
from ._op import DeviceOp, _drive
from ._tensor import Tensor, allocate, host_data_hint

if TYPE_CHECKING:
    from ._device import Device

__all__: list[str] = []


class _ApiOp(DeviceOp[Any]):
    """A DeviceOp whose work is one function of the execution context.

    With ``dep`` (a DeviceOp producing the tensor argument), ``fn(ctx, value)``
    runs after ``dep`` executed on the same stream (iteratively: see ``_drive``).
    """

    __slots__ = ("_dep", "_fn", "_name", "_on", "_src", "_tensors")
    _iterative = True

    def __init__(self, name: str, fn: Callable[..., Any], dep: DeviceOp[Any] | None = None, *,
                 tensors: tuple[Tensor, ...] = (), on: Device | None = None,
                 source: Device | None = None) -> None:
        super().__init__()
        self._name = name
        self._fn = fn
        self._dep = dep
        self._tensors = tensors  # the tensors it was given (placement)
        self._on = on  # the device it runs on whatever its inputs (to_device)
        self._src = source  # a copy out of a tensor: that tensor's device (to_host, memcpy)

    def _source(self) -> Device | None:
        return self._src

    def _inputs(self) -> tuple[Tensor, ...]:
        return self._tensors

    def _pin(self) -> tuple[Device | None, bool]:
        return (self._on, self._on is not None)

    def _execute(self, ctx: ExecutionContext) -> Any:
        if self._dep is None:
            return self._fn(ctx)
        return _drive(self, ctx)

    def _deps(self, ctx: ExecutionContext) -> tuple[DeviceOp[Any], ...]:
        return () if self._dep is None else (self._dep,)

    def _finish(self, ctx: ExecutionContext, vals: list[Any]) -> Any:
        if self._dep is None:
            return self._fn(ctx)
        return self._fn(ctx, vals[0])

    def _children(self) -> tuple[DeviceOp[Any], ...]:
        return () if self._dep is None else (self._dep,)

    def _describe(self) -> str:
        return self._name


def _on(native: Any, fn: Callable[[], None]) -> None:
    with native:
        fn()


def _produce(ctx: ExecutionContext, name: str, shape: tuple[int, ...], dt: np.dtype[Any],
             make: Callable[[Any, Any], None], reads: Sequence[Tensor] = ()) -> Tensor:
    """Allocate a tensor and enqueue ``make(xp, out_array)`` to fill it."""
    t = allocate(ctx.stream, shape, dt, name)
    a = t.array
    xp = ctx.device.xp
    launch(ctx, name, reads, (t,), lambda: make(xp, a), lambda s: _on(s, lambda: make(xp, a)))
    return t


def _tensor_arg(x: Any, op: str, name: str = "t") -> Tensor:
    if isinstance(x, Tensor):
        return x
    raise TypeError(f"{op}: argument {name!r} must be a Tensor, got {type(x).__name__}"
                    + ("; pass the tensor (execute the op producing it first)"
                       if isinstance(x, DeviceOp) else host_data_hint(x, op)))


def _tensor_or_op(x: Any, op: str, name: str = "t") -> Tensor | DeviceOp[Tensor]:
    """A Tensor, or a DeviceOp producing one (adopted: it runs first, on the same stream)."""
    if isinstance(x, Tensor):
        return x
    if isinstance(x, DeviceOp):
        return x._adopt(op)
    raise TypeError(f"{op}: argument {name!r} must be a Tensor or a DeviceOp producing one, "
                    f"got {type(x).__name__}{host_data_hint(x, op)}")


def _with_arg(op: str, arg: Tensor | DeviceOp[Tensor], run: Callable[[ExecutionContext, Tensor], Any]
              ) -> DeviceOp[Any]:
    """An op running ``run(ctx, tensor)``; a DeviceOp ``arg`` executes first (iteratively)."""
    if isinstance(arg, Tensor):
        return _ApiOp(op, lambda ctx: run(ctx, arg), tensors=(arg,))

    def after(ctx: ExecutionContext, t: Any) -> Any:
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: the DeviceOp argument produced {type(t).__name__}, not a Tensor")
        return run(ctx, t)

    return _ApiOp(op, after, arg)
