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
default 0.5 ms): once enqueueing has used it up within one pass, further
awaiting tasks yield to the loop (``sleep(0)`` / trio checkpoint) before
enqueueing.

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
import contextlib
import os
import sys
import time
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
    """Host time spent enqueueing during the current pass of one event loop."""

    __slots__ = ("open", "used")

    def __init__(self) -> None:
        self.used = 0.0
        self.open = False


_slices: dict[int, _Slice] = {}


def _slice_for(lib: str) -> tuple[_Slice, Any]:
    if lib == "asyncio":
        loop: Any = asyncio.get_running_loop()
    else:
        import trio

        loop = trio.lowlevel.current_trio_token()
    sl = _slices.get(id(loop))
    if sl is None:
        sl = _slices[id(loop)] = _Slice()
    return sl, loop


def _reset(sl: _Slice) -> None:
    sl.used = 0.0
    sl.open = False


async def _yield(lib: str) -> None:
    if lib == "asyncio":
        await asyncio.sleep(0)
    else:
        import trio

        await trio.lowlevel.checkpoint()


async def await_op(op: DeviceOp[T]) -> T:
    """``await op``: schedule it on the default policy and await the future."""
    try:
        refuse_nested(f"await on {op._describe()}")
        lib = _library()
    except BaseException:
        op._consume()  # the error is the report; no "never executed" warning on top
        raise
    sl, loop = _slice_for(lib)
    while sl.used >= _slice_s:
        await _yield(lib)
    t0 = time.perf_counter()
    fut = op.schedule()
    if not sl.open:
        sl.open = True
        if lib == "asyncio":
            loop.call_soon(_reset, sl)
        else:
            loop.run_sync_soon(_reset, sl)
    sl.used += time.perf_counter() - t0
    return await _await_future(fut, lib)


async def await_future(fut: DeviceFuture[T]) -> T:
    """``await future``."""
    return await _await_future(fut, _library())


async def _await_future(fut: DeviceFuture[T], lib: str) -> T:
    ev = fut._event
    if fut._exc is not None or ev is None:
        return fut.result()
    if not ev.query():
        if _spin_s > 0 and not ev.stream.device.is_cpu:
            from ._completion import poller

            if poller().pending() == 0:
                deadline = time.perf_counter() + _spin_s
                while time.perf_counter() < deadline:
                    if ev.query():
                        break
        if not ev.query():
            if lib == "asyncio":
                await _park_asyncio(ev)
            else:
                await _park_trio(ev)
    return fut.result()


async def _park_asyncio(ev: Any) -> None:
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not waiter.done():
            waiter.set_result(None)

    def on_complete() -> None:
        try:  # noqa: SIM105 (hot path: a bare try is cheaper than suppress())
            loop.call_soon_threadsafe(wake)
        except RuntimeError:
            pass  # loop closed: nobody is waiting any more

    ev.when_complete(on_complete)
    await waiter


async def _park_trio(ev: Any) -> None:
    import trio

    token = trio.lowlevel.current_trio_token()
    done = trio.Event()

    def on_complete() -> None:
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(done.set)

    ev.when_complete(on_complete)
    await done.wait()
