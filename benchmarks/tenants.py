"""Many tenants on one GPU (issue 48): throughput of concurrent jobs, latency of small ones.

Usage::

    python benchmarks/tenants.py [--smoke] [--json PATH] [--seconds S] [--modes eager,plain,graph]

A *small job* is a chain of 4 GEMMs at 256³ float16 and a read-back of the result to the
host; a *big job* a chain of 8 GEMMs at 4096³ or 8192³ float16 (awaited, not read back).
Scenarios, each measured over a window of ``--seconds`` after a warm-up:

* ``alone``: one small job at a time with ``sync()``; one big job at a time (their solo
  costs, the units of "work done");
* ``small48``: 48 small tenants at once, each an asyncio task looping ``await`` on its jobs;
* ``mixed4096`` / ``mixed8192``: the 48 small tenants and 4 big tenants at once.

deviceops' tenants come from one :class:`~deviceops.scheduling.TenantPool`: small tenants
at ``priority="high"`` (``max_queued=2``), big ones at ``"low"`` (``max_queued=1``: their
streams yield SMs between GEMM tiles). Three ways to run a small job: ``eager`` builds the
DAG again for every job, as a user writes it (the tenants' ``auto_graph``, on by default,
replays it as a graph from its third run); ``plain`` the same with ``auto_graph=False``
(every op launched each time); ``graph`` captures the tenant's 4 GEMMs by hand once into a
CUDA graph (into preallocated buffers) and each job is
``await api.to_host(graph.launch_op())``. The baseline of "one at a time" is ``sync()``
under the default policy (no tenant: every op launched each time). torch runs beside us in the same process with the
same jobs: one thread and one CUDA stream per tenant (default priority), ``.cpu()`` for the
read-back. ``CUDA_DEVICE_MAX_CONNECTIONS`` is set to 32 for both, before CUDA starts, unless
the environment sets it.

Reported per scenario: small and big jobs/s, small-job p50/p99 (submission to the result on
the host), the event loop's longest stall (deviceops: how late a 1 ms sleep came back), and
*work done*: (small jobs x solo small cost + big jobs x solo big cost) over
the window, i.e. how many times faster than running the same jobs one at a time. torch's
work is counted in its own solo costs (``work_x``) and, to compare the two, in ours
(``work_ours_units``). Results are checked: every 50th small job of each tenant and the
first big job of each size against a float64 reference (smoke) or torch (GPU).

Bars (one H200, issue 48): mixed work >= 2.0x one at a time and >= 1.2x torch's; small-job
p99 under the 8192³ flood <= 2x its p99 in ``small48``; ``small48`` >= 3x the jobs/s of
``sync()`` one at a time, with p50 <= 2 ms.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # before CUDA starts (torch, CuPy)

import argparse
import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from _common import (
    Bar,
    Bench,
    add_common_args,
    check_close,
    main_guard,
    pct,
    print_bars,
    setup,
    table,
    write_json,
)

import deviceops
from deviceops import api, kernels
from deviceops.scheduling import TenantPool

CHECK_EVERY = 50
perf = time.perf_counter


@dataclass
class Config:
    small_n: int = 256
    small_gemms: int = 4
    big_sizes: tuple[int, ...] = (4096, 8192)
    big_gemms: int = 8
    small_tenants: int = 48
    big_tenants: int = 4
    seconds: float = 4.0
    warm: float = 0.7


@dataclass
class Tally:
    """What one scenario measured."""

    small_lat: list[float] = field(default_factory=list)
    small: int = 0
    big: int = 0
    window: float = 0.0
    loop_gap: float | None = None  # the event loop's longest stall in the window (deviceops)


def ref_chain(x: np.ndarray, ws: list[np.ndarray]) -> np.ndarray:
    """float64 products, rounded to float16 after each (as the kernels store them)."""
    y = x.astype(np.float64)
    for w in ws:
        y = (y @ w.astype(np.float64)).astype(np.float16).astype(np.float64)
    return y


class SmallJob:
    """One small tenant's inputs, its expected result and (graph mode) its captured chain."""

    def __init__(self, rng: np.random.Generator, n: int, k: int) -> None:
        self.xh = rng.standard_normal((n, n), dtype=np.float32).astype(np.float16)
        self.wh = [(rng.standard_normal((n, n), dtype=np.float32) / np.sqrt(n)).astype(np.float16)
                   for _ in range(k)]
        self.want = ref_chain(self.xh, self.wh)
        self.x = api.from_host(self.xh).sync()
        self.ws = [api.from_host(w).sync() for w in self.wh]
        self.graph: Any = None
        self.jobs = 0

    def eager(self) -> deviceops.DeviceOp[np.ndarray]:
        op: Any = self.x
        for w in self.ws:
            op = kernels.gemm(op, w)
        return api.to_host(op)

    def capture(self, stream: deviceops.Stream) -> None:
        n = self.xh.shape[0]
        bufs = [api.empty((n, n), "float16").sync_on(stream) for _ in self.ws]

        def chain() -> Any:
            op: Any = self.x
            for w, b in zip(self.ws, bufs, strict=True):
                op = kernels.gemm(op, w, out=b)
            return op

        chain().sync_on(stream)  # a warm-up: compiles, and reserves the stream's workspace
        self.graph = chain().graph_on(stream)

    def replay(self) -> deviceops.DeviceOp[np.ndarray]:
        return api.to_host(self.graph.launch_op())

    def check(self, got: np.ndarray, what: str) -> None:
        check_close(got, self.want, what, rtol=2e-2)


