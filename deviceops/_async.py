"""Awaiting DeviceOps and DeviceFutures from asyncio and trio.

``await op`` = ``await op.schedule()``: the op is enqueued on a stream of the
default policy and an event recorded after it. Completion is then noticed in
two stages, never blocking the event loop for long and never with a thread per
await:

1. **Spin** (cuda only): query the event for up to ``spin_us`` (default 20 µs).
   Tiny ops finish within it, and the await returns without a round trip
   through the loop. Skipped when other awaits are already pending (under load
   spinning only delays everyone) and on the cpu backend (its workers need the
   GIL the spin would hold).
2. **Wake-up**: register ``event.when_complete(cb)``. On cuda the shared
   completion thread (:mod:`deviceops._completion`) calls ``cb``; on cpu the
   stream's worker does. ``cb`` only hands the wake-up to the owning loop
   thread-safely — ``loop.call_soon_threadsafe`` (asyncio) or the trio token's
   ``run_sync_soon`` — and never touches CUDA or blocks.

**Fair enqueueing.** Enqueueing an op costs microseconds of host time. When
thousands of tasks await at once they would all enqueue in one pass of the
loop and starve its timers; so each loop gets a time slice (``slice_ms``,
default 0.5 ms) per 1 ms window: once enqueueing has used it up, further
awaiting tasks queue up (FIFO) and an end-of-pass reset admits a batch that
fits the next slice (sized from a running estimate of one enqueue's cost). A
burst of N awaits thus costs O(N) in total, and timers run between batches;
an await that finds no queue costs no loop callback at all.

**Completion side.** The completion thread hands wake-ups to a per-loop
queue and notifies the loop once; the loop resumes them in batches sized to
keep each pass near 1 ms (halved after a slow pass, grown after a fast one).

**Cancellation.** Cancelling an awaiting task (``task.cancel()``, anyio/trio
cancel scopes, ``anyio.fail_after``) returns at once. The work already
enqueued still runs to completion; the tensors it uses stay referenced by the
stream's bookkeeping until then, so their memory is not reused early, and the
stream stays usable.

Knobs: :func:`configure_await` or the environment variables
``DEVICEOPS_AWAIT_SPIN_US`` and ``DEVICEOPS_AWAIT_SLICE_MS``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ._context import refuse_nested

if TYPE_CHECKING:
    from ._future import DeviceFuture
    from ._op import DeviceOp

__all__ = ["configure_await"]

T = TypeVar("T")

_spin_s = float(os.environ.get("DEVICEOPS_AWAIT_SPIN_US", "20")) * 1e-6
_slice_s = float(os.environ.get("DEVICEOPS_AWAIT_SLICE_MS", "0.5")) * 1e-3


def configure_await(*, spin_us: float | None = None, slice_ms: float | None = None) -> dict[str, float]:
    """Set the await knobs; return the values now in force.

    Args:
        spin_us: how long ``await`` polls the event before parking the task
            (cuda only; 0 disables spinning).
        slice_ms: host time enqueueing may take per pass of the event loop
            before awaiting tasks yield to it.
    """
    global _spin_s, _slice_s
    if spin_us is not None:
        if spin_us < 0:
            raise ValueError(f"configure_await: spin_us must be >= 0, got {spin_us}")
        _spin_s = spin_us * 1e-6
    if slice_ms is not None:
        if slice_ms <= 0:
            raise ValueError(f"configure_await: slice_ms must be > 0, got {slice_ms}")
        _slice_s = slice_ms * 1e-3
    return {"spin_us": _spin_s * 1e6, "slice_ms": _slice_s * 1e3}


def _library() -> str:
    try:
        asyncio.get_running_loop()
        return "asyncio"
    except RuntimeError:
        pass
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_task()
            return "trio"
        except RuntimeError:
            pass
    raise RuntimeError("await on a DeviceOp needs a running asyncio or trio event loop")


class _Slice:
    """Enqueue budget of one event loop for the current pass, and the tasks queued for it."""

    __slots__ = ("batch", "cost", "last_drain", "lib", "lock", "loop", "notified", "open", "ready",
                 "used", "waiters", "window")

    def __init__(self, lib: str, loop: Any) -> None:
        self.used = 0.0
        self.window = 0.0  # start of the current accounting window (perf_counter)
        self.open = False
        self.cost = 10e-6  # running estimate of one enqueue's host time
        self.waiters: deque[Callable[[], None]] = deque()
        self.lib = lib
        self.loop = loop
        # completion side: wake-ups handed over by the completion thread
        self.ready: deque[Callable[[], None]] = deque()
        self.lock = threading.Lock()
        self.notified = False
        self.batch = 256  # wake-ups per pass, adapted to keep passes short
        self.last_drain = 0.0  # when the previous drain ran, if it rescheduled itself

    def deliver(self, wakeups: list[Any]) -> None:
        """Completion thread: hand over many :class:`_Wakeup` s at once."""
        _deliver(self, [w.wake for w in wakeups])


# id(loop) -> (weak or strong reference to the loop, its slice)
_slices: dict[int, tuple[Callable[[], Any], _Slice]] = {}


_last: tuple[Callable[[], Any], str, _Slice] | None = None  # the most recently used loop


def _current() -> tuple[str, _Slice]:
    """The running loop's library and slice (fast path: the same loop as last time)."""
    global _last
    last = _last
    loop: Any = None
    lib = ""
    if last is not None and last[1] == "trio":
        trio = sys.modules["trio"]
        try:  # noqa: SIM105 (hot path)
            loop, lib = trio.lowlevel.current_trio_token(), "trio"
        except RuntimeError:
            pass
    if loop is None:
        try:
            loop, lib = asyncio.get_running_loop(), "asyncio"
        except RuntimeError:
            lib = _library()
            import trio

            loop = trio.lowlevel.current_trio_token()
    if last is not None and last[0]() is loop:
        return lib, last[2]
    sl = _slice_for(lib, loop)
    try:
        ref: Callable[[], Any] = weakref.ref(loop)
    except TypeError:
        ref = (lambda lp: lambda: lp)(loop)
    _last = (ref, lib, sl)
    return lib, sl


