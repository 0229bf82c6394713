"""Section 1 of ``benchmarks/multi_gpu.py``, zip over GPUs: :class:`ChainSet` (one chain of
float16 GEMMs with its inputs and float64 references on one device), :func:`rel_err` and
:func:`zip_section`, which times two chains zipped over two devices beside both on one and
one alone, checking every output, and prints the zip table."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

from _common import Bench, interleave, median, pct, table
from _multi_gpu_checks import Checks
from _multi_gpu_devices import finish, on, xp_of

import deviceops
from deviceops import api, kernels
from deviceops.scheduling import MultiDeviceRoundRobin

ZIP_BAR = 0.55
CHAIN_TOL = 1e-2  # fp16 outputs rounded at each of the chain's steps: ~sqrt(steps) * 3e-4


# -- 1. zip over GPUs ------------------------------------------------------------------------
class ChainSet:
    """One chain's inputs on one device: two ``x`` (rotated) and ``steps`` weights."""

    def __init__(self, dev: deviceops.Device, xs: list[deviceops.Tensor], ws: list[deviceops.Tensor]) -> None:
        self.dev = dev
        self.xs = xs
        self.ws = ws
        self.refs: list[Any] = []

    @classmethod
    def random(cls, dev: deviceops.Device, n: int, steps: int) -> ChainSet:
        s = dev.new_stream()
        xs = [api.randn((n, n), deviceops.float16).sync_on(s) for _ in range(2)]
        ws = [api.randn((n, n), deviceops.float16).sync_on(s) for _ in range(steps)]
        return cls(dev, xs, ws)

    def copied_to(self, dev: deviceops.Device) -> ChainSet:
        """The same values on ``dev`` (``api.to_device``, set-up only)."""
        s = dev.new_stream()
        return ChainSet(dev, [api.to_device(x, dev).sync_on(s) for x in self.xs],
                        [api.to_device(w, dev).sync_on(s) for w in self.ws])

    def op(self, k: int, alpha: float) -> deviceops.DeviceOp[deviceops.Tensor]:
        """The chain as a user builds it: each GEMM allocates its output."""
        op = kernels.gemm(self.xs[k], self.ws[0], alpha=alpha)
        for w in self.ws[1:]:
            op = kernels.gemm(op, w, alpha=alpha)
        return op

    def make_refs(self, cp: Any, alpha: float, corrupt: bool) -> None:
        """float64 references of both ``x`` on this set's device (``corrupt``: last step dropped)."""
        xp = xp_of(self.dev)
        ws = self.ws[:-1] if corrupt else self.ws
        with on(self.dev, cp):
            self.refs = []
            for x in self.xs:
                y = x.array.astype(xp.float64)
                for w in ws:
                    y = (y @ w.array.astype(xp.float64)) * alpha
                self.refs.append(y)
            if cp is not None and not self.dev.is_cpu:
                cp.cuda.Device(self.dev.index).synchronize()


def rel_err(t: deviceops.Tensor, ref: Any, cp: Any) -> float:
    """||t - ref|| / ||ref|| in float64 on ``t``'s device; NaN when ``t`` is not finite."""
    dev = t.device
    xp = xp_of(dev)
    with on(dev, cp):
        a = t.array
        if not bool(xp.isfinite(a).all()):
            return float("nan")
        num = float(xp.linalg.norm(a.astype(xp.float64) - ref))
        den = float(xp.linalg.norm(ref))
    return num / den if den > 0 else float("inf")


