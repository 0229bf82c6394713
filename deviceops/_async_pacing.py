"""Pacing of ``await op`` per event loop: the knobs, fair enqueueing, wake-ups, back-pressure.

Each event loop has a :class:`_Slice`: its enqueue budget for the current pass and
the tasks queued for admission (fair enqueueing), the wake-ups the completion
thread hands over and the loop resumes in bounded batches (completion side), and
its awaits in flight per stream (back-pressure). See :mod:`deviceops._async` for
the scheme; :func:`configure_await` sets the knobs.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from . import _env

__all__ = ["configure_await"]


_spin_s = float(_env.get("DEVICEOPS_AWAIT_SPIN_US")) * 1e-6
_slice_s = float(_env.get("DEVICEOPS_AWAIT_SLICE_MS")) * 1e-3
_max_in_flight = int(_env.get("DEVICEOPS_AWAIT_MAX_IN_FLIGHT"))


def configure_await(
    *, spin_us: float | None = None, slice_ms: float | None = None, max_in_flight: int | None = None
) -> dict[str, float]:
    """Set the await knobs; return the values now in force.

    Args:
        spin_us: how long ``await`` polls the event before parking the task
            (cuda only; 0 disables spinning).
        slice_ms: host time per pass of the event loop that enqueueing
            awaited ops may take before further awaiting tasks queue up, and
            that resuming completed awaits may take before the rest wait
            for the next pass.
        max_in_flight: awaited ops one loop may have in flight on one stream
            before further awaits wait for it to drain to half (>= 2).

    Example:
        >>> knobs = deviceops.configure_await(spin_us=0)  # never spin, park at once
    """
    global _spin_s, _slice_s, _max_in_flight
    if spin_us is not None:
        if spin_us < 0:
            raise ValueError(f"configure_await: spin_us must be >= 0, got {spin_us}")
        _spin_s = spin_us * 1e-6
    if slice_ms is not None:
        if slice_ms <= 0:
            raise ValueError(f"configure_await: slice_ms must be > 0, got {slice_ms}")
        _slice_s = slice_ms * 1e-3
    if max_in_flight is not None:
        if max_in_flight < 2:
            raise ValueError(f"configure_await: max_in_flight must be >= 2, got {max_in_flight}")
        _max_in_flight = int(max_in_flight)
    return {"spin_us": _spin_s * 1e6, "slice_ms": _slice_s * 1e3, "max_in_flight": float(_max_in_flight)}


class _Slice:
    """Enqueue budget of one event loop for the current pass, and the tasks queued for it."""

    __slots__ = ("_loop_ref", "cold", "cost", "depth", "last_drain", "last_n", "lib", "lock",
                 "notified", "open", "pressured", "ready", "retry", "used", "waiters", "wake_cost",
                 "window")

    def __init__(self, lib: str, loop: Any) -> None:
        self.used = 0.0
        self.window = 0.0  # start of the current accounting window (perf_counter)
        self.open = False
        self.cost = 10e-6  # running estimate of one enqueue's host time
        self.waiters: deque[Callable[[], None]] = deque()
        self.retry: deque[Callable[[], None]] = deque()  # admitted, then found no budget left
        self.lib = lib
        # weak: a slice must not keep a finished loop alive (nor, through ``ready``, the
        # events of ops awaited by tasks that were cancelled as the loop ended)
        self._loop_ref: Callable[[], Any] = _weak(loop)
        # completion side: wake-ups handed over by the completion thread
        self.ready: deque[tuple[Any, _Wakeup]] = deque()  # (event, wake-up) entries
        self.lock = threading.Lock()
        self.notified = False
        self.wake_cost = 20e-6  # running estimate of one resumed task's host time
        self.last_n = 0  # wake-ups the previous drain ran, if it rescheduled itself
        self.last_drain = 0.0  # when that drain ended
        # back-pressure: this loop's parked awaits per stream id, and the streams at the cap
        self.depth: dict[int, int] = {}
        self.pressured: set[int] = set()
        # first-use (compiling) awaits enqueue off the loop one at a time (:func:`cold_lock`)
        self.cold: Any = None

    @property
    def loop(self) -> Any:
        """The event loop (asyncio) or trio token; ``RuntimeError`` once it is gone."""
        loop = self._loop_ref()
        if loop is None:
            raise RuntimeError("deviceops: the event loop of this await has finished")
        return loop

    def deliver(self, entries: list[Any]) -> None:
        """Completion thread: hand over many ``(event, _Wakeup)`` entries at once."""
        _deliver(self, entries)


def _weak(loop: Any) -> Callable[[], Any]:
    """A weak reference to ``loop`` (a strong one for objects that refuse weak references)."""
    try:
        return weakref.ref(loop)
    except TypeError:
        return (lambda lp: lambda: lp)(loop)


def _open(sl: _Slice) -> None:
    """Schedule the end-of-pass reset (once per pass)."""
    if not sl.open:
        sl.open = True
        if sl.lib == "asyncio":
            sl.loop.call_soon(_reset, sl)
        else:
            sl.loop.run_sync_soon(_reset, sl)


def _reset(sl: _Slice) -> None:
    """End of a pass: a fresh budget; admit queued tasks for the next pass.

    Admits about twice what the running cost estimate says fits: each
    admitted task checks the budget itself before it enqueues and, once the
    pass's budget is spent, goes to the retry queue, which the next reset
    serves first (in order). The budget is thus kept exactly, whatever the
    estimate's error.
    """
    sl.used = 0.0
    sl.window = time.perf_counter()
    sl.open = False
    if (sl.retry or sl.waiters) and not sl.pressured:
        n = max(1, int(2 * _slice_s / max(sl.cost, 1e-7)))
        retry, waiters = sl.retry, sl.waiters
        while n and retry:
            retry.popleft()()
            n -= 1
        while n and waiters:
            waiters.popleft()()
            n -= 1
        _open(sl)  # keep admitting next pass even if every woken task was cancelled


async def _admission(sl: _Slice, retry: bool = False) -> None:
    """Wait in FIFO order until this loop's enqueue budget admits the task.

    Each pass admits a bounded batch, so a burst of N awaits costs O(N) in
    total rather than every queued task re-checking on every pass. ``retry``
    queues an admitted task that found the pass's budget spent, or the loop
    under back-pressure, ahead of the tasks not admitted yet.
    """
    queue = sl.retry if retry else sl.waiters
    if sl.lib == "asyncio":
        fut: asyncio.Future[None] = sl.loop.create_future()

        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        queue.append(wake)
        _open(sl)
        await fut
    else:
        import trio

        ev = trio.Event()
        queue.append(ev.set)
        _open(sl)
        await ev.wait()


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
        _deliver(self.group, ((None, self),))


def _deliver(sl: _Slice, entries: Any) -> None:
    """Completion thread: queue ``(event, _Wakeup)`` entries for the loop; notify it once per drain."""
    with sl.lock:
        sl.ready.extend(entries)
        if sl.notified:
            return
        sl.notified = True
    try:
        if sl.lib == "asyncio":
            sl.loop.call_soon_threadsafe(_drain, sl, False)
        else:
            sl.loop.run_sync_soon(_drain, sl, False)
    except RuntimeError:  # the loop is closed or gone (trio.RunFinishedError is one): nobody waits
        with sl.lock:
            sl.ready.clear()  # drop the entries (and their events) now, not with the slice
            sl.notified = False


def _drain(sl: _Slice, continued: bool) -> None:
    """Loop thread: resume a bounded batch of completed awaits, then yield to the loop.

    When thousands of ops complete together, resuming every awaiting task in
    one pass would stall timers for as long as their code takes; instead each
    pass resumes about ``slice_ms`` worth of them. What one resumed task costs
    is learned from the passes themselves: the time from the end of the
    previous drain to this one, divided by the tasks it resumed (estimate
    rises fast and falls slowly, so a pass that happens to run before the
    tasks it woke -- trio's scheduler reverses batches at random -- does
    not inflate the next batch).
    """
    now = time.perf_counter()
    if continued and sl.last_n:
        per = (now - sl.last_drain) / sl.last_n
        sl.wake_cost += (0.5 if per > sl.wake_cost else 0.1) * (per - sl.wake_cost)
    ready = sl.ready
    n = min(len(ready), max(1, int(_slice_s / max(sl.wake_cost, 1e-7))))
    for _ in range(n):
        ready.popleft()[1].wake()
    with sl.lock:
        if not ready:
            sl.notified = False
            sl.last_n = 0
            return
    sl.last_n = n
    sl.last_drain = time.perf_counter()
    if sl.lib == "asyncio":
        sl.loop.call_soon(_drain, sl, True)
    else:
        sl.loop.run_sync_soon(_drain, sl, True)


_WINDOW_S = 1e-3  # enqueue budget window when no task is queued for admission


def _parked(sl: _Slice, sid: int) -> None:
    """Loop thread: one more await of this loop in flight on stream ``sid``."""
    d = sl.depth.get(sid, 0) + 1
    sl.depth[sid] = d
    if d >= _max_in_flight:
        sl.pressured.add(sid)


def _unparked(sl: _Slice, sid: int) -> None:
    """Loop thread: an await on stream ``sid`` completed; lift back-pressure at half the cap."""
    d = sl.depth[sid] - 1
    if d:
        sl.depth[sid] = d
    else:
        del sl.depth[sid]
    if sid in sl.pressured and d <= _max_in_flight // 2:
        sl.pressured.discard(sid)
        if not sl.pressured and (sl.waiters or sl.retry):
            _open(sl)  # admit the queued awaits at the end of this pass


def _park(ev: Any, sl: _Slice, lib: str) -> Awaitable[Any]:
    """Register the wake-up for ``ev``; return what the task awaits until it fires."""
    sid = ev.stream.id
    if lib == "asyncio":
        waiter: asyncio.Future[None] = sl.loop.create_future()

        def wake() -> None:
            _unparked(sl, sid)
            if not waiter.done():
                waiter.set_result(None)

        _parked(sl, sid)
        ev.when_complete(_Wakeup(sl, wake))
        return waiter
    import trio

    done = trio.Event()

    def wake_trio() -> None:
        _unparked(sl, sid)
        done.set()

    _parked(sl, sid)
    ev.when_complete(_Wakeup(sl, wake_trio))
    return done.wait()


def cold_lock(sl: _Slice) -> Any:
    """The loop's lock around a first-use await's off-loop enqueue and its registration.

    An await whose op compiles on first use is enqueued from a worker thread; while it is
    there, other tasks run. Taking these one at a time per loop, with the back-pressure check
    inside the lock, keeps every such await counted before the next one decides whether the
    stream is at its cap (a burst of first-use awaits would otherwise all pass the check).
    """
    lock = sl.cold
    if lock is None:
        if sl.lib == "asyncio":
            lock = asyncio.Lock()
        else:
            import trio

            lock = trio.Lock()
        sl.cold = lock
    return lock
