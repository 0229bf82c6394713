"""Finished event loops leave nothing behind (found by the 1M-op GPU soak, 2026-11-23).

A task awaiting a slow op, cancelled just before its loop ends, registers a wake-up that
fires after the loop is closed. The bridge's per-loop slice held its loop strongly, so
neither the slice nor the wake-ups (with their events) it queued were ever freed: one
live ``Event`` per cancelled await, for ever.
"""

from __future__ import annotations

import asyncio
import gc
import time

import pytest
import trio

import deviceops
from deviceops import _async, api
from deviceops._stream import Event
from deviceops.kernels.testing import slow_copy

# The op outlasts the wait before the cancel by 100x: a loaded machine (parallel pytest on the
# GPU host) once let a 3 ms op finish before a 0.5 ms sleep returned, so nothing was cancelled.
OP_S = 0.05


def _live_events() -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, Event))


@pytest.mark.parametrize("lib", ["asyncio", "trio"])
def test_cancelled_awaits_of_finished_loops_are_freed(lib: str) -> None:
    dev = deviceops.device("cpu")
    s = dev.new_stream()
    x = api.ones((64,)).sync_on(s)
    dst = api.zeros((64,)).sync_on(s)

    async def aio() -> None:
        t = asyncio.ensure_future(_await(slow_copy(dst, x, OP_S)))
        await asyncio.sleep(0.0005)  # parked on the op's event
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t

    async def tr() -> None:
        with trio.move_on_after(0.0005):
            await slow_copy(dst, x, OP_S)

    def one_round() -> None:
        with deviceops.using(deviceops.scheduling.SingleStream(s)):
            asyncio.run(aio()) if lib == "asyncio" else trio.run(tr)

    for _ in range(3):
        one_round()
    dev.synchronize()
    gc.collect()
    base_events, base_slices = _live_events(), len(_async._slices)
    for _ in range(30):
        one_round()
    dev.synchronize()
    time.sleep(0.05)  # the completion thread hands the last wake-ups over
    gc.collect()
    assert _live_events() - base_events <= 4, "events of cancelled awaits stay alive"
    assert len(_async._slices) - base_slices <= 4, "slices of finished loops stay registered"


async def _await(op: object) -> object:
    return await op  # type: ignore[misc]
