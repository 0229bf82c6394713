"""Streams and events: the backend-neutral interface, plus ordering bookkeeping.

A :class:`Stream` is an in-order queue of device work; an :class:`Event` marks a
point in one. Each backend subclasses both (``_cpu_stream``, ``_cuda_backend``);
this module holds the part they share, which is how deviceops decides when one
stream has to wait for another:

* every stream counts the operations enqueued on it (``seq``);
* a tensor remembers ``(stream, seq)`` of the work that last wrote it and of
  the reads since (``_tensor._Storage``);
* before stream B touches it, ``B.wait_for(A, seq)`` makes B wait on an event
  of A covering ``seq`` — recorded lazily, only when a cross-stream hazard
  exists, and reused while nothing new was enqueued on A; B also remembers how
  far it has already waited on A, so a second hazard costs nothing, and A
  remembers how far the host saw it finish (``done_seq``: synchronize and
  completed events), so finished work needs no event at all.

A lazily recorded event covers everything enqueued on A so far, which may be
more than the access it orders: correct, only possibly less overlap.

Same-stream work costs no events at all: stream order is enough.
"""

from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._backend import Backend
    from ._capture import CaptureState
    from ._device import Device

__all__ = ["Event", "Stream"]

_ids = iter(range(1, 1 << 62))
_ids_lock = threading.Lock()


def _next_id() -> int:
    with _ids_lock:
        return next(_ids)