def zip_section(b: Bench, devs: list[deviceops.Device], n: int, steps: int, reps: int,
                checks: Checks, corrupt: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    cp = b.cupy
    d0, d1 = devs
    alpha = 1.0 / math.sqrt(n)
    t0 = time.perf_counter()
    A = ChainSet.random(d0, n, steps)   # chain 0, on d0 (both runs)
    B = ChainSet.random(d1, n, steps)   # chain 1, on d1 (multi run)
    Bc = B.copied_to(d0)                # chain 1's values on d0 (single-device reference)
    finish(devs)
    for s in (A, B, Bc):
        s.make_refs(cp, alpha, corrupt)
    print(f"# zip set-up (inputs + float64 references): {time.perf_counter() - t0:.1f} s", flush=True)
    multi = MultiDeviceRoundRobin([d0, d1])
    turn = {"alone": 0, "single": 0, "multi": 0}

    def run_alone() -> Any:
        k = turn["alone"] = turn["alone"] ^ 1
        return k, (A.op(k, alpha).sync(),)

    def run_single() -> Any:
        k = turn["single"] = turn["single"] ^ 1
        return k, deviceops.zip(A.op(k, alpha), Bc.op(k, alpha)).sync()

    def run_multi() -> Any:
        k = turn["multi"] = turn["multi"] ^ 1
        with deviceops.using(multi):
            return k, deviceops.zip(A.op(k, alpha), B.op(k, alpha)).sync()

    sets = {"alone": (A,), "single": (A, Bc), "multi": (A, B)}
    errs: dict[str, list[float]] = {k: [] for k in sets}

    def after(name: str, res: Any) -> None:
        k, outs = res
        for i, (out, s) in enumerate(zip(outs, sets[name], strict=True)):
            e = rel_err(out, s.refs[k], cp)
            errs[name].append(e)
            checks.add(f"zip/{name}: chain {i} output vs float64 reference (rel err <= {CHAIN_TOL:g})",
                       e <= CHAIN_TOL, rel_err=e, x=k)
            checks.add(f"zip/{name}: chain {i} output lives on {s.dev}", out.device is s.dev,
                       got=str(out.device))

    times = interleave({"alone": run_alone, "single": run_single, "multi": run_multi},
                       reps, warmup=2, after=after)

    # the same runs with the ops built beforehand (untimed): the wall time of ``.sync()``
    built: dict[str, Any] = {}

    def build(name: str) -> None:
        k = turn[name] = turn[name] ^ 1
        if name == "alone":
            built[name] = (k, A.op(k, alpha))
        elif name == "single":
            built[name] = (k, deviceops.zip(A.op(k, alpha), Bc.op(k, alpha)))
        else:
            built[name] = (k, deviceops.zip(A.op(k, alpha), B.op(k, alpha)))

    def sync_only(name: str) -> Callable[[], Any]:
        def go() -> Any:
            k, op = built.pop(name)
            with deviceops.using(multi) if name == "multi" else contextlib.nullcontext():
                out = op.sync()
            return k, out if isinstance(out, tuple) else (out,)
        return go

    synced = interleave({name: sync_only(name) for name in ("alone", "single", "multi")},
                        reps, warmup=1, before=build, after=after)

    # diagnostic: host time to build and enqueue (``schedule()`` returns before the device
    # finishes); the rest of a ``.sync()`` run is waiting for the device
    builders = {"alone": lambda k: A.op(k, alpha),
                "single": lambda k: deviceops.zip(A.op(k, alpha), Bc.op(k, alpha)),
                "multi": lambda k: deviceops.zip(A.op(k, alpha), B.op(k, alpha))}
    enqueue: dict[str, list[float]] = {k: [] for k in builders}
    for i in range(reps):
        for name, build in builders.items():
            k = i & 1
            with deviceops.using(multi) if name == "multi" else contextlib.nullcontext():
                t0 = time.perf_counter()
                fut = build(k).schedule()
                enqueue[name].append(time.perf_counter() - t0)
            res = fut.result()
            after(name, (k, res if isinstance(res, tuple) else (res,)))
    flop = 2.0 * n * n * n * steps
    T = median(times["alone"])
    label = {"alone": f"1 chain on {d0}", "single": f"2 chains zipped on {d0} (default policy)",
             "multi": f"2 chains zipped on {d0}+{d1} (MultiDeviceRoundRobin)"}
    chains = {"alone": 1, "single": 2, "multi": 2}
    rows = []
    for name in ("alone", "single", "multi"):
        m = median(times[name])
        rows.append({"variant": label[name], "key": name, "median_ms": m * 1e3,
                     "p90_ms": pct(times[name], 90) * 1e3, "min_ms": min(times[name]) * 1e3,
                     "tflops": chains[name] * flop / m * 1e-12, "over_T": m / T,
                     "enqueue_ms": median(enqueue[name]) * 1e3,
                     "max_rel_err": max(errs[name]) if errs[name] else None})
    for name in ("alone", "single", "multi"):
        m = median(synced[name])
        rows.append({"variant": label[name] + ", .sync() of prebuilt ops", "key": name + "_sync",
                     "median_ms": m * 1e3, "p90_ms": pct(synced[name], 90) * 1e3,
                     "min_ms": min(synced[name]) * 1e3, "tflops": chains[name] * flop / m * 1e-12,
                     "over_T": m / median(synced["alone"]), "enqueue_ms": float("nan"),
                     "max_rel_err": max(errs[name]) if errs[name] else None})
    single, multi_t = median(times["single"]), median(times["multi"])
    single_s, multi_s = median(synced["single"]), median(synced["multi"])
    summary = {"bench": "zip", "variant": f"2 x {steps} fp16 GEMM {n}x{n}",
               "ours": label["multi"], "ours_ms": multi_t * 1e3,
               "reference": label["single"], "ref_ms": single * 1e3,
               "ratio": multi_t / single, "ideal_ratio": T / single, "alone_ms": T * 1e3,
               "sync_ours_ms": multi_s * 1e3, "sync_ref_ms": single_s * 1e3,
               "sync_ratio": multi_s / single_s, "samples": reps}
    print()
    print(f"zip over devices: {steps} fp16 GEMMs {n}x{n} per chain (alpha 1/sqrt(n)); host wall "
          f"time build..sync(), median of {reps} interleaved runs")
    print(table(rows, [("variant", "variant", 0), ("median_ms", "median ms", 3), ("p90_ms", "p90", 3),
                       ("min_ms", "min", 3), ("tflops", "TFLOP/s", 1), ("over_T", "/ 1 chain", 2),
                       ("enqueue_ms", "enqueue ms", 3),
                       ("max_rel_err", "max rel err", 6)]))
    print("enqueue ms: host time to build the ops and schedule() them (median, separate runs)")
    print(f"multi / single = {summary['ratio']:.3f} building and running, "
          f"{summary['sync_ratio']:.3f} running prebuilt ops (.sync() only) (ideal T / single = "
          f"{summary['ideal_ratio']:.3f}; bar <= {ZIP_BAR})")
    return rows, summary
