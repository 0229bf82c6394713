"""Soak: a long run of mixed DeviceOps with resources asserted flat.

Usage::

    python benchmarks/soak.py [--ops 1000000] [--device cpu|cuda] [--json PATH] [--smoke]

The run cycles through rounds of mixed work on the default device (or ``--device``):

| kind        | what one round does                                                        |
|-------------|----------------------------------------------------------------------------|
| sync        | ``kernels.add(x, y, out=z).sync_on(s)`` and a ``then``/``map`` chain       |
| asyncio     | ``await`` of tiny ops in an asyncio loop (several tasks)                   |
| trio        | the same under trio                                                        |
| graph       | ``CudaGraph.launch()`` replays of a captured add, then ``synchronize``     |
| failing     | ops that fail: a closure raising while enqueued, a bad input refused,      |
|             | a ``zip`` with a failing branch; cpu: a kernel whose task fails on the     |
|             | worker (a device-side failure; on cuda that would poison the context:      |
|             | see ``tests/test_reliability_gpu.py``)                                     |
| cancel      | an awaited slow op cancelled (asyncio ``Task.cancel``, trio cancel scope)  |

Every op's result is checked (integer-valued data). At checkpoints (after a warm-up) it
records RSS, GPU memory (CuPy pool bytes in use and the device's used bytes), the number of
threads and of live deviceops ``Event`` objects, and asserts at the end that none of them
grew beyond a small tolerance (a leak of one event, one buffer or one thread per round
would exceed it many times over). Exit status 1 on a wrong result or a growth.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import deviceops
from deviceops import LaunchError, api, kernels
from deviceops._stream import Event
from deviceops.kernels.testing import slow_copy
from deviceops.scheduling import StreamPoolRoundRobin

N = 1024
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def gpu_bytes(dev: deviceops.Device) -> tuple[int, int]:
    """(CuPy pool bytes in use, device bytes in use); zeros on cpu."""
    if dev.is_cpu:
        return 0, 0
    import cupy

    with cupy.cuda.Device(dev.index):
        free, total = cupy.cuda.runtime.memGetInfo()
        return int(cupy.get_default_memory_pool().used_bytes()), int(total - free)


def live_events() -> int:
    """Live deviceops Event objects (a full scan of the heap: checkpoints only)."""
    return sum(1 for o in gc.get_objects() if isinstance(o, Event))


class Soak:
    """The state and the rounds of one soak run."""

    def __init__(self, dev: deviceops.Device) -> None:
        self.dev = dev
        self.s = dev.new_stream()
        self.policy = StreamPoolRoundRobin(dev, num_streams=4)
        self.x = api.full((N,), 1.0).sync_on(self.s)
        self.y = api.full((N,), 2.0).sync_on(self.s)
        self.z = api.zeros((N,)).sync_on(self.s)
        self.acc = api.zeros((N,)).sync_on(self.s)
        self.one = api.ones((N,)).sync_on(self.s)
        self.g = kernels.add(self.acc, self.one, out=self.acc).graph_on(self.s)
        self.g_count = 0
        self.slow_dst = api.zeros((N,)).sync_on(self.s)
        self.ops = 0
        self.failures = 0
        self.cancels = 0
        self.checks = 0

    def _host(self, t: deviceops.Tensor) -> np.ndarray:
        out: np.ndarray = api.to_host(t).sync_on(self.s)
        return out

    def check(self, ok: bool, what: str) -> None:
        self.checks += 1
        if not ok:
            raise AssertionError(f"soak: wrong result: {what}")

    # -- rounds ---------------------------------------------------------------------------
    def sync_round(self, n: int) -> None:
        for _ in range(n):
            kernels.add(self.x, self.y, out=self.z).sync_on(self.s)
        self.ops += n
        v = (api.full((4,), 3.0).then(lambda t: kernels.add(t, t)).map(lambda t: t)
             .sync_on(self.s))
        self.ops += 3
        self.check(float(self._host(v)[0]) == 6.0 and float(self._host(self.z)[0]) == 3.0, "sync")

    async def _awaits(self, n: int, tasks: int, lib: str) -> None:
        async def worker(k: int) -> None:
            for _ in range(k):
                await kernels.add(self.x, self.y)

        if lib == "asyncio":
            import asyncio

            await asyncio.gather(*(worker(n // tasks) for _ in range(tasks)))
        else:
            import trio

            async with trio.open_nursery() as nursery:
                for _ in range(tasks):
                    nursery.start_soon(worker, n // tasks)
        self.ops += (n // tasks) * tasks

    def await_round(self, n: int, lib: str) -> None:
        with deviceops.using(self.policy):
            if lib == "asyncio":
                import asyncio

                asyncio.run(self._awaits(n, 4, lib))
            else:
                import trio

                trio.run(self._awaits, n, 4, lib)

    def graph_round(self, n: int) -> None:
        for _ in range(n):
            self.g.launch()
        self.g.synchronize()
        self.g_count += n
        self.ops += n
        self.check(float(self._host(self.acc)[0]) == float(self.g_count), "graph replays")

    def failing_round(self) -> None:
        def boom(t: Any) -> Any:
            raise RuntimeError("soak: injected host failure")

        for make, exc in (
            (lambda: api.ones((4,)).map(boom).sync_on(self.s), RuntimeError),
            (lambda: kernels.add(self.x, api.ones((5,)).sync_on(self.s)).sync_on(self.s), ValueError),
            (lambda: deviceops.zip(api.ones((4,)), api.ones((4,)).map(boom)).sync_on(self.s),
             RuntimeError),
        ):
            try:
                make()
            except exc:
                self.failures += 1
            else:
                raise AssertionError("soak: a failing op did not fail")
            self.ops += 1
        if self.dev.is_cpu:  # a device-side failure (the worker task raises), through zip
            try:
                deviceops.zip(api.ones((4,)), api.to_host(self.x).map(lambda a: a)
                              .then(lambda a: _fail_on_device(self.z))).sync_on(self.s)
            except LaunchError:
                self.failures += 1
            else:
                raise AssertionError("soak: a device-side failure was lost")
            self.ops += 1
            api.memcpy(self.z, self.x).sync_on(self.s)  # overwrite the failed tensor

    def cancel_round(self) -> None:
        delay = 0.002

        async def aio() -> None:
            import asyncio

            t = asyncio.ensure_future(_await_op(slow_copy(self.slow_dst, self.x, delay)))
            await asyncio.sleep(0)
            t.cancel()
            try:
                await t
            except asyncio.CancelledError:
                self.cancels += 1

        async def tr() -> None:
            import trio

            with trio.move_on_after(0.0005) as scope:
                await slow_copy(self.slow_dst, self.x, delay)
            if scope.cancelled_caught:
                self.cancels += 1

        import asyncio

        import trio

        with deviceops.using(self.policy):
            asyncio.run(aio())
            trio.run(tr)
        self.ops += 2
        self.dev.synchronize()


async def _await_op(op: Any) -> Any:
    return await op


def _fail_on_device(out: deviceops.Tensor) -> deviceops.DeviceOp[Any]:
    from deviceops._launch import launch
    from deviceops.kernels import KernelOp

    def run(ctx: Any, o: deviceops.Tensor) -> deviceops.Tensor:
        def cpu() -> None:
            raise RuntimeError("soak: injected device failure")

        launch(ctx, "fail_inject", (), (o,), cpu, lambda native: None)
        return o

    return KernelOp("fail_inject", run, (out,))


def run_soak(total_ops: int, dev: deviceops.Device, checkpoints: int = 5,
             log: Any = print) -> dict[str, Any]:
    """Run about ``total_ops`` ops; return the record (``passed`` says whether flat)."""
    soak = Soak(dev)
    # a round: 200 sync, 200 asyncio, 200 trio, 200 graph, failing and cancelled ops
    per_round = 200
    rounds = max(2 * checkpoints, total_ops // (4 * per_round + 8))
    every = max(1, rounds // checkpoints)
    samples: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for r in range(rounds):
        soak.sync_round(per_round)
        soak.await_round(per_round, "asyncio")
        soak.await_round(per_round, "trio")
        soak.graph_round(per_round)
        soak.failing_round()
        if r % 4 == 0:
            soak.cancel_round()
        if r % every == every - 1 or r == rounds - 1:
            dev.synchronize()
            gc.collect()
            pool, used = gpu_bytes(dev)
            sample = {"round": r + 1, "ops": soak.ops, "seconds": round(time.perf_counter() - t0, 2),
                      "rss": rss_bytes(), "gpu_pool": pool, "gpu_used": used,
                      "threads": threading.active_count(), "events": live_events()}
            samples.append(sample)
            log(f"  {sample}")
    base, last = samples[1] if len(samples) > 1 else samples[0], samples[-1]
    limits = {"rss": 64 << 20, "gpu_pool": 16 << 20, "gpu_used": 64 << 20, "threads": 2,
              "events": 64}
    growth = {k: last[k] - base[k] for k in limits}
    flat = {k: growth[k] <= limits[k] for k in limits}
    rec = {
        "benchmark": "soak", "device": str(dev), "ops": soak.ops, "rounds": rounds,
        "failures": soak.failures, "cancels": soak.cancels, "checks": soak.checks,
        "seconds": round(time.perf_counter() - t0, 2), "samples": samples,
        "growth_after_warmup": growth, "limits": limits, "flat": flat,
        "passed": all(flat.values()),
    }
    return rec


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", type=int, default=1_000_000)
    p.add_argument("--device", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--smoke", action="store_true", help="20,000 ops (seconds)")
    a = p.parse_args()
    dev = deviceops.device(a.device) if a.device else deviceops.default_device()
    ops = 20_000 if a.smoke else a.ops
    print(f"soak: {ops} ops on {dev}")
    rec = run_soak(ops, dev)
    print(f"soak: {rec['ops']} ops, {rec['failures']} failures, {rec['cancels']} cancels, "
          f"{rec['checks']} checks in {rec['seconds']} s; growth after warm-up "
          f"{rec['growth_after_warmup']} (limits {rec['limits']})")
    print("PASS soak flat" if rec["passed"] else f"FAIL soak flat: {rec['flat']}")
    if a.json:
        Path(a.json).write_text(json.dumps(rec, indent=1))
    return 0 if rec["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
