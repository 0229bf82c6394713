"""Where a small job's host time goes: the 4-GEMM chain of ``benchmarks/tenants.py``.

    python3 tools/job_cost.py [--n 256] [--jobs 3000] [--profile] [--tenants 48]

Prints, for the job built as a user would (``api.to_host(gemm(gemm(...)))``):

* build: constructing the DAG only (nothing scheduled);
* sync: build + ``sync()`` one at a time (median, µs);
* torch: the same chain in torch + ``.cpu()`` (median, µs), same process;
* await: ``--tenants`` asyncio tasks awaiting such jobs (jobs/s, p50 ms);

and with ``--profile`` the top functions (cProfile, tottime) of the ``sync()`` loop and of
the awaiting tenants, which is what to cut.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import pstats
import time
import warnings
from typing import Any

import numpy as np

import deviceops
from deviceops import api, kernels


def phases(x: Any, ws: list[Any], jobs: int) -> None:
    """The job's parts apart: host time to enqueue the chain, GPU time of the chain (events),
    the whole chain with ``sync_on``, and the read-back alone."""
    dev = deviceops.default_device()
    s = dev.new_stream()

    def chain() -> Any:
        op: Any = x
        for w in ws:
            op = kernels.gemm(op, w)
        return op

    for _ in range(20):
        chain().sync_on(s)
    host, total, gpu = [], [], []
    try:
        import cupy as cp

        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    except ImportError:
        cp = None
    for _ in range(jobs):
        t0 = time.perf_counter()
        if cp is not None:
            e0.record(s.native)
        out = chain().async_on(s)
        if cp is not None:
            e1.record(s.native)
        t1 = time.perf_counter()
        s.synchronize()
        t2 = time.perf_counter()
        host.append(t1 - t0)
        total.append(t2 - t0)
        if cp is not None:
            gpu.append(cp.cuda.get_elapsed_time(e0, e1) * 1e-3)
    t = out
    back = []
    for _ in range(jobs):
        t0 = time.perf_counter()
        api.to_host(t).sync_on(s)
        back.append(time.perf_counter() - t0)
    med = lambda v: float(np.median(v)) * 1e6 if v else float("nan")  # noqa: E731
    print(f"chain of {len(ws)} gemms: enqueue (host) {med(host):.1f} µs, GPU (events) {med(gpu):.1f} µs, "
          f"enqueue + synchronize {med(total):.1f} µs; to_host alone + sync {med(back):.1f} µs")


def captured(x: Any, ws: list[Any]) -> Any:
    """A job replaying the chain captured once into its own buffers (``--graph``)."""
    s = deviceops.default_device().new_stream()
    bufs = [api.empty(tuple(x.shape), "float16").sync_on(s) for _ in ws]

    def chain() -> Any:
        op: Any = x
        for w, b in zip(ws, bufs, strict=True):
            op = kernels.gemm(op, w, out=b)
        return op

    chain().sync_on(s)
    g = chain().graph_on(s)
    return lambda: api.to_host(g.launch_op())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--jobs", type=int, default=3000)
    p.add_argument("--tenants", type=int, default=48)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--graph", action="store_true",
                   help="the awaiting tenants replay a graph of the chain each (captured once)")
    a = p.parse_args()
    rng = np.random.default_rng(0)
    n = a.n
    xh = rng.standard_normal((n, n), dtype=np.float32).astype(np.float16)
    whs = [(rng.standard_normal((n, n), dtype=np.float32) / np.sqrt(n)).astype(np.float16) for _ in range(4)]
    x = api.from_host(xh).sync()
    ws = [api.from_host(w).sync() for w in whs]

    def job() -> deviceops.DeviceOp[np.ndarray]:
        op: Any = x
        for w in ws:
            op = kernels.gemm(op, w)
        return api.to_host(op)

    for _ in range(50):
        job().sync()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the built ops are dropped unrun on purpose
        t0 = time.perf_counter()
        for _ in range(a.jobs):
            job()
    build = (time.perf_counter() - t0) / a.jobs

    lat = []
    for _ in range(a.jobs):
        t0 = time.perf_counter()
        job().sync()
        lat.append(time.perf_counter() - t0)
    print(f"build only: {build * 1e6:.1f} µs/job; build + sync(): median {np.median(lat) * 1e6:.1f} µs, "
          f"p99 {np.percentile(lat, 99) * 1e6:.1f} µs")

    phases(x, ws, a.jobs)

    try:
        import torch

        dev = torch.device("cuda", deviceops.default_device().index)
        tx = torch.from_numpy(xh).to(dev)
        tws = [torch.from_numpy(w).to(dev) for w in whs]

        def tjob() -> Any:
            y = tx
            for w in tws:
                y = y @ w
            return y.cpu()

        for _ in range(50):
            tjob()
        tl = []
        for _ in range(a.jobs):
            t0 = time.perf_counter()
            tjob()
            tl.append(time.perf_counter() - t0)
        print(f"torch chain + .cpu(): median {np.median(tl) * 1e6:.1f} µs")
    except Exception as e:  # torch is optional here
        print(f"torch: not run ({e})")

    if a.profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.jobs):
            job().sync()
        pr.disable()
        print("\n== sync() loop, top 35 by tottime ==")
        pstats.Stats(pr).sort_stats("tottime").print_stats(35)

    async def tenants(prof: cProfile.Profile | None) -> tuple[int, list[float]]:
        loop = asyncio.get_running_loop()
        stop = loop.time() + a.seconds
        done = 0
        lats: list[float] = []

        async def one(make: Any) -> None:
            nonlocal done
            while loop.time() < stop:
                t0 = loop.time()
                await make()
                lats.append(loop.time() - t0)
                done += 1

        if prof:
            prof.enable()
        await asyncio.gather(*[one(m) for m in makers])
        if prof:
            prof.disable()
        return done, lats

    makers: list[Any] = [job] * a.tenants
    if a.graph:
        makers = [captured(x, ws) for _ in range(a.tenants)]
    pauses: list[float] = []
    began = [0.0]

    def gc_cb(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - began[0])

    asyncio.run(tenants(None))
    gc.callbacks.append(gc_cb)
    done, lats = asyncio.run(tenants(None))
    gc.callbacks.remove(gc_cb)
    print(f"{a.tenants} awaiting tenants: {done / a.seconds:.0f} jobs/s, p50 {np.median(lats) * 1e3:.2f} ms, "
          f"p99 {np.percentile(lats, 99) * 1e3:.2f} ms; GC: {len(pauses)} collections, "
          f"{sum(pauses) * 1e3:.1f} ms in all, longest {max(pauses, default=0) * 1e3:.2f} ms")
    if a.profile:
        pr = cProfile.Profile()
        asyncio.run(tenants(pr))
        print(f"\n== {a.tenants} awaiting tenants, top 45 by tottime ==")
        pstats.Stats(pr).sort_stats("tottime").print_stats(45)
        print(f"\n== {a.tenants} awaiting tenants, top 40 by cumulative time ==")
        pstats.Stats(pr).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
