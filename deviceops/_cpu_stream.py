"""The ``cpu`` backend's streams and events: one worker thread per stream.

Each :class:`CpuStream` owns a daemon thread that runs the stream's queue in
order, so work on two streams really runs concurrently and needs events to be
ordered, as on a GPU. Semantics follow CUDA's:

* ``record_event`` enqueues a marker; the event completes when the worker
  reaches it. ``wait_event`` enqueues a task that blocks the worker until the
  event completes (other streams keep running).
* ``launch_host_func`` runs the callable on the worker, in queue order.
* a task that raises does not stop the queue; the first error is kept
  (*sticky*) and raised, as a :class:`~deviceops.LaunchError` chained to the
  original exception, by the next ``synchronize()`` of the stream or of any
  event recorded after it. ``synchronize()`` clears it.
* an error travels along event waits: a stream that waits on an event recorded
  after a failure takes that error too (so a failing ``zip`` branch reaches the
  join), as a CUDA error reaches every later synchronization. A stream
  synchronize reports an error once: other streams holding the same error (the
  branch, after the join reported it) drop it instead of raising it later on
  unrelated work; a zip join takes its branches' errors over. Event (future)
  synchronizes always raise their error.
* the tensors a failed task writes remember the failure; a task reading them
  fails with an error naming the failed producer (``deviceops._launch``).
* ``synchronize()`` from the stream's own worker (inside a host task on it)
  raises :class:`~deviceops.NestedExecutionError` instead of deadlocking.
* while a stream is being captured into a graph, tasks are recorded into the
  capture instead of running (see ``deviceops.graphs``).
* stream priorities (CUDA's convention, ``(0, -5)``): before each task a worker
  holds back while a more urgent stream of its device has a task ready to run
  (not blocked in an event wait), as CUDA's block scheduler starts the more
  urgent stream's blocks first; a running task is never interrupted. With no
  stream more urgent than the default on a device this costs one attribute read.

The backend object, memory and copies are in :mod:`deviceops._cpu_backend`.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ._errors import LaunchError, NestedExecutionError
from ._stream import Event, Stream

if TYPE_CHECKING:
    from ._capture import CaptureState
    from ._device import Device
    from ._tensor import Storage

__all__ = ["CpuEvent", "CpuStream", "guarded", "poisoned_input", "synchronize_all"]

_STOP = object()


def _mark_reported(err: BaseException) -> None:
    """An error is reported once by a stream synchronize: a stream that only received it
    through an event wait (e.g. a zip branch's error, reported at the join) drops it."""
    with contextlib.suppress(AttributeError):
        err._deviceops_reported = True  # type: ignore[attr-defined]


class _Forward(Exception):
    """Raised by a task to make its stream take ``error`` as is (an error from another stream)."""

    def __init__(self, error: BaseException, seq: int) -> None:
        super().__init__(str(error))
        self.error = error
        self.seq = seq  # the op number (on the receiving stream) it is charged to


class CpuEvent(Event):
    """An event of a :class:`CpuStream`."""

    __slots__ = ("_callbacks", "_done", "_lock", "_tail", "error", "take")

    def __init__(self, stream: Stream, seq: int, capture: CaptureState | None) -> None:
        super().__init__(stream, seq, capture)
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self.error: BaseException | None = None
        self._tail = -1  # the worker's submitted count once this event was put
        self.take = False  # a wait on it takes the error over (a zip join), see _wait

    def _fire(self, error: BaseException | None) -> None:
        self.error = error
        with self._lock:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()
        if self.capture is None and self.stream.done_seq < self.seq:
            self.stream.done_seq = self.seq
        err = self.error
        if err is not None:
            # The stream's error is reported once, as CUDA reports a non-sticky error to
            # the next synchronizing call: the stream is usable again afterwards. The
            # event raises it at every synchronize (as a future's result() does).
            worker = getattr(self.stream, "_worker", None)
            if worker is not None:
                with worker.cond:
                    if worker.error is err:
                        worker.error = None
            _mark_reported(err)
            raise err

    def when_complete(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def hand_over_error(self) -> None:
        self.take = True


#: ``(least, greatest)`` stream priority of a cpu device (CUDA's range on recent GPUs)
PRIORITIES = (0, -5)


class _Gate:
    """The stream priorities of one cpu device: which urgent workers have a task ready.

    Only workers more urgent than the least priority are counted (nothing is held back
    for a least-urgent one), so a device without such streams never takes the lock.
    """

    __slots__ = ("cond", "ready", "total")

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.ready: dict[int, int] = {}  # priority -> counted workers with a task ready
        self.total = 0

    def holds(self, priority: int) -> bool:
        """Whether a worker of ``priority`` must hold its next task back (under ``cond``)."""
        return any(n and p < priority for p, n in self.ready.items())

    def change(self, priority: int, d: int) -> None:
        with self.cond:
            self.ready[priority] = self.ready.get(priority, 0) + d
            self.total += d
            if d < 0:
                self.cond.notify_all()

    def wait_turn(self, priority: int) -> None:
        """Block while a more urgent worker of the device has a task ready."""
        if self.total:
            with self.cond:
                while self.holds(priority):
                    self.cond.wait()


_running = threading.local()  # .worker: the _Worker whose thread this is
_gates: dict[str, _Gate] = {}
_gates_lock = threading.Lock()


def _gate(device: str) -> _Gate:
    g = _gates.get(device)
    if g is None:
        with _gates_lock:
            g = _gates.setdefault(device, _Gate())
    return g


class _Worker:
    """The state a stream's thread needs; holds no reference to the stream."""

    def __init__(self, name: str, device: str, priority: int = 0) -> None:
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.cond = threading.Condition()
        self.submitted = 0
        self.completed = 0
        self.error: BaseException | None = None
        self.error_seq = 0  # the op number (seq) of the failed work, see absorb_after
        self.stopped = False
        self.device = device
        self.priority = priority
        self.gate = _gate(device)
        self.counted = priority < PRIORITIES[0]  # counted in the gate (more urgent than least)
        self.ready = False  # (counted) has a task ready: counted in the gate now
        self.waiting = False  # (counted) blocked in an event wait
        self.thread = threading.Thread(target=self.run, name=name, daemon=True)
        self.thread.start()
        _all_workers.add(self)

    def _recount(self) -> None:
        """(under ``cond``, counted workers) update this worker's count in the gate."""
        ready = self.completed < self.submitted and not self.waiting
        if ready != self.ready:
            self.ready = ready
            self.gate.change(self.priority, 1 if ready else -1)

    def set_waiting(self, waiting: bool) -> None:
        """An event wait begins or ends on this worker (a blocked worker holds nobody back)."""
        if self.counted:
            with self.cond:
                self.waiting = waiting
                self._recount()

    def run(self) -> None:
        _running.worker = self
        q = self.queue
        gate = self.gate
        priority = self.priority
        while True:
            item = q.get()
            if gate.total:
                gate.wait_turn(priority)
            if item is _STOP:
                with self.cond:
                    self.stopped = True
                while True:  # drain anything put before ``stopped`` was seen
                    try:
                        item = q.get_nowait()
                    except queue.Empty:
                        return
                    if item is not _STOP:
                        self.execute(*item)
            self.execute(*item)

    def execute(self, fn: Callable[[], None], name: str) -> None:
        self.run_one(fn, name)
        with self.cond:
            self.completed += 1
            if self.counted:
                self._recount()
            self.cond.notify_all()

    def run_many(self, tasks: Sequence[tuple[Callable[[], None], str]]) -> None:
        """Run ``tasks`` in order as one queue item (a graph replay), each as :meth:`execute`
        runs one: a failing task keeps its error and the rest still run."""
        for fn, name in tasks:
            self.run_one(fn, name)

    def run_one(self, fn: Callable[[], None], name: str) -> None:
        """Run one task; keep the first error (sticky) as :meth:`execute` documents."""
        try:
            fn()
        except _Forward as fwd:
            if self.error is None:
                self.error = fwd.error
                self.error_seq = fwd.seq
        except BaseException as exc:
            if self.error is None:
                err = LaunchError(
                    f"{name} failed on {self.device}: {type(exc).__name__}: {exc}",
                    op=name,
                    device=self.device,
                )
                err.__cause__ = exc
                self.error = err
                self.error_seq = getattr(exc, "_deviceops_seq", 0)

    def put(self, fn: Callable[[], None], name: str) -> None:
        with self.cond:
            self.submitted += 1
            stopped = self.stopped
            if not stopped:
                self.queue.put((fn, name))  # under the lock: the worker sees it before stopping
            if self.counted:
                self._recount()
        if stopped:
            # The stream object is gone (its finalizer stopped the thread) but a
            # finalizer running in the same garbage cycle still enqueued work,
            # e.g. an event record: run it here so nothing waits forever.
            self.execute(fn, name)


class CpuStream(Stream):
    """A stream of the ``cpu`` backend: an in-order queue run by its own thread."""

    def __init__(self, device: Device, priority: int = 0) -> None:
        super().__init__(device)
        self.priority = priority
        self._worker = _Worker(f"deviceops-cpu-stream-{self.id}", str(device), priority)
        weakref.finalize(self, self._worker.queue.put, _STOP)

    def enqueue(self, fn: Callable[[], None], name: str) -> None:
        """Run ``fn()`` on the worker when the queue reaches it (or record it in a capture)."""
        if self.capture is not None:
            self.capture.record_task(self, fn, name)
        else:
            self._worker.put(fn, name)

    def _record(self) -> Event:
        ev = CpuEvent(self, self.seq, self.capture)
        if self.capture is None:
            worker = self._worker
            self._worker.put(lambda: ev._fire(worker.error), "record_event")
            ev._tail = worker.submitted
        return ev

    def record_event(self) -> Event:
        """An event at the current end of the queue.

        Reused only if nothing at all was put on the queue since: not even an event
        wait or a failure check, which count no op (``seq``) but can carry an error.
        """
        ev = self._last_event
        if (isinstance(ev, CpuEvent) and ev.seq == self.seq and ev.capture is self.capture
                and ev.error is None and (self.capture is not None
                                          or ev._tail == self._worker.submitted)):
            return ev
        ev = self._record()
        self._last_event_ref = weakref.ref(ev)
        return ev

    def _wait(self, event: Event) -> None:
        if self.capture is not None and event.capture is self.capture:
            return  # in-graph dependency: capture replays tasks in enqueue order
        assert isinstance(event, CpuEvent)
        done = event._done
        seq = self.seq + 1  # charged to the op being enqueued

        take = event.take
        src_stream = event.stream
        assert isinstance(src_stream, CpuStream)
        src = src_stream._worker

        def wait() -> None:
            if not done.is_set():
                me = getattr(_running, "worker", None)  # the worker running it (a replay's too)
                if me is None:
                    done.wait()
                else:
                    me.set_waiting(True)
                    done.wait()
                    me.set_waiting(False)
            err = event.error
            if err is not None:
                if take:  # a zip join: the branch's failure is now the join's, not the branch's
                    with src.cond:
                        if src.error is err:
                            src.error = None
                raise _Forward(err, seq)

        self.enqueue(wait, "wait_event")

    def absorb_after(self, seq: int) -> None:
        """Drop (at this point of the queue) a pending error of an op numbered after ``seq``.

        Called when enqueueing an op failed on the host: that op already raised, so a
        device failure of the part of it already enqueued is its own, not a later op's.
        """
        if self.capture is not None:
            return
        worker = self._worker

        def absorb() -> None:
            if worker.error is not None and worker.error_seq > seq:
                worker.error = None

        self._worker.put(absorb, "absorb_error")

    def latch_error(self) -> list[BaseException | None]:
        """A box that, once the queue reaches this point, holds the stream's error then."""
        box: list[BaseException | None] = [None]
        worker = self._worker

        def latch() -> None:
            box[0] = worker.error

        self.enqueue(latch, "latch_error")
        return box

    def check_latch(self, box: list[BaseException | None], what: str) -> None:
        """Fail this stream, at this point of its queue, with the error ``box`` latched."""

        seq = self.seq + 1  # charged to the op being enqueued

        def check() -> None:
            err = box[0]
            if err is not None:  # a fresh error per consumer: each one reports it
                again = LaunchError(f"{what}: {err}", op=getattr(err, "op", None),
                                    device=getattr(err, "device", None))
                again.__cause__ = err
                raise _Forward(again, seq)

        self.enqueue(check, f"check {what}")

    def launch_host_func(self, fn: Callable[[], None]) -> None:
        self.enqueue(fn, "host_func")

    def query(self) -> bool:
        w = self._worker
        with w.cond:
            return w.completed == w.submitted

    def _synchronize(self) -> None:
        w = self._worker
        if threading.current_thread() is w.thread:
            raise NestedExecutionError(
                f"synchronize() of {self!r} was called from a host task running on that same "
                "stream; it would wait for itself forever. Do not block inside host tasks: "
                "enqueue the follow-up work after the task instead.")
        with w.cond:
            target = w.submitted
            while w.completed < target:
                w.cond.wait()
            err, w.error = w.error, None
        if err is not None and not getattr(err, "_deviceops_reported", False):
            _mark_reported(err)
            raise err


_all_workers: weakref.WeakSet[_Worker] = weakref.WeakSet()


def synchronize_all(device: str | None = None) -> None:
    """Wait until every live cpu stream's queue is drained (of ``device`` only, if given)."""
    for w in list(_all_workers):
        if device is not None and w.device != device:
            continue
        with w.cond:
            target = w.submitted
            while w.completed < target:
                w.cond.wait()


def poisoned_input(name: str, failed: tuple[str, BaseException]) -> LaunchError:
    """The error of an op ``name`` that reads memory whose producer ``failed``."""
    producer, exc = failed
    err = LaunchError(
        f"{name}: an input was produced by {producer}, which failed on the device "
        f"({type(exc).__name__}: {exc}); not computing on its garbage. Fix the failing op, "
        "or overwrite the tensor before using it again.",
        op=name,
    )
    err.__cause__ = exc
    return err


def guarded(fn: Callable[[], None], name: str, rs: Sequence[Storage],
            ws: Sequence[Storage], seq: int) -> Callable[[], None]:
    """``fn`` that refuses failed inputs and marks its outputs failed when it fails.

    Holds the storages' failure cells, not the storages (their lifetime is the
    hazard tracking's business). ``seq`` is the op number the task is charged to
    (see :meth:`CpuStream.absorb_after`).
    """
    rcells = [st.fail for st in rs]
    wcells = [st.fail for st in ws]
    vcells = [st.ver for st in ws]

    def task() -> None:
        for c in rcells:
            f = c[0]
            if f is not None:
                err = poisoned_input(name, f)
                for w in wcells:
                    w[0] = f
                err._deviceops_seq = seq  # type: ignore[attr-defined]
                raise err
        try:
            fn()
        except BaseException as exc:
            for w in wcells:
                w[0] = (name, exc)
            for v in vcells:
                v[0] += 1
            exc._deviceops_seq = seq  # type: ignore[attr-defined]  # (see CpuStream.absorb_after)
            raise
        for v in vcells:  # the memory changed (Storage.ver)
            v[0] += 1
        for w in wcells:
            if w[0] is not None:
                w[0] = None

    return task
