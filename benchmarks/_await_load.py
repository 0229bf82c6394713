"""Part 2 of ``benchmarks/await_latency.py``, the load test: :class:`LoadCase` (N independent
tiny ops, each awaited by its own task, while the default policy's streams are held busy by
a slow kernel, and a 1 ms ticker task recording the event loop's gaps), the asyncio and trio
runners that spawn the tasks ``SPAWN_PER_PASS`` per loop pass, and :func:`load`, which runs
each loop, checks all N results and summarises latencies and ticker gaps as one row per
loop. ``await_latency.py`` sets ``SPAWN_PER_PASS`` here from ``--spawn-per-pass``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from _common import Bench, check, check_equal, download, int_data, no_gc, upload

import deviceops
from deviceops import kernels
from deviceops.kernels.testing import slow_copy

trio: Any
try:
    import trio
except ImportError:  # pragma: no cover - trio is a test dependency
    trio = None

LOAD_SIZE = 256
A_LOAD = 3.0
SPAWN_PER_PASS = 25  # load test: tasks the harness creates per event-loop pass (its own work per pass)
BLOCK_S = 1.0  # load test: GPU time the policy streams are held busy while tasks are spawned
BLOCK_S_SMOKE = 0.05
perf = time.perf_counter


class LoadCase:
    """N independent tiny ops (row views of one buffer, each its own Tensor)."""

    def __init__(self, b: Bench, n: int) -> None:
        rng = np.random.default_rng()
        self.b = b
        self.n = n
        self.stream = b.device.new_stream()
        self.z0 = int_data(rng, (n, LOAD_SIZE), -1000, 1000)
        self.xh = int_data(rng, (n, LOAD_SIZE), -3, 3)
        self.zbig = upload(self.z0, self.stream)
        self.xbig = upload(self.xh, self.stream)
        dev = b.device
        # Independent tensors over disjoint rows: no false cross-stream hazards.
        self.zs = [deviceops.Tensor(self.zbig.array[i], dev) for i in range(n)]
        self.xs = [deviceops.Tensor(self.xbig.array[i], dev) for i in range(n)]
        self.lat = [float("nan")] * n
        # compile the blocking kernel now, not inside the ticker window
        slow_copy(self.zs[0], self.zs[0], 0.0).sync_on(self.stream)
        self.ready = 0
        self.done = 0
        self.peak = 0
        self.peak_enqueued = 0
        self.ticks: list[float] = []
        self.stop = False
        self.timed_out = False
        self.t_spawned = float("nan")  # when the last task was created

    async def one(self, i: int) -> None:
        self.ready += 1
        self.peak = max(self.peak, self.ready - self.done)
        t0 = perf()
        out = await kernels.saxpy(self.zs[i], A_LOAD, self.xs[i])
        self.lat[i] = perf() - t0
        check(out is self.zs[i], "load: await saxpy(z, a, x) produced z")
        self.done += 1

    def block_streams(self) -> None:
        """Hold every stream of the default policy behind a slow kernel for BLOCK_S.

        The awaited ops are spawned while the GPU is busy, so all of them are
        in flight at once (peak in-flight is reported) and complete together:
        the worst case for the completion side of the event loop.
        """
        pol = deviceops.scheduling.current_policy()
        streams = getattr(pol, "streams", None) or [pol.next_stream() for _ in range(8)]
        block = BLOCK_S_SMOKE if self.b.smoke else BLOCK_S
        for st in dict.fromkeys(streams):
            src = deviceops.api.zeros((256,)).sync_on(st)
            dst = deviceops.api.zeros((256,)).sync_on(st)
            slow_copy(dst, src, block).async_on(st)

    async def ticker(self, sleep: Callable[[float], Awaitable[Any]]) -> None:
        from deviceops import _async  # the loop's per-stream in-flight counts (diagnostic only)

        self.ticks.append(perf())
        while not self.stop:
            await sleep(0.001)
            self.ticks.append(perf())
            self.peak_enqueued = max(self.peak_enqueued, sum(_async._current()[1].depth.values()))

    def verify(self, loop: str) -> None:
        if self.timed_out:
            print(f"# load {loop}: timed out after {self.done}/{self.n} ops; results not checked", flush=True)
            self.b.sync_all()
            return
        check(self.done == self.n, f"load {loop}: {self.done}/{self.n} tasks completed")
        self.b.sync_all()
        want = (self.z0 + np.float32(A_LOAD) * self.xh).astype(np.float32)
        check_equal(download(self.zbig, self.stream), want, f"load {loop}: all {self.n} results")

    def summary(self, loop: str, t_open: float, t_done: float, idle_s: float) -> dict[str, Any]:
        ticks = np.asarray(self.ticks)
        gaps = np.diff(ticks)
        ends = ticks[1:]
        sel = (ends > t_open) & (ticks[:-1] < t_done)
        in_load = gaps[sel]
        starts = ticks[:-1][sel]
        worst_at = [round(float(starts[k] - t_open) * 1e3, 1) for k in np.argsort(-in_load)[:3]] if in_load.size else []
        after = gaps[(ticks[:-1] >= self.t_spawned) & (ticks[:-1] < t_done)]
        idle = gaps[ends <= t_open]
        lat_ms = np.asarray(self.lat) * 1e3
        lat_ms = lat_ms[~np.isnan(lat_ms)] if self.timed_out else lat_ms
        if lat_ms.size == 0:
            lat_ms = np.asarray([float("nan")])
        wall = t_done - t_open
        return {"loop": loop, "ops": self.n, "wall_ms": wall * 1e3, "ops_per_s": self.done / wall,
                "lat_p50_ms": float(np.median(lat_ms)), "lat_p99_ms": float(np.percentile(lat_ms, 99)),
                "lat_max_ms": float(lat_ms.max()),
                "gap_worst_ms": float(in_load.max()) * 1e3 if in_load.size else float("nan"),
                "gap_p99_ms": float(np.percentile(in_load, 99)) * 1e3 if in_load.size else float("nan"),
                "gap_idle_worst_ms": float(idle.max()) * 1e3 if idle.size else float("nan"),
                "ticks_in_load": int(in_load.size), "idle_window_ms": idle_s * 1e3,
                "completed": self.done, "timed_out": self.timed_out, "correct": not self.timed_out,
                "peak_in_flight": self.peak, "peak_enqueued": self.peak_enqueued,
                "spawn_ms": (self.t_spawned - t_open) * 1e3,
                "gap_after_spawn_worst_ms": float(after.max()) * 1e3 if after.size else float("nan"),
                "worst_gaps_ms": [round(float(g) * 1e3, 2) for g in np.sort(in_load)[::-1][:3]],
                "worst_gaps_start_ms": worst_at}


async def _load_asyncio(case: LoadCase, idle_s: float, timeout: float) -> tuple[float, float]:
    tick = asyncio.create_task(case.ticker(asyncio.sleep))
    await asyncio.sleep(idle_s)
    all_done = asyncio.Event()

    async def one(i: int) -> None:
        await case.one(i)
        if case.done == case.n:
            all_done.set()

    case.block_streams()  # harness set-up, before the measured window
    await asyncio.sleep(0.002)
    t_open = perf()
    tasks = []  # kept only so the tasks are not garbage-collected; no gather over 10k tasks
    for i in range(case.n):  # spawned SPAWN_PER_PASS per loop pass, as a server would see them
        tasks.append(asyncio.create_task(one(i)))
        if i % SPAWN_PER_PASS == SPAWN_PER_PASS - 1:
            await asyncio.sleep(0)
    case.t_spawned = perf()
    try:
        await asyncio.wait_for(all_done.wait(), timeout)
    except TimeoutError:
        case.timed_out = True
        for t in tasks:
            t.cancel()
    t_done = perf()
    await asyncio.sleep(0.003)
    case.stop = True
    await tick
    return t_open, t_done


async def _load_trio(case: LoadCase, idle_s: float, timeout: float) -> tuple[float, float]:
    assert trio is not None
    all_done = trio.Event()
    times = [0.0, 0.0]

    async def one(i: int) -> None:
        await case.one(i)
        if case.done == case.n:
            all_done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(case.ticker, trio.sleep)
        await trio.sleep(idle_s)
        case.block_streams()  # harness set-up, before the measured window
        await trio.sleep(0.002)
        times[0] = perf()
        for i in range(case.n):  # SPAWN_PER_PASS per scheduler batch
            nursery.start_soon(one, i)
            if i % SPAWN_PER_PASS == SPAWN_PER_PASS - 1:
                await trio.lowlevel.checkpoint()
        case.t_spawned = perf()
        with trio.move_on_after(timeout) as scope:
            await all_done.wait()
        times[1] = perf()
        case.timed_out = scope.cancelled_caught
        await trio.sleep(0.003)
        case.stop = True
        if case.timed_out:
            nursery.cancel_scope.cancel()
    return times[0], times[1]


def load(b: Bench, n: int, idle_s: float, timeout: float) -> list[dict[str, Any]]:
    rows = []
    runners: list[tuple[str, Callable[[LoadCase], tuple[float, float]]]] = [
        ("asyncio", lambda c: asyncio.run(_load_asyncio(c, idle_s, timeout))),
    ]
    if trio is not None:
        runners.append(("trio", lambda c: trio.run(_load_trio, c, idle_s, timeout)))
    for name, run in runners:
        case = LoadCase(b, n)
        with no_gc():  # a full collection over 10k tasks would show as a ticker gap
            t_open, t_done = run(case)
        case.verify(name)
        rows.append(case.summary(name, t_open, t_done, idle_s))
        if not case.timed_out:
            print(f"# load {name}: {n} ops checked ({(t_done - t_open) * 1e3:.0f} ms)", flush=True)
    return rows
