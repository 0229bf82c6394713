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

**Compiles.** An op whose kernels may still compile (one ``await`` has not yet seen it
complete without a compile, on a process with a CUDA backend) is enqueued in a worker
thread, so an NVRTC compile never runs on the loop's thread; see :mod:`deviceops._offload`.

**Cancellation.** Cancelling an awaiting task (``task.cancel()``, anyio/trio
cancel scopes, ``anyio.fail_after``) returns at once. The work already
enqueued still runs to completion; the tensors it uses stay referenced by the
stream's bookkeeping until then, so their memory is not reused early, and the
stream stays usable.

The per-loop pacing (knobs, fair enqueueing, wake-ups, back-pressure) lives in
:mod:`deviceops._async_pacing`; this module finds the running loop and awaits.

Knobs: :func:`configure_await` or the environment variables
``DEVICEOPS_AWAIT_SPIN_US``, ``DEVICEOPS_AWAIT_SLICE_MS`` and
``DEVICEOPS_AWAIT_MAX_IN_FLIGHT``.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from . import _async_pacing as _pacing
from . import _hooks, _offload
from ._async_pacing import (
    _WINDOW_S,
    _admission,
    _park,
    _Slice,
    _weak,
    cold_lock,
    configure_await,
)
from ._backend import program_loads as _loads
from ._context import guard, refuse_nested

if TYPE_CHECKING:
    from ._future import DeviceFuture
    from ._op import DeviceOp

__all__ = ["configure_await"]

T = TypeVar("T")


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
    if sl.waiters or sl.retry or sl.used >= _pacing._slice_s or sl.pressured:
        try:
            await _admission(sl)
            while sl.pressured or sl.used >= _pacing._slice_s:  # a stream filled up, or the budget is spent
                await _admission(sl, retry=True)
        except BaseException:
            op._consume()  # cancelled before it was enqueued: nothing ran, nothing to warn about
            raise
        t0 = _perf()
    policy = _hooks.current_policy()
    if policy.counts_enqueued:  # a tenant: wait (suspended) until it has room for this op
        ev = policy.backlog()
        if ev is not None:
            try:
                while ev is not None:
                    await _park(ev, sl, lib)
                    ev = policy.backlog()
            except BaseException:
                op._consume()  # cancelled before it was enqueued
                raise
            t0 = _perf()
    key = _offload.cold(op)
    if key is None:
        before = _loads[0]
        fut = op.schedule(policy)
        if _loads[0] != before:  # a warm key compiled after all: cold again
            _offload.note_inline(op, before)
        parked = _register(fut, sl, lib)
    else:  # an op not yet seen complete without a compile: enqueued off the loop's thread
        try:
            async with cold_lock(sl):
                while sl.pressured:
                    await _admission(sl, retry=True)
                fut = await _offload.schedule_off_loop(op, key)
                parked = _register(fut, sl, lib)
        except BaseException:
            op._consume()  # (no-op once enqueued) cancelled before: nothing ran, no warning
            raise
        t0 = _perf()
    dt = _perf() - t0  # the enqueue (and registration): this task's share of the pass
    sl.cost += 0.1 * (dt - sl.cost)
    sl.used += dt
    if parked is not None:
        await parked
    return fut.result()


_perf = time.perf_counter


def _register(fut: Any, sl: _Slice, lib: str) -> Any:
    """Count an enqueued await; return what to await for its wake-up (``None``: complete)."""
    _stats[0] += 1
    ev = fut._event
    if fut._exc is None and ev is not None and not ev.query() and not _spin(ev):
        _stats[1] += 1
        return _park(ev, sl, lib)
    return None


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
    if _pacing._spin_s > 0 and ev.stream.backend.spin_before_park and _poller().pending() == 0:
        query = ev.query
        deadline = _perf() + _pacing._spin_s
        while _perf() < deadline:
            if query():
                return True
    return bool(ev.query())


_hooks.install(await_op=await_op, await_future=await_future)  # DeviceOp/DeviceFuture.__await__