class BigJob:
    """A big job's inputs (shared by the big tenants: read only) and its chain."""

    def __init__(self, rng: np.random.Generator, n: int, k: int) -> None:
        self.n, self.k = n, k
        self.ah = rng.standard_normal((n, n), dtype=np.float32).astype(np.float16)
        self.wh = (rng.standard_normal((n, n), dtype=np.float32) / np.sqrt(n)).astype(np.float16)
        self.a = api.from_host(self.ah).sync()
        self.w = api.from_host(self.wh).sync()

    def op(self) -> deviceops.DeviceOp[deviceops.Tensor]:
        op: Any = self.a
        for _ in range(self.k):
            op = kernels.gemm(op, self.w)
        return op


# -- deviceops ----------------------------------------------------------------------------------
def ours_alone(small: SmallJob, bigs: dict[int, BigJob], cfg: Config) -> dict[str, float]:
    """Solo costs: small jobs one at a time with sync() (eager and graph), big jobs likewise."""
    out: dict[str, float] = {}
    for mode in ("eager", "graph"):
        make = small.eager if mode == "eager" else small.replay
        for _ in range(20):
            make().sync()
        lat: list[float] = []
        end = perf() + cfg.seconds
        while perf() < end:
            t0 = perf()
            got = make().sync()
            lat.append(perf() - t0)
        small.check(got, f"small job ({mode}, alone)")
        out[f"small_{mode}_s"] = float(np.mean(lat))
        out[f"small_{mode}_p50"] = pct(lat, 50)
        out[f"small_{mode}_p99"] = pct(lat, 99)
    for n, big in bigs.items():
        big.op().sync()
        times = []
        t_end = perf() + max(1.0, cfg.seconds / 4)
        while perf() < t_end or len(times) < 3:
            t0 = perf()
            big.op().sync()
            times.append(perf() - t0)
        out[f"big{n}_s"] = float(np.mean(times))
    return out


