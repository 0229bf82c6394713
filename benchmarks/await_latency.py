"""Latency of one tiny op through ``sync()`` and ``await`` (asyncio, trio), and under load.

Usage::

    python benchmarks/await_latency.py [--smoke] [--json PATH] [--spin-us US] [--load N]

Part 1, latency of one tiny op (``z = x + z``, 1024 float32), each call timed on
the host, median and p90 over many calls (blocks of each variant interleaved):

| variant                        | what                                                        |
|--------------------------------|-------------------------------------------------------------|
| ``op.sync()``                  | default policy; enqueue + block                             |
| ``await op`` (asyncio / trio)  | default policy; see ``deviceops/_async.py`` (spin, wake-up) |
| raw launch + sync (ref)        | raw CuPy RawKernel + ``stream.synchronize()``               |
| raw host-func await (ref)      | raw launch, ``stream.launch_host_func`` sets an asyncio     |
|                                | future via ``loop.call_soon_threadsafe`` (trio: a           |
|                                | ``trio.Event`` via ``token.run_sync_soon``); await it       |

On the cpu backend the references use a plain worker thread running the NumPy
op (the cpu analogue of a stream and its host function).

Part 2, load: N (10,000; smoke 500) tasks in one event loop each await their
own tiny op, spawned ``--spawn-per-pass`` per loop pass while the default
policy's streams are held busy by a slow kernel, so all N await at once; a 1 ms
ticker task records its worst gap while they run (and, for context, while
idle). All N results are checked. "peak awaiting" counts tasks inside
``await``; "peak enqueued" the awaited ops on the GPU at once, which the
library's back-pressure caps per stream (``max_in_flight``) so that the loop
never blocks in a full driver launch queue (the load test lives in ``_await_load.py``).
The cyclic GC is off during timed regions (collected before), as in ``timeit``.

Bars: median await <= 1.5x median sync and <= 25 us; ticker worst gap < 5 ms
(each for asyncio and trio).
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import _await_load
import numpy as np
from _await_load import BLOCK_S, LOAD_SIZE, SPAWN_PER_PASS, load, trio  # trio: None if absent
from _common import (
    Bar,
    Bench,
    add_common_args,
    check_equal,
    download,
    int_data,
    launch_geometry,
    main_guard,
    median,
    no_gc,
    pct,
    print_bars,
    raw_kernels,
    setup,
    table,
    upload,
    write_json,
)

import deviceops
from deviceops import kernels

SIZE = 1024
A = 1.0
perf = time.perf_counter


# -- raw references -------------------------------------------------------------------
class _CpuWorker:
    """cpu reference: one thread running queued NumPy work in order (a 'stream')."""

    def __init__(self) -> None:
        self.q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.t = threading.Thread(target=self._run, daemon=True, name="bench-raw-worker")
        self.t.start()

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            work, done = item
            work()
            done()

    def close(self) -> None:
        self.q.put(None)


class RawRef:
    """The raw references: ``launch()`` enqueues ``z += x``; sync and host-func completion."""

    def __init__(self, b: Bench, z0: np.ndarray, x: np.ndarray) -> None:
        self.b = b
        self.count = {"raw_sync": 0, "raw_hostfunc": 0, "raw_hostfunc_trio": 0}
        if b.cupy is not None:
            cp = b.cupy
            self.fn = raw_kernels(cp)["raw_saxpy"]
            self.grid, self.block = launch_geometry(SIZE)
            self.cs = cp.cuda.Stream(non_blocking=True)
            self.x = cp.asarray(x)
            self.z = {k: cp.asarray(z0) for k in self.count}
            cp.cuda.Device().synchronize()
            self.worker = None
        else:
            self.x = x.copy()
            self.z = {k: z0.copy() for k in self.count}
            self.worker = _CpuWorker()

    def _launch(self, key: str) -> None:
        self.count[key] += 1
        if self.b.cupy is not None:
            self.fn(self.grid, self.block, (self.z[key], np.float32(A), self.x, np.int64(SIZE)), stream=self.cs)

    def sync_once(self) -> None:
        self._launch("raw_sync")
        if self.worker is None:
            self.cs.synchronize()
        else:
            z, x = self.z["raw_sync"], self.x
            ev = threading.Event()
            self.worker.q.put((lambda: np.add(z, x, out=z), ev.set))
            ev.wait()

    async def hostfunc_once(self) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._launch("raw_hostfunc")
        if self.worker is None:
            self.cs.launch_host_func(_wake, (loop, fut))
        else:
            z, x = self.z["raw_hostfunc"], self.x
            self.worker.q.put((lambda: np.add(z, x, out=z), lambda: _wake((loop, fut))))
        await fut

    async def hostfunc_once_trio(self) -> None:
        assert trio is not None
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        self._launch("raw_hostfunc_trio")
        if self.worker is None:
            self.cs.launch_host_func(_wake_trio, (token, done))
        else:
            z, x = self.z["raw_hostfunc_trio"], self.x
            self.worker.q.put((lambda: np.add(z, x, out=z), lambda: _wake_trio((token, done))))
        await done.wait()

    def result(self, key: str) -> np.ndarray:
        z = self.z[key]
        return self.b.cupy.asnumpy(z) if self.b.cupy is not None else np.array(z)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def _set_done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _wake(arg: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]) -> None:
    """Host-function / worker callback: hand completion to the loop thread-safely."""
    loop, fut = arg
    loop.call_soon_threadsafe(_set_done, fut)


def _wake_trio(arg: tuple[Any, Any]) -> None:
    """Host-function / worker callback for trio: ``token.run_sync_soon(event.set)``."""
    token, done = arg
    token.run_sync_soon(done.set)


# -- part 1: latency ---------------------------------------------------------------------
def latency(b: Bench, iters: int, warmup: int, rounds: int) -> tuple[list[dict[str, Any]], dict[str, float]]:
    rng = np.random.default_rng()
    stream = b.device.new_stream()
    z0 = int_data(rng, SIZE, -1000, 1000)
    xh = int_data(rng, SIZE, -3, 3)
    x = upload(xh, stream)
    keys = ["sync", "asyncio"] + (["trio"] if trio is not None else [])
    zs = {k: upload(z0, stream) for k in keys}
    counts = dict.fromkeys(keys, 0)
    raw = RawRef(b, z0, xh)
    raw_keys = ["raw_sync", "raw_hostfunc"] + (["raw_hostfunc_trio"] if trio is not None else [])
    lat: dict[str, list[float]] = {k: [] for k in [*keys, *raw_keys]}

    # Each block: ``w`` warm-up calls, then ``n`` recorded ones, in one event loop.
    def run_sync(w: int, n: int) -> None:
        z = zs["sync"]
        for i in range(w + n):
            t0 = perf()
            kernels.saxpy(z, A, x).sync()
            dt = perf() - t0
            if i >= w:
                lat["sync"].append(dt)
        counts["sync"] += w + n

    async def run_await(key: str, w: int, n: int) -> None:
        z = zs[key]
        for i in range(w + n):
            t0 = perf()
            await kernels.saxpy(z, A, x)
            dt = perf() - t0
            if i >= w:
                lat[key].append(dt)
        counts[key] += w + n

    def run_raw_sync(w: int, n: int) -> None:
        for i in range(w + n):
            t0 = perf()
            raw.sync_once()
            dt = perf() - t0
            if i >= w:
                lat["raw_sync"].append(dt)

    async def run_raw_hostfunc(key: str, w: int, n: int) -> None:
        once = raw.hostfunc_once if key == "raw_hostfunc" else raw.hostfunc_once_trio
        for i in range(w + n):
            t0 = perf()
            await once()
            dt = perf() - t0
            if i >= w:
                lat[key].append(dt)

    blocks: dict[str, Callable[[int, int], None]] = {
        "sync": run_sync,
        "asyncio": lambda w, n: asyncio.run(run_await("asyncio", w, n)),
        "raw_sync": run_raw_sync,
        "raw_hostfunc": lambda w, n: asyncio.run(run_raw_hostfunc("raw_hostfunc", w, n)),
    }
    if trio is not None:
        blocks["trio"] = lambda w, n: trio.run(run_await, "trio", w, n)
        blocks["raw_hostfunc_trio"] = lambda w, n: trio.run(run_raw_hostfunc, "raw_hostfunc_trio", w, n)
    per_round = max(1, iters // rounds)
    names = list(blocks)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            with no_gc():
                blocks[name](warmup, per_round)
    b.sync_all()
    for k in keys:
        want = (z0 + np.float32(counts[k]) * xh).astype(np.float32)
        check_equal(download(zs[k], stream), want, f"latency {k}: z after {counts[k]} ops")
    for k in raw_keys:
        want = (z0 + np.float32(raw.count[k]) * xh).astype(np.float32)
        check_equal(raw.result(k), want, f"latency {k}: z after {raw.count[k]} raw ops")
    raw.close()

    us = {k: [t * 1e6 for t in v] for k, v in lat.items()}
    med = {k: median(v) for k, v in us.items()}
    ref_label = "raw launch+sync" if b.is_cuda else "worker thread+Event"
    hf_labels = {"asyncio": "raw host-func await (asyncio)" if b.is_cuda else "worker+call_soon_threadsafe",
                 "trio": "raw host-func await (trio)" if b.is_cuda else "worker+run_sync_soon"}
    hf_keys = {"asyncio": "raw_hostfunc", "trio": "raw_hostfunc_trio"}
    rows = [{"variant": "op.sync()", "median_us": med["sync"], "p90_us": pct(us["sync"], 90),
             "reference": ref_label, "ref_median_us": med["raw_sync"], "ref_p90_us": pct(us["raw_sync"], 90),
             "ratio": med["sync"] / med["raw_sync"], "vs_sync": 1.0, "n": len(us["sync"])}]
    for k in keys[1:]:
        rk = hf_keys[k]
        rows.append({"variant": f"await op ({k})", "median_us": med[k], "p90_us": pct(us[k], 90),
                     "reference": hf_labels[k], "ref_median_us": med[rk],
                     "ref_p90_us": pct(us[rk], 90), "ratio": med[k] / med[rk],
                     "vs_sync": med[k] / med["sync"], "n": len(us[k])})
    return rows, med


def main() -> int:
    global SPAWN_PER_PASS
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--iters", type=int, default=None, help="latency samples per variant (2000; smoke 50)")
    p.add_argument("--load", type=int, default=None, help="concurrent awaited ops (10000; smoke 500)")
    p.add_argument("--load-timeout", type=float, default=120.0,
                   help="seconds the load test may take per loop before it is cancelled (reported)")
    p.add_argument("--spin-us", type=float, default=None,
                   help="deviceops.configure_await(spin_us=...) (default: DEVICEOPS_AWAIT_SPIN_US or 20)")
    p.add_argument("--slice-ms", type=float, default=None, help="deviceops.configure_await(slice_ms=...)")
    p.add_argument("--spawn-per-pass", type=int, default=SPAWN_PER_PASS,
                   help="load test: tasks the harness creates per event-loop pass (its own work per pass)")
    args = p.parse_args()
    # the load test's runners read _await_load's SPAWN_PER_PASS; this one goes in the record
    SPAWN_PER_PASS = _await_load.SPAWN_PER_PASS = max(1, args.spawn_per_pass)
    b = setup(args)
    knobs = deviceops.configure_await(spin_us=args.spin_us, slice_ms=args.slice_ms)
    iters = args.iters or (50 if args.smoke else 2000)
    n_load = args.load or (500 if args.smoke else 10_000)
    warmup = 5 if args.smoke else 50
    rounds = 2 if args.smoke else 5
    if trio is None:
        print("# note: trio is not importable; trio rows and bars are skipped")

    from deviceops import _async  # diagnostics only: how often an await missed the spin

    lat_rows, med = latency(b, iters, warmup, rounds)
    lat_stats = _async.stats()
    load_rows = load(b, n_load, 0.02 if args.smoke else 0.05, args.load_timeout)

    print()
    print(f"Latency of one tiny op (us), {iters} samples each; await knobs {knobs}")
    print(f"# latency part: {lat_stats['parked']} of {lat_stats['awaits']} awaits missed the spin and parked")
    print(table(lat_rows, [("variant", "variant", 0), ("median_us", "median", 1), ("p90_us", "p90", 1),
                           ("reference", "reference", 0), ("ref_median_us", "ref median", 1),
                           ("ref_p90_us", "ref p90", 1), ("ratio", "ratio", 2), ("vs_sync", "vs sync", 2)]))
    print()
    print(f"Load: {n_load} awaited ops from one loop (spawned {SPAWN_PER_PASS} per pass while the "
          f"policy streams are held busy, so all await at once), 1 ms ticker")
    for r in load_rows:
        print(f"# {r['loop']}: worst gaps {r.get('worst_gaps_ms')} ms, starting at {r.get('worst_gaps_start_ms')} ms after the load opened")
    print(table(load_rows, [("loop", "loop", 0), ("ops", "ops", 0), ("peak_in_flight", "peak awaiting", 0),
                            ("peak_enqueued", "peak enqueued", 0),
                            ("wall_ms", "wall ms", 1),
                            ("ops_per_s", "ops/s", 0), ("lat_p50_ms", "lat p50 ms", 2),
                            ("lat_p99_ms", "p99 ms", 2), ("lat_max_ms", "max ms", 2),
                            ("spawn_ms", "spawned by ms", 0),
                            ("gap_worst_ms", "tick gap worst ms", 2), ("gap_p99_ms", "gap p99", 2),
                            ("gap_after_spawn_worst_ms", "worst after spawn", 2),
                            ("gap_idle_worst_ms", "idle worst", 2), ("correct", "ok", 0)]))

    bars: list[Bar] = []
    for k in ("asyncio", "trio"):
        if k not in med:
            note = "trio not importable"
            bars += [Bar(f"await ({k}) median vs sync median", None, "<=", 1.5, "x", note),
                     Bar(f"await ({k}) median", None, "<=", 25.0, "us", note)]
            continue
        bars += [Bar(f"await ({k}) median vs sync median", med[k] / med["sync"], "<=", 1.5, "x"),
                 Bar(f"await ({k}) median", med[k], "<=", 25.0, "us")]
    for row in load_rows:
        bars.append(Bar(f"ticker worst gap under {row['ops']} awaits ({row['loop']})",
                        row["gap_worst_ms"], "<", 5.0, "ms",
                        "timed out: not all ops completed" if row["timed_out"] else ""))
    print_bars(bars, b)
    write_json(args.json, "await_latency", b,
               {"size": SIZE, "load_size": LOAD_SIZE, "iters": iters, "load": n_load, "await_knobs": knobs,
                "rounds": rounds, "warmup_per_block": warmup, "trio": trio is not None,
                "spawn_per_pass": SPAWN_PER_PASS, "block_s": BLOCK_S, "latency_await_stats": lat_stats},
               lat_rows, bars, {"load_rows": load_rows})
    return 0


if __name__ == "__main__":
    main_guard(main)