def _slice_for(lib: str, loop: Any = None) -> _Slice:
    if loop is None:
        if lib == "asyncio":
            loop = asyncio.get_running_loop()
        else:
            import trio

            loop = trio.lowlevel.current_trio_token()
    entry = _slices.get(id(loop))
    if entry is None or entry[0]() is not loop:
        try:
            ref: Callable[[], Any] = weakref.ref(loop)
        except TypeError:
            ref = (lambda lp: lambda: lp)(loop)
        for key in [k for k, (r, _) in _slices.items() if r() is None]:
            del _slices[key]  # loops that are gone
        entry = _slices[id(loop)] = (ref, _Slice(lib, loop))
    return entry[1]


def _open(sl: _Slice) -> None:
    """Schedule the end-of-pass reset (once per pass)."""
    if not sl.open:
        sl.open = True
        if sl.lib == "asyncio":
            sl.loop.call_soon(_reset, sl)
        else:
            sl.loop.run_sync_soon(_reset, sl)


def _reset(sl: _Slice) -> None:
    """End of a pass: a fresh budget; admit as many queued tasks as it fits."""
    sl.used = 0.0
    sl.window = time.perf_counter()
    sl.open = False
    if sl.waiters:
        n = min(len(sl.waiters), max(1, int(_slice_s / max(sl.cost, 1e-7))))
        for _ in range(n):
            sl.waiters.popleft()()
        _open(sl)  # keep admitting next pass even if every woken task was cancelled


async def _admission(sl: _Slice) -> None:
    """Wait in FIFO order until this loop's enqueue budget admits the task.

    Each pass admits a bounded batch, so a burst of N awaits costs O(N) in
    total rather than every queued task re-checking on every pass.
    """
    if sl.lib == "asyncio":
        fut: asyncio.Future[None] = sl.loop.create_future()

        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        sl.waiters.append(wake)
        _open(sl)
        await fut
    else:
        import trio

        ev = trio.Event()
        sl.waiters.append(ev.set)
        _open(sl)
        await ev.wait()


