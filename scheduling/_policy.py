"""SchedulingPolicy and the default-policy machinery.

A policy answers one question: which stream should the next op run on?
``await op``, ``op.sync()``, ``op.schedule()`` ask the *current* policy, and
``zip`` asks the executing context's policy for its branches' streams.

The current policy is, in order: the innermost ``with deviceops.using(p):``
(a :class:`contextvars.ContextVar`, so it follows asyncio tasks and threads
correctly), else the one set by :func:`set_default_policy`, else a
:class:`StreamPoolRoundRobin` of 4 streams on the default device (created on
first use, one per device).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from deviceops import _hooks
from deviceops._device import default_device

if TYPE_CHECKING:
    from deviceops._device import Device
    from deviceops._op import DeviceOp
    from deviceops._stream import Event, Stream

__all__ = ["SchedulingPolicy", "current_policy", "set_default_policy", "using"]


class SchedulingPolicy(ABC):
    """Chooses streams for ops. Implement :meth:`next_stream`.

    Example:
        >>> class Always(SchedulingPolicy):
        ...     def __init__(self, s): self.s = s
        ...     def next_stream(self): return self.s
    """

    #: True for policies whose streams live on several devices (zip then
    #: places branches on other devices instead of keeping them home).
    spans_devices: bool = False
    #: True for policies that bound the work in flight (:class:`Tenant`): ``schedule()``
    #: then reports each op it enqueued through :meth:`enqueued`, and ``await`` asks
    #: :meth:`backlog` before enqueueing.
    counts_enqueued: bool = False
    #: True for policies whose top-level ops are replayed as CUDA graphs once the same small
    #: DAG repeats (:mod:`deviceops.graphs._auto`; tenants by default).
    auto_graph: bool = False

    @abstractmethod
    def next_stream(self) -> Stream:
        """The stream the next op (or zip branch) should run on."""

    def stream_for(self, op: DeviceOp[Any]) -> Stream:
        """The stream to run ``op`` (a top-level op or a zip branch) on.

        The default is :meth:`next_stream`; a policy that places ops by their data
        (:class:`MultiDeviceRoundRobin`) looks at ``op``'s input tensors.

        Raises:
            DeviceError: the policy refuses ``op`` (its inputs live on two devices).
        """
        return self.next_stream()

    def enqueued(self, stream: Stream, event: Event) -> None:
        """(``counts_enqueued`` policies) a top-level op was enqueued on ``stream``;
        ``event`` completes with it."""
        return None

    def backlog(self) -> Event | None:
        """``None`` when the policy takes another op now; else an event to wait for first
        (``await`` waits for it without blocking the loop; :meth:`stream_for` may block)."""
        return None

    @property
    def device(self) -> Device:
        """The device of the policy's first stream."""
        return self.next_stream().device


_override: contextvars.ContextVar[SchedulingPolicy | None] = contextvars.ContextVar(
    "deviceops_policy", default=None
)
_default: SchedulingPolicy | None = None
_per_device: dict[Device, SchedulingPolicy] = {}  # the automatic default, per default device
_lock = threading.Lock()


def current_policy() -> SchedulingPolicy:
    """The policy ``sync()``/``await``/``schedule()`` use right now."""
    p = _override.get()
    if p is not None:
        return p
    if _default is not None:
        return _default
    dev = default_device()
    p = _per_device.get(dev)
    if p is None:
        from ._policies import StreamPoolRoundRobin

        with _lock:
            p = _per_device.get(dev)
            if p is None:
                p = _per_device[dev] = StreamPoolRoundRobin(dev)
    return p


def set_default_policy(policy: SchedulingPolicy | None) -> None:
    """Make ``policy`` the process-wide default (``None``: back to round-robin)."""
    global _default
    if policy is not None and not isinstance(policy, SchedulingPolicy):
        raise TypeError(f"set_default_policy: expected a SchedulingPolicy, got {type(policy).__name__}")
    _default = policy


@contextlib.contextmanager
def using(policy: SchedulingPolicy) -> Iterator[SchedulingPolicy]:
    """Use ``policy`` as the current policy inside the block (this task/thread only).

    Example:
        >>> with deviceops.using(SingleStream(stream)):
        ...     deviceops.zip(a, b).sync()   # both branches on `stream`, in order
    """
    if not isinstance(policy, SchedulingPolicy):
        raise TypeError(f"using: expected a SchedulingPolicy, got {type(policy).__name__}")
    token = _override.set(policy)
    try:
        yield policy
    finally:
        _override.reset(token)


_hooks.install(current_policy=current_policy)  # the core asks through deviceops._hooks