async def ours_scenario(pool: TenantPool, smalls: list[SmallJob], big: BigJob | None, mode: str,
                        cfg: Config, tenants: dict[str, list[Any]]) -> Tally:
    tally = Tally()
    loop = asyncio.get_running_loop()
    start = loop.time() + cfg.warm
    stop = start + cfg.seconds

    async def small_loop(i: int, job: SmallJob) -> None:
        make = job.replay if mode == "graph" else job.eager
        with deviceops.using(tenants["small_plain" if mode == "plain" else "small"][i]):
            while True:
                t0 = loop.time()
                got = await make()
                t1 = loop.time()
                if t1 > stop:
                    return
                job.jobs += 1
                if job.jobs % CHECK_EVERY == 1:
                    job.check(got, f"small job ({mode}, {len(smalls)} tenants)")
                if t0 >= start:
                    tally.small += 1
                    tally.small_lat.append(t1 - t0)

    async def big_loop(i: int) -> None:
        assert big is not None
        with deviceops.using(tenants["big"][i]):
            while True:
                t0 = loop.time()
                await big.op()
                t1 = loop.time()
                if t1 > stop:
                    return
                if t0 >= start:
                    tally.big += 1

    async def ticker() -> None:
        """The loop's longest stall: a 1 ms sleep that came back late (a blocked loop
        delays every tenant's wake-up at once)."""
        gap = 0.0
        while True:
            t0 = loop.time()
            STALLS.tick = perf()
            await asyncio.sleep(1e-3)
            t1 = loop.time()
            if t1 > stop:
                tally.loop_gap = gap
                return
            if t0 >= start:
                gap = max(gap, t1 - t0 - 1e-3)

    tasks = [small_loop(i, j) for i, j in enumerate(smalls)]
    if big is not None:
        tasks += [big_loop(i) for i in range(cfg.big_tenants)]
    STALLS.start(threading.get_ident())
    try:
        await asyncio.gather(ticker(), *tasks)
    finally:
        STALLS.stop()
    tally.window = cfg.seconds
    return tally


class Stalls:
    """``--stall-stacks MS``: a watchdog thread that, when the event loop has not ticked for
    ``MS`` ms, samples the loop thread's stack (once per stall) and counts the stacks."""

    def __init__(self) -> None:
        self.limit = 0.0
        self.tick = 0.0
        self.seen: dict[str, int] = {}
        self.gc_pauses: list[tuple[int, float]] = []  # (generation, seconds)
        self._gc0 = 0.0
        self._run = False
        self._thread: threading.Thread | None = None

    def _gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc0 = perf()
        else:
            self.gc_pauses.append((int(info.get("generation", -1)), perf() - self._gc0))

    def start(self, ident: int) -> None:
        if self.limit <= 0:
            return
        import gc

        gc.callbacks.append(self._gc)
        self.tick = perf()
        self._run = True

        def watch() -> None:
            import sys
            import traceback

            flagged = 0.0
            while self._run:
                time.sleep(self.limit / 4)
                t = self.tick
                if perf() - t > self.limit and t != flagged:
                    flagged = t
                    frame = sys._current_frames().get(ident)
                    if frame is not None:
                        stack = "".join(traceback.format_stack(frame)[-12:])
                        self.seen[stack] = self.seen.get(stack, 0) + 1

        self._thread = threading.Thread(target=watch, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        import gc

        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)
        self._run = False
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def report(self) -> None:
        if self.limit <= 0:
            return
        long = [(g, t) for g, t in self.gc_pauses if t > self.limit]
        print(f"# garbage collections in the scenarios: {len(self.gc_pauses)}, longest "
              f"{max((t for _, t in self.gc_pauses), default=0) * 1e3:.1f} ms; longer than "
              f"{self.limit * 1e3:.0f} ms: {[(g, round(t * 1e3, 1)) for g, t in long]}")
        for stack, n in sorted(self.seen.items(), key=lambda kv: -kv[1])[:5]:
            print(f"# loop stalled > {self.limit * 1e3:.0f} ms {n} time(s) here:\n{stack}")


STALLS = Stalls()