class Event(ABC):
    """A point in a stream's queue; complete once the stream has passed it.

    Attributes:
        stream: the stream it was recorded on.
        seq: that stream's operation count when it was recorded: every op with
            a sequence number ``<= seq`` is before the event.
        capture: the graph capture it was recorded in, if any.
    """

    __slots__ = ("__weakref__", "capture", "seq", "stream")
    # cpu backend: the stream's failure when the event fired (see _cpu_stream); an
    # event carrying one is not reused for later work (it would report it again)
    error: BaseException | None = None

    def __init__(self, stream: Stream, seq: int, capture: CaptureState | None) -> None:
        self.stream = stream
        self.seq = seq
        self.capture = capture

    @abstractmethod
    def query(self) -> bool:
        """True when the device has passed this point (never blocks)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the calling thread until the event is complete.

        Raises:
            DeviceError: the device reported a failure in the work before it.
        """

    @abstractmethod
    def when_complete(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` from some thread once the event is complete.

        ``fn`` must not block and must not call into deviceops or CUDA.
        """

    def hand_over_error(self) -> None:
        """Make a wait on this event take its stream's pending failure over (a zip join).

        The waiting stream then reports the failure and this event's stream no
        longer does. Default: nothing (cuda: a device fault is sticky and reported
        by every later synchronization anyway).
        """
        return None


class Stream(ABC):
    """An in-order queue of device work on one device.

    Obtain one from :meth:`Device.new_stream`. Work enqueued on a stream runs in
    order; work on different streams may overlap unless ordered by events.

    Attributes:
        device: the device it runs on.
        backend: ``device.backend``, cached here (read on every op's path).
        native: the backend's own stream object (cuda: a :class:`cupy.cuda.Stream`);
            ``None`` for a backend without one (cpu).
        id: a process-unique number.
        seq: how many operations were enqueued on it so far.
        capture: the graph capture it belongs to, if any.
        priority: CUDA's convention (``0`` least urgent, lower more urgent); see
            :meth:`Device.new_stream <deviceops.Device.new_stream>`.
        yields: its long kernels give their SMs back between tiles (see
            :meth:`Device.new_stream <deviceops.Device.new_stream>`).
        enter_device: ``None``, or (cuda) a function making the stream's device current
            on the calling thread and returning the device to give back to
            :attr:`exit_device` (-1: nothing to give back). Every op's driver calls run
            between the two (:func:`deviceops._storage.ordered`), so no op depends on, or
            leaks, the thread's current device.
    """

    native: Any = None
    priority: int = 0
    yields: bool = False
    enter_device: Callable[[], int] | None = None
    exit_device: Callable[[int], None] | None = None

    def __init__(self, device: Device) -> None:
        self.device = device
        self.backend: Backend = device.backend
        self.id = _next_id()
        self.seq = 0
        self.done_seq = 0
        self._waited: dict[int, int] = {}
        # Weak: an event refers to its stream, so a strong reference back would
        # make every stream part of a garbage cycle, freed only by the cyclic
        # collector, which finalizes (destroys) the native stream even while a
        # parked tensor resurrects the Python object.
        self._last_event_ref: weakref.ref[Event] | None = None
        self.capture: CaptureState | None = None
        # (shape, id(dtype)) -> small arrays this stream allocated and nobody references
        # any more, handed to the next allocation of that shape here (deviceops._tensor)
        self.spare: dict[tuple[tuple[int, ...], int], list[Any]] = {}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} #{self.id} on {self.device}>"

    # -- the backend interface ------------------------------------------------
    @abstractmethod
    def enqueue(self, fn: Callable[[], None], name: str) -> None:
        """Enqueue ``fn()`` as work of this stream; ``name`` names it in errors.

        cpu: run by the stream's worker when the queue reaches it (recorded into
        the capture instead while capturing). cuda: run now, with this stream
        current, so that the CUDA work ``fn`` enqueues lands on it.
        """

    @abstractmethod
    def _record(self) -> Event:
        """Record a fresh event at the current end of the queue."""

    @abstractmethod
    def _wait(self, event: Event) -> None:
        """Make later work on this stream wait until ``event`` is complete."""

    @abstractmethod
    def _synchronize(self) -> None:
        """Backend part of :meth:`synchronize`."""

    def synchronize(self) -> None:
        """Block until all work enqueued so far has finished.

        Raises:
            DeviceError: the device reported a failure in that work.
        """
        seq = self.seq
        self._synchronize()
        if self.capture is None and seq > self.done_seq:
            self.done_seq = seq

    @abstractmethod
    def query(self) -> bool:
        """True when all work enqueued so far has finished (never blocks)."""

    @abstractmethod
    def launch_host_func(self, fn: Callable[[], None]) -> None:
        """Enqueue ``fn()`` to run on a host thread when the stream reaches it.

        ``fn`` must not call CUDA or block: it runs on the driver's callback
        thread (cuda) or the stream's worker (cpu), holding the stream up.
        """

    # -- failure bookkeeping (meaningful on the cpu backend; defaults: nothing) --
    def absorb_after(self, seq: int) -> None:
        """Drop a pending failure of the work of ops numbered after ``seq``.

        Called when enqueueing an op raised on the host: the failure of its part
        already enqueued is its own, not a later op's. Default: nothing (cuda:
        device faults are sticky).
        """
        return None

    def latch_error(self) -> list[BaseException | None] | None:
        """A box that, once the queue reaches this point, holds the stream's failure then.

        ``None`` (the default) when the backend has no per-stream failures to latch.
        """
        return None

    def check_latch(self, box: list[BaseException | None], what: str) -> None:
        """Fail this stream, at this point of its queue, with the failure ``box`` latched.

        Default: nothing (:meth:`latch_error` gave no box).
        """
        return None

    # -- shared bookkeeping ---------------------------------------------------
    def bump(self) -> int:
        """Count one more operation enqueued on this stream; return its number."""
        self.seq += 1
        return self.seq

    @property
    def _last_event(self) -> Event | None:
        """The most recently recorded event, if anyone still holds it."""
        ref = self._last_event_ref
        return ref() if ref is not None else None

    def record_event(self) -> Event:
        """An event at the current end of the queue (reused if nothing new was enqueued)."""
        ref = self._last_event_ref
        ev = ref() if ref is not None else None
        if ev is not None and ev.seq == self.seq and ev.capture is self.capture and ev.error is None:
            return ev
        ev = self._record()
        self._last_event_ref = weakref.ref(ev)
        return ev

    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait for ``event``.

        Waiting on an event of a stream being captured into a CUDA graph joins
        this stream to that capture, as CUDA does.
        """
        if event.stream is self:
            return
        if event.capture is not None and self.capture is None:
            event.capture.join(self)
        self._wait(event)
        other = event.stream.id
        if self._waited.get(other, 0) < event.seq:
            self._waited[other] = event.seq

    def wait_for(self, other: Stream, seq: int) -> None:
        """Order later work on this stream after op ``seq`` of ``other``.

        Costs nothing when ``other`` is this stream or this stream already
        waited that far; otherwise records (or reuses) one event on ``other``.
        """
        if other is self or other.done_seq >= seq or self._waited.get(other.id, 0) >= seq:
            return
        if self.capture is not other.capture:
            # A hazard across a capture boundary: work from before a capture is
            # complete when it begins (capture starts with a device-wide
            # synchronize), and replays are ordered by the graph launch's own
            # hazard tracking. Waiting here would wrongly join a stream to it.
            return
        self.wait_event(other.record_event())
