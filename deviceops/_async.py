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
default 0.3 ms) per 1 ms window: once enqueueing has used it up, further
awaiting tasks queue up (FIFO) and an end-of-pass reset admits a batch that
fits the next slice (sized from a running estimate of one enqueue's cost). A
burst of N awaits thus costs O(N) in total, and timers run between batches;
an await that finds no queue costs no loop callback at all.

**Completion side.** The completion thread hands wake-ups to a per-loop
queue and notifies the loop once; the loop resumes them in batches sized from
a running estimate of what one resumed task costs the loop (the time of the
pass that ran the previous batch, divided by its size), so that each pass
spends about ``slice_ms`` resuming tasks.

**Back-pressure.** The driver queues a bounded number of launches per stream
(about 1,000 on an H100 with driver 580, measured: launch number 1,022 behind
a long kernel blocks in ``cuLaunchKernel`` until the stream drains). A loop
that enqueued more than that would freeze inside the driver. So each loop
counts the awaited ops it has in flight per stream; when a stream reaches
``max_in_flight`` (default 256 ops), new awaits in that loop wait in the
admission queue (they still count as awaiting, and cancel promptly) until the
stream is down to half of it. 10,000 concurrent awaits therefore cost the
loop no blocking call, whatever the GPU's backlog. (This covers ``await op``,
where the library does the enqueueing; ``op.schedule()`` enqueues at once in
the caller, so ``await op.schedule(...)`` in a loop of thousands is the
caller's to pace.)

**Cancellation.** Cancelling an awaiting task (``task.cancel()``, anyio/trio
cancel scopes, ``anyio.fail_after``) returns at once. The work already
enqueued still runs to completion; the tensors it uses stay referenced by the
stream's bookkeeping until then, so their memory is not reused early, and the
stream stays usable.

Knobs: :func:`configure_await` or the environment variables
``DEVICEOPS_AWAIT_SPIN_US``, ``DEVICEOPS_AWAIT_SLICE_MS`` and
``DEVICEOPS_AWAIT_MAX_IN_FLIGHT``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from . import _hooks
from ._context import guard, refuse_nested

if TYPE_CHECKING:
    from ._future import DeviceFuture
    from ._op import DeviceOp

__all__ = ["configure_await"]

T = TypeVar("T")

_spin_s = float(os.environ.get("DEVICEOPS_AWAIT_SPIN_US", "20")) * 1e-6
_slice_s = float(os.environ.get("DEVICEOPS_AWAIT_SLICE_MS", "0.3")) * 1e-3
_max_in_flight = int(os.environ.get("DEVICEOPS_AWAIT_MAX_IN_FLIGHT", "256"))


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

    __slots__ = ("_loop_ref", "cost", "depth", "last_drain", "last_n", "lib", "lock", "notified",
                 "open", "pressured", "ready", "retry", "used", "waiters", "wake_cost", "window")

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
    _last = (_weak(loop), lib, sl)
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
        for key in [k for k, (r, _) in _slices.items() if _finished(r())]:
            del _slices[key]  # loops that are gone
        entry = _slices[id(loop)] = (_weak(loop), _Slice(lib, loop))
    return entry[1]


def _finished(loop: Any) -> bool:
    """Whether a loop of ``_slices`` is gone or closed (its slice can be dropped)."""
    return loop is None or (isinstance(loop, asyncio.AbstractEventLoop) and loop.is_closed())


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


async def await_op(op: DeviceOp[T]) -> T:
    """``await op``: schedule it on the default policy and await the future."""
    try:
        if guard.active is not None:
            refuse_nested(f"await on {op._describe()}")
        lib, sl = _current()
    except BaseException:
        op._consume()  # the error is the report; no "never executed" warning on top
        raise
    t0 = _perf()
    if t0 - sl.window > _WINDOW_S:  # a new window: fresh budget (no per-await loop callback)
        sl.window = t0
        sl.used = 0.0
    if sl.waiters or sl.retry or sl.used >= _slice_s or sl.pressured:
        try:
            await _admission(sl)
            while sl.pressured or sl.used >= _slice_s:  # a stream filled up, or the budget is spent
                await _admission(sl, retry=True)
        except BaseException:
            op._consume()  # cancelled before it was enqueued: nothing ran, nothing to warn about
            raise
        t0 = _perf()
    fut = op.schedule()
    _stats[0] += 1
    ev = fut._event
    parked = None
    if fut._exc is None and ev is not None and not ev.query() and not _spin(ev):
        _stats[1] += 1
        parked = _park(ev, sl, lib)
    dt = _perf() - t0  # the enqueue (and registration): this task's share of the pass
    sl.cost += 0.1 * (dt - sl.cost)
    sl.used += dt
    if parked is not None:
        await parked
    return fut.result()


_perf = time.perf_counter


async def await_future(fut: DeviceFuture[T]) -> T:
    """``await future``."""
    return await _await_future(fut, _library())


_the_poller: Any = None


def _poller() -> Any:
    global _the_poller
    if _the_poller is None:
        from ._completion import poller

        _the_poller = poller()
    return _the_poller


# [awaits, of which parked]: how often the spin missed (diagnostics, see stats())
_stats = [0, 0]


def stats() -> dict[str, int]:
    """Counters of ``await op`` since start: how many, and how many had to park.

    An await that parks pays a round trip through the completion thread and
    the event loop; one that completes within the spin does not.
    """
    return {"awaits": _stats[0], "parked": _stats[1]}


async def _await_future(fut: DeviceFuture[T], lib: str) -> T:
    ev = fut._event
    if fut._exc is None and ev is not None and not ev.query() and not _spin(ev):
        await _park(ev, _current()[1], lib)
    return fut.result()


def _spin(ev: Any) -> bool:
    """Poll a not-yet-complete ``ev`` for up to ``spin_us`` (cuda, no other awaits parked)."""
    if _spin_s > 0 and ev.stream.backend.spin_before_park and _poller().pending() == 0:
        query = ev.query
        deadline = _perf() + _spin_s
        while _perf() < deadline:
            if query():
                return True
    return bool(ev.query())


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


_hooks.install(await_op=await_op, await_future=await_future)  # DeviceOp/DeviceFuture.__await__