# -- torch ----------------------------------------------------------------------------------------
class Torch:
    """The same jobs in torch: one thread and one CUDA stream per tenant."""

    def __init__(self, smalls: list[SmallJob], bigs: dict[int, BigJob]) -> None:
        import torch

        self.torch = torch
        dev = torch.device("cuda", deviceops.default_device().index)
        self.smalls = [(torch.from_numpy(s.xh).to(dev), [torch.from_numpy(w).to(dev) for w in s.wh])
                       for s in smalls]
        self.bigs = {n: (torch.from_numpy(b.ah).to(dev), torch.from_numpy(b.wh).to(dev), b.k)
                     for n, b in bigs.items()}
        torch.cuda.synchronize()

    def small(self, i: int) -> np.ndarray:
        y, ws = self.smalls[i]
        for w in ws:
            y = y @ w
        return y.cpu().numpy()

    def big(self, n: int) -> Any:
        a, w, k = self.bigs[n]
        y = a
        for _ in range(k):
            y = y @ w
        return y

    def alone(self, cfg: Config) -> dict[str, float]:
        torch = self.torch
        out: dict[str, float] = {}
        for _ in range(20):
            self.small(0)
        lat = []
        end = perf() + cfg.seconds
        while perf() < end:
            t0 = perf()
            self.small(0)
            lat.append(perf() - t0)
        out["small_s"], out["small_p50"], out["small_p99"] = float(np.mean(lat)), pct(lat, 50), pct(lat, 99)
        for n in self.bigs:
            self.big(n)
            torch.cuda.synchronize()
            times = []
            t_end = perf() + max(1.0, cfg.seconds / 4)
            while perf() < t_end or len(times) < 3:
                t0 = perf()
                self.big(n)
                torch.cuda.synchronize()
                times.append(perf() - t0)
            out[f"big{n}_s"] = float(np.mean(times))
        return out

    def scenario(self, smalls: list[SmallJob], big_n: int | None, cfg: Config) -> Tally:
        torch = self.torch
        tally = Tally()
        lock = threading.Lock()
        start = perf() + cfg.warm + 0.3  # threads start within the extra 0.3 s
        stop = start + cfg.seconds

        def small_loop(i: int) -> None:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                n = 0
                while True:
                    t0 = perf()
                    got = self.small(i)
                    t1 = perf()
                    if t1 > stop:
                        return
                    n += 1
                    if n % CHECK_EVERY == 1:
                        smalls[i].check(got, "torch small job")
                    if t0 >= start:
                        with lock:
                            tally.small += 1
                            tally.small_lat.append(t1 - t0)

        def big_loop() -> None:
            assert big_n is not None
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                while True:
                    t0 = perf()
                    self.big(big_n)
                    s.synchronize()
                    t1 = perf()
                    if t1 > stop:
                        return
                    if t0 >= start:
                        with lock:
                            tally.big += 1

        threads = [threading.Thread(target=small_loop, args=(i,)) for i in range(len(smalls))]
        if big_n is not None:
            threads += [threading.Thread(target=big_loop) for _ in range(cfg.big_tenants)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        tally.window = cfg.seconds
        return tally


# -- the run ---------------------------------------------------------------------------------------
def row(scenario: str, lib: str, mode: str, t: Tally, solo: dict[str, float], big_n: int | None,
        ours_solo: dict[str, float], small_key: str) -> dict[str, Any]:
    def work(costs: dict[str, float], key: str) -> float:
        w = t.small * costs[key]
        if big_n is not None:
            w += t.big * costs[f"big{big_n}_s"]
        return w / t.window

    lat = t.small_lat
    return {
        "scenario": scenario, "lib": lib, "mode": mode,
        "small_jobs_s": t.small / t.window, "big_jobs_s": t.big / t.window,
        "small_p50_ms": pct(lat, 50) * 1e3 if lat else None,
        "small_p99_ms": pct(lat, 99) * 1e3 if lat else None,
        "work_x": work(solo, small_key),
        "work_ours_units": work(ours_solo, "small_eager_s"),
        "loop_gap_ms": None if t.loop_gap is None else t.loop_gap * 1e3,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--seconds", type=float, default=None, help="measured window of each scenario")
    p.add_argument("--modes", default="eager,plain,graph",
                   help="small-job modes: eager (the tenants replay a repeated job as a graph "
                        "by themselves: auto_graph), plain (auto_graph off), graph (captured "
                        "by hand)")
    p.add_argument("--no-torch", action="store_true", help="leave torch out")
    p.add_argument("--scenarios", default=None,
                   help="comma-separated subset of small48,mixed4096,mixed8192 (default: all)")
    p.add_argument("--stall-stacks", type=float, default=0.0, metavar="MS",
                   help="sample the event loop's stack whenever it stalls longer than MS ms "
                        "(a diagnosis: printed after the table)")
    args = p.parse_args()
    STALLS.limit = args.stall_stacks * 1e-3
    b: Bench = setup(args)
    cfg = Config()
    if b.smoke:
        cfg = Config(small_n=32, big_sizes=(64, 96), small_tenants=4, big_tenants=1, seconds=0.3,
                     warm=0.1)
    if args.seconds is not None:
        cfg.seconds = args.seconds
    modes = [m for m in args.modes.split(",") if m]
    rng = np.random.default_rng(48)
    dev = b.device
    smalls = [SmallJob(rng, cfg.small_n, cfg.small_gemms) for _ in range(cfg.small_tenants)]
    bigs = {n: BigJob(rng, n, cfg.big_gemms) for n in cfg.big_sizes}
    pool = TenantPool([dev], streams_per_priority=4)
    tenants = {"small": [pool.tenant(f"small{i}", priority="high", max_queued=2) for i in range(len(smalls))],
               "small_plain": [pool.tenant(f"plain{i}", priority="high", max_queued=2, auto_graph=False)
                               for i in range(len(smalls))],
               "big": [pool.tenant(f"big{i}", priority="low", max_queued=1) for i in range(cfg.big_tenants)]}
    for s, t in zip(smalls, tenants["small"], strict=True):
        s.capture(t.streams[0])
    torch_ = None
    if b.is_cuda and not args.no_torch:
        try:
            torch_ = Torch(smalls, bigs)
        except ImportError:
            print("# torch is not installed: deviceops only")
    print(f"# {cfg}; CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS')}", flush=True)
    # correctness of the big chains, once each (float64 on the smoke sizes, else torch)
    for n, big in bigs.items():
        got = np.asarray(big.op().sync().to_host().sync(), np.float64)
        if torch_ is not None:
            want = torch_.big(n).float().cpu().numpy()
            check_close(got, want, f"big job {n}^3 vs torch", rtol=3e-2)
        elif n <= 256:
            want = ref_chain(big.ah, [big.wh] * big.k)
            check_close(got, want, f"big job {n}^3 vs float64", rtol=3e-2)
    solo = ours_alone(smalls[0], bigs, cfg)
    print("# deviceops alone: " + ", ".join(f"{k}={v * 1e3:.3f} ms" for k, v in solo.items()), flush=True)
    tsolo = torch_.alone(cfg) if torch_ is not None else None
    if tsolo:
        print("# torch alone: " + ", ".join(f"{k}={v * 1e3:.3f} ms" for k, v in tsolo.items()), flush=True)
    rows: list[dict[str, Any]] = []
    rows.append({"scenario": "alone", "lib": "deviceops", "mode": "eager (sync)",
                 "small_jobs_s": 1 / solo["small_eager_s"], "big_jobs_s": None,
                 "small_p50_ms": solo["small_eager_p50"] * 1e3, "small_p99_ms": solo["small_eager_p99"] * 1e3,
                 "work_x": 1.0, "work_ours_units": 1.0})
    rows.append({"scenario": "alone", "lib": "deviceops", "mode": "graph (sync)",
                 "small_jobs_s": 1 / solo["small_graph_s"], "big_jobs_s": None,
                 "small_p50_ms": solo["small_graph_p50"] * 1e3, "small_p99_ms": solo["small_graph_p99"] * 1e3,
                 "work_x": solo["small_eager_s"] / solo["small_graph_s"], "work_ours_units": None})
    if tsolo:
        rows.append({"scenario": "alone", "lib": "torch", "mode": "eager (sync)",
                     "small_jobs_s": 1 / tsolo["small_s"], "big_jobs_s": None,
                     "small_p50_ms": tsolo["small_p50"] * 1e3, "small_p99_ms": tsolo["small_p99"] * 1e3,
                     "work_x": 1.0, "work_ours_units": solo["small_eager_s"] / tsolo["small_s"]})
    scenarios: list[tuple[str, int | None]] = [(f"small{len(smalls)}", None)]
    scenarios += [(f"mixed{n}", n) for n in cfg.big_sizes]
    if args.scenarios:
        keep = set(args.scenarios.split(","))
        scenarios = [sc for sc in scenarios if sc[0] in keep]
    for name, big_n in scenarios:
        big = bigs[big_n] if big_n is not None else None
        for mode in modes:
            t = asyncio.run(ours_scenario(pool, smalls, big, mode, cfg, tenants))
            rows.append(row(name, "deviceops", mode, t, solo, big_n, solo, "small_eager_s"))
            print(f"  {name} deviceops {mode}: {rows[-1]['small_jobs_s']:.0f} small/s, "
                  f"{rows[-1]['big_jobs_s']:.1f} big/s, work {rows[-1]['work_x']:.2f}x", flush=True)
        if torch_ is not None and tsolo is not None:
            t = torch_.scenario(smalls, big_n, cfg)
            rows.append(row(name, "torch", "threads", t, tsolo, big_n, solo, "small_s"))
            print(f"  {name} torch: {rows[-1]['small_jobs_s']:.0f} small/s, "
                  f"{rows[-1]['big_jobs_s']:.1f} big/s, work {rows[-1]['work_x']:.2f}x", flush=True)
    print()
    print(table(rows, [("scenario", "scenario", 0), ("lib", "lib", 0), ("mode", "mode", 0),
                       ("small_jobs_s", "small jobs/s", 0), ("big_jobs_s", "big jobs/s", 2),
                       ("small_p50_ms", "small p50 ms", 2), ("small_p99_ms", "small p99 ms", 2),
                       ("work_x", "work x", 2), ("work_ours_units", "work (our units)/s", 2),
                       ("loop_gap_ms", "loop stall ms", 2)]))
    bars = make_bars(rows, modes, cfg, len(smalls))
    print_bars(bars, b)
    STALLS.report()
    write_json(args.json, "tenants", b, {**cfg.__dict__, "modes": modes,
               "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")},
               rows, bars, {"solo": solo, "torch_solo": tsolo})
    return 0


def make_bars(rows: list[dict[str, Any]], modes: list[str], cfg: Config, n_small: int) -> list[Bar]:
    def get(scenario: str, lib: str, mode: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["scenario"] == scenario and r["lib"] == lib and r["mode"] == mode), None)

    alone = get("alone", "deviceops", "eager (sync)")
    assert alone is not None
    bars: list[Bar] = []
    small_name = f"small{n_small}"
    for mode in modes:
        s48 = get(small_name, "deviceops", mode)
        if s48 is None:
            continue
        bars.append(Bar(f"{small_name} {mode}: jobs/s over sync() one at a time", s48["small_jobs_s"] / alone["small_jobs_s"],
                        ">=", 3.0, "x"))
        bars.append(Bar(f"{small_name} {mode}: small p50", s48["small_p50_ms"], "<=", 2.0, "ms"))
        for n in cfg.big_sizes:
            mx = get(f"mixed{n}", "deviceops", mode)
            if mx is None:
                continue
            bars.append(Bar(f"mixed{n} {mode}: work over one at a time", mx["work_x"], ">=", 2.0, "x"))
            tm = get(f"mixed{n}", "torch", "threads")
            if tm is not None:
                bars.append(Bar(f"mixed{n} {mode}: work over torch (our units)",
                                mx["work_ours_units"] / tm["work_ours_units"], ">=", 1.2, "x"))
        big_n = max(cfg.big_sizes)
        mx = get(f"mixed{big_n}", "deviceops", mode)
        if mx is not None and s48["small_p99_ms"]:
            bars.append(Bar(f"mixed{big_n} {mode}: small p99 over its p99 in {small_name}",
                            mx["small_p99_ms"] / s48["small_p99_ms"], "<=", 2.0, "x"))
    return bars


if __name__ == "__main__":
    main_guard(main)
