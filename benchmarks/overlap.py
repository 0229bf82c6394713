"""Do independent ``zip`` branches overlap? StreamPoolRoundRobin vs SingleStream.

Usage::

    python benchmarks/overlap.py [--smoke] [--json PATH] [--trace PATH] [--ms T]

Each branch is a ``slow_copy`` (a kernel that spins for about T on the device,
then copies 256 floats: ~2 ms on a GPU; 10 ms of ``time.sleep`` on the cpu
backend in smoke mode). For n = 2, 4, 8 branches, ``deviceops.zip(*branches)``
is enqueued with ``async_on`` on a stream of the policy under
``deviceops.using(policy)``:

* ``StreamPoolRoundRobin(num_streams=8)``: branches on distinct streams; ideal T;
* ``SingleStream``: branches in order on one stream; ideal n*T.

T is measured alone (one branch, same path) in the same run; every run is timed
on the host from enqueue to ``synchronize()`` (on cuda also between CUDA events
on the home stream, which the fork and join surround). Reported: elapsed,
elapsed/T, efficiency = n*T/elapsed, and elapsed over the ideal. Outputs are
poisoned with NaN before and checked after every run. One overlapped run
(n=8, round robin) is traced with ``deviceops.trace()``; the trace must show
n distinct streams whose device intervals overlap; ``--trace PATH`` saves it.

Bars: 2 branches <= 1.3 T under round robin; ~2 T (+-0.2 T) under SingleStream.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _common import (
    Bar,
    Bench,
    EventTimer,
    add_common_args,
    check,
    check_equal,
    download,
    interleave,
    main_guard,
    median,
    pct,
    print_bars,
    setup,
    table,
    upload,
    write_json,
)

import deviceops
from deviceops import api
from deviceops.kernels.testing import slow_copy
from deviceops.scheduling import SingleStream, StreamPoolRoundRobin

ELEMS = 256
BRANCHES = (2, 4, 8)
POOL = 8


class Case:
    """Inputs, outputs and the two policies."""

    def __init__(self, b: Bench, delay_s: float) -> None:
        rng = np.random.default_rng()
        self.b = b
        self.delay_s = delay_s
        self.aux = b.device.new_stream()
        self.src_h = [rng.standard_normal(ELEMS).astype(np.float32) for _ in range(max(BRANCHES))]
        self.srcs = [upload(x, self.aux) for x in self.src_h]
        self.dsts = [api.empty(ELEMS).sync_on(self.aux) for _ in range(max(BRANCHES))]
        self.nan = upload(np.full(ELEMS, np.nan, np.float32), self.aux)
        self.policies: dict[str, deviceops.SchedulingPolicy] = {
            "round_robin": StreamPoolRoundRobin(b.device, num_streams=POOL),
            "single": SingleStream(b.device.new_stream()),
        }
        self.dev_times: dict[str, list[float]] = {}

    def poison(self, n: int) -> None:
        for d in self.dsts[:n]:
            api.memcpy(d, self.nan).async_on(self.aux)
        self.aux.synchronize()
        self.b.sync_all()

    def verify(self, n: int, what: str) -> None:
        for i in range(n):
            check_equal(download(self.dsts[i], self.aux), self.src_h[i], f"{what}: branch {i} output")

    def runner(self, key: str, policy: str, n: int) -> Callable[[], None]:
        pol = self.policies[policy]
        cp = self.b.cupy
        self.dev_times[key] = []

        def run() -> None:
            home = pol.next_stream()
            timer = EventTimer(cp, getattr(home, "native", None)) if cp is not None else None
            with deviceops.using(pol):
                if timer:
                    timer.begin()
                op = deviceops.zip(*[slow_copy(self.dsts[i], self.srcs[i], self.delay_s) for i in range(n)])
                op.async_on(home)
                if timer:
                    timer.end()
                home.synchronize()
            if timer:
                self.dev_times[key].append(timer.seconds())

        return run


def traced_run(case: Case, n: int, path: str | None) -> dict[str, Any]:
    """One overlapped run under ``deviceops.trace()``: distinct streams, overlapping intervals."""
    case.poison(n)
    pol = case.policies["round_robin"]
    home = pol.next_stream()
    with deviceops.trace() as t, deviceops.using(pol):
        deviceops.zip(*[slow_copy(case.dsts[i], case.srcs[i], case.delay_s) for i in range(n)]).async_on(home)
        home.synchronize()
    case.verify(n, "traced run")
    recs = [r for r in t.records if r.name == "slow_copy"]
    check(len(recs) == n, f"trace: {len(recs)} slow_copy records for {n} branches")
    check(all(r.start is not None and r.end is not None for r in recs), "trace: device times resolved")
    streams = {r.stream for r in recs}
    starts = [float(r.start) for r in recs if r.start is not None]
    ends = [float(r.end) for r in recs if r.end is not None]
    common = min(ends) - max(starts)  # > 0: one instant where all branches ran at once
    span = max(ends) - min(starts)
    if path:
        t.save(path)
        print(f"# trace written to {path} (open in https://ui.perfetto.dev)")
    return {"branches": n, "streams": len(streams), "all_overlap": common > 0,
            "common_ms": common * 1e3, "span_ms": span * 1e3, "saved": path}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--ms", type=float, default=None, help="branch length T in ms (cuda 2; cpu 10, smoke 10)")
    p.add_argument("--samples", type=int, default=None, help="runs per configuration (15; smoke 2)")
    p.add_argument("--trace", metavar="PATH", default=None, help="save the traced overlapped run (Chrome JSON)")
    args = p.parse_args()
    b = setup(args)
    delay_ms = args.ms or (2.0 if b.is_cuda else 10.0)
    samples = args.samples or (2 if args.smoke else 15)
    case = Case(b, delay_ms * 1e-3)

    variants: dict[str, Callable[[], Any]] = {"alone": case.runner("alone", "round_robin", 1)}
    nb: dict[str, int] = {"alone": 1}
    for n in BRANCHES:
        for pol in ("round_robin", "single"):
            key = f"{pol}/{n}"
            variants[key] = case.runner(key, pol, n)
            nb[key] = n

    def after(key: str, _: Any) -> None:
        case.verify(nb[key], key)

    t0 = time.perf_counter()
    times = interleave(variants, samples, warmup=1, before=lambda k: case.poison(nb[k]), after=after)
    wall = time.perf_counter() - t0
    trace_info = traced_run(case, max(BRANCHES), args.trace)

    T = median(times["alone"])
    T_dev = median(case.dev_times["alone"][-samples:]) if b.is_cuda else None
    rows: list[dict[str, Any]] = [{"policy": "one branch (T)", "n": 1, "elapsed_ms": T * 1e3,
                                   "p90_ms": pct(times["alone"], 90) * 1e3,
                                   "gpu_ms": None if T_dev is None else T_dev * 1e3,
                                   "over_T": 1.0, "efficiency": 1.0, "ideal_ms": delay_ms,
                                   "vs_ideal": T * 1e3 / delay_ms}]
    for n in BRANCHES:
        for pol, label in (("round_robin", f"RoundRobin({POOL})"), ("single", "SingleStream")):
            key = f"{pol}/{n}"
            e = median(times[key])
            e_dev = median(case.dev_times[key][-samples:]) if b.is_cuda else None
            ideal = T if pol == "round_robin" else n * T
            rows.append({"policy": label, "n": n, "elapsed_ms": e * 1e3, "p90_ms": pct(times[key], 90) * 1e3,
                         "gpu_ms": None if e_dev is None else e_dev * 1e3,
                         "gpu_over_T": None if e_dev is None or T_dev is None else e_dev / T_dev,
                         "over_T": e / T, "efficiency": n * T / e, "ideal_ms": ideal * 1e3,
                         "vs_ideal": e / ideal})

    print()
    print(f"zip of n slow_copy branches of T (asked {delay_ms:g} ms, measured alone {T * 1e3:.3f} ms); "
          f"median of {samples} runs, host-timed enqueue..synchronize")
    print(table(rows, [("policy", "policy", 0), ("n", "n", 0), ("elapsed_ms", "elapsed ms", 3),
                       ("p90_ms", "p90", 3), ("gpu_ms", "gpu ms", 3), ("over_T", "elapsed/T", 2),
                       ("efficiency", "n*T/elapsed", 2), ("ideal_ms", "ideal ms", 3),
                       ("vs_ideal", "vs ideal", 2)]))
    print(f"trace (n={trace_info['branches']}, round robin): {trace_info['streams']} streams, "
          f"all branches overlap: {'yes' if trace_info['all_overlap'] else 'no'} "
          f"(common {trace_info['common_ms']:.3f} ms of a {trace_info['span_ms']:.3f} ms span)")
    print(f"# {wall:.1f} s of timed runs")

    def over(policy: str, n: int) -> float:
        return next(r["over_T"] for r in rows if r["policy"] == policy and r["n"] == n)

    rr = f"RoundRobin({POOL})"
    bars = [Bar("2 branches, round robin: elapsed/T", over(rr, 2), "<=", 1.3, "T"),
            Bar("2 branches, SingleStream: elapsed/T", over("SingleStream", 2), "~", 2.0, "T", tol=0.2),
            Bar(f"traced {trace_info['branches']} branches on distinct streams",
                float(trace_info["streams"]), ">=", float(trace_info["branches"]))]
    print_bars(bars, b)
    write_json(args.json, "overlap", b,
               {"delay_ms": delay_ms, "elems": ELEMS, "branches": list(BRANCHES), "pool": POOL,
                "samples": samples, "T_ms": T * 1e3},
               rows, bars, {"trace": trace_info})
    return 0


if __name__ == "__main__":
    main_guard(main)
