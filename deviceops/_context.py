"""ExecutionContext and the guard against nested execution.

A DeviceOp is executed by handing its ``_execute`` an :class:`ExecutionContext`:
the stream to enqueue on, the device, and the scheduling policy that combinators
such as ``zip`` draw further streams from.

Executing an op (``sync``, ``sync_on``, ``async_on``, ``schedule``, ``await``,
``graph``) while another op is being enqueued on the same thread — from inside a
``then``/``map``/``inspect`` closure, or a graph capture — is refused: blocking
there would deadlock or break a capture, and a second enqueue would interleave
with the first. The closure should *return* the op (``then``) instead.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from . import _hooks
from ._errors import NestedExecutionError

if TYPE_CHECKING:
    from ._device import Device
    from ._stream import Stream
    from .scheduling import SchedulingPolicy

__all__ = ["ExecutionContext"]


class ExecutionContext:
    """Where a DeviceOp is being enqueued.

    Attributes:
        stream: the stream to enqueue work on.
        policy: the scheduling policy further streams are drawn from.
    """

    __slots__ = ("_policy", "stream")

    def __init__(self, stream: Stream, policy: SchedulingPolicy | None = None) -> None:
        self.stream = stream
        self._policy = policy

    @property
    def policy(self) -> SchedulingPolicy:
        """The policy further streams (zip branches) are drawn from.

        Resolved on first use when the caller gave none (``async_on``/``sync_on``):
        the current policy at that moment, which is the enqueueing moment.
        """
        p = self._policy
        if p is None:
            p = self._policy = _hooks.current_policy()
        return p

    @property
    def device(self) -> Device:
        """The device of :attr:`stream`."""
        return self.stream.device

    def on(self, stream: Stream) -> ExecutionContext:
        """The same context, enqueuing on ``stream``."""
        return ExecutionContext(stream, self._policy)

    def __repr__(self) -> str:
        return f"ExecutionContext(stream={self.stream!r}, policy={self.policy!r})"


class _Guard(threading.local):
    # what is being enqueued on this thread: a description, or the op itself
    # (described only if an error needs it: this is on every op's path)
    active: Any = None


guard = _Guard()
# One enqueue at a time, process-wide: stream/tensor bookkeeping is not
# thread-safe by itself. The lock covers enqueueing only, never device work.
enqueue_lock = threading.RLock()


def refuse_nested(what: str) -> None:
    """Raise :class:`NestedExecutionError` if an op is being enqueued on this thread."""
    active = guard.active
    if active is not None:
        if not isinstance(active, str):
            active = active._describe()
        raise NestedExecutionError(
            f"{what} was called while {active} is being enqueued (inside a then/map/inspect "
            "closure or a graph capture). Blocking or re-entering execution there would "
            "deadlock or break the capture. Instead, return the DeviceOp from a .then() "
            "closure, combine ops with deviceops.zip(), or await/sync the outer op."
        )