async def await_op(op: DeviceOp[T]) -> T:
    """``await op``: schedule it on the default policy and await the future."""
    try:
        refuse_nested(f"await on {op._describe()}")
        lib, sl = _current()
    except BaseException:
        op._consume()  # the error is the report; no "never executed" warning on top
        raise
    t0 = time.perf_counter()
    if t0 - sl.window > _WINDOW_S:  # a new window: fresh budget (no per-await loop callback)
        sl.window = t0
        sl.used = 0.0
    if sl.waiters or sl.used >= _slice_s:
        try:
            await _admission(sl)
        except BaseException:
            op._consume()  # cancelled before it was enqueued: nothing ran, nothing to warn about
            raise
        t0 = time.perf_counter()
    fut = op.schedule()
    dt = time.perf_counter() - t0
    sl.cost += 0.1 * (dt - sl.cost)
    sl.used += dt
    return await _await_future(fut, lib)


async def await_future(fut: DeviceFuture[T]) -> T:
    """``await future``."""
    return await _await_future(fut, _library())


def _poller() -> Any:
    from ._completion import poller

    return poller()


async def _await_future(fut: DeviceFuture[T], lib: str) -> T:
    ev = fut._event
    if fut._exc is not None or ev is None:
        return fut.result()
    if not ev.query():
        if _spin_s > 0 and not ev.stream.device.is_cpu and _poller().pending() == 0:
            deadline = time.perf_counter() + _spin_s
            while time.perf_counter() < deadline:
                if ev.query():
                    break
        if not ev.query():
            sl = _current()[1]
            if lib == "asyncio":
                await _park_asyncio(ev, sl)
            else:
                await _park_trio(ev, sl)
    return fut.result()


class _Wakeup:
    """A completion callback that the completion thread can hand over in bulk.

    Calling it delivers one wake-up; the poller instead groups callbacks by
    ``group`` (the loop's slice) and calls ``group.deliver([...])`` once.
    """

    __slots__ = ("group", "wake")

    def __init__(self, sl: _Slice, wake: Callable[[], None]) -> None:
        self.group = sl
        self.wake = wake

    def __call__(self) -> None:
        _deliver(self.group, (self.wake,))


def _deliver(sl: _Slice, wakes: Any) -> None:
    """Completion thread: queue ``wakes`` for the loop; notify it once per drain."""
    with sl.lock:
        sl.ready.extend(wakes)
        if sl.notified:
            return
        sl.notified = True
    try:
        if sl.lib == "asyncio":
            sl.loop.call_soon_threadsafe(_drain, sl, False)
        else:
            sl.loop.run_sync_soon(_drain, sl, False)
    except RuntimeError:
        pass  # the loop is closed (trio.RunFinishedError is a RuntimeError): nobody waits


def _drain(sl: _Slice, continued: bool) -> None:
    """Loop thread: resume a bounded batch of completed awaits, then yield to the loop.

    When thousands of ops complete together, resuming every awaiting task in
    one pass would stall timers for as long as their code takes; instead each
    pass resumes ``batch`` of them, halving it when the previous pass took
    longer than ``_PASS_S`` and growing it otherwise.
    """
    now = time.perf_counter()
    if continued:
        if now - sl.last_drain > _PASS_S:
            sl.batch = max(8, sl.batch // 2)
        else:
            sl.batch = min(8192, sl.batch + sl.batch // 4 + 1)
    ready = sl.ready
    for _ in range(min(sl.batch, len(ready))):
        ready.popleft()()
    with sl.lock:
        if not ready:
            sl.notified = False
            return
    sl.last_drain = time.perf_counter()
    if sl.lib == "asyncio":
        sl.loop.call_soon(_drain, sl, True)
    else:
        sl.loop.run_sync_soon(_drain, sl, True)


_PASS_S = 1e-3
_WINDOW_S = 1e-3  # enqueue budget window when no task is queued for admission


async def _park_asyncio(ev: Any, sl: _Slice) -> None:
    waiter: asyncio.Future[None] = sl.loop.create_future()

    def wake() -> None:
        if not waiter.done():
            waiter.set_result(None)

    ev.when_complete(_Wakeup(sl, wake))
    await waiter


async def _park_trio(ev: Any, sl: _Slice) -> None:
    import trio

    done = trio.Event()
    ev.when_complete(_Wakeup(sl, done.set))
    await done.wait()
