"""Two GPUs: zip over devices and peer copies, each beside a reference in the same run.

Usage::

    python benchmarks/multi_gpu.py [--devices 0,1] [--reps N] [--copy-reps N]
                                   [--n 4096] [--chain 60] [--copy-mib 1024]
                                   [--no-host] [--json PATH] [--smoke]

Sections (issue 29's bars):

1. **zip over GPUs.** Two independent chains of ``--chain`` float16 GEMMs
   (``x -> kernels.gemm(x, w_i, alpha=1/sqrt(n))``, n x n, each GEMM allocating its
   output, chained through DeviceOp arguments). Chain 0's tensors live on device 0,
   chain 1's on device 1; ``deviceops.zip(chain0, chain1).sync()`` runs under
   ``deviceops.using(MultiDeviceRoundRobin([d0, d1]))``. Reference: the same two
   chains (chain 1's tensors copied to device 0) zipped on device 0 under the default
   policy (``StreamPoolRoundRobin`` of the default device, set to device 0). Also one
   chain alone on device 0 (T: the ideal for the multi run; 2T for the single one).
   Host wall time from building the ops to the end of ``.sync()``, median of
   ``--reps`` interleaved runs after warm-up. Bar: multi / single <= 0.55. Diagnostic
   column: host time to build the ops and ``schedule()`` them (the part of a run that
   is not waiting for the devices; zip enqueues chain 1 after chain 0).
2. **peer copy.** ``api.to_device(t, d1).sync()`` of a ``--copy-mib`` float32 tensor
   from device 0 to device 1, and back (1 -> 0); beside ``torch`` ``.to("cuda:j")``
   of the same tensor. GB/s (1e9 bytes/s, bytes = the tensor's size) from host wall
   time (median of ``--copy-reps`` >= 10) and from CUDA events: ours on a stream of
   the destination (``async_on``), torch's on the source's current stream (where
   torch copies between devices). Bar: ours / torch (wall) >= 0.8.
3. **staged host copies** (context, no bar; ``--no-host`` skips): ``api.from_host``
   of a pageable NumPy array and ``api.to_host`` on device 0, beside
   ``torch.from_numpy(h).to(dev)`` and ``t.cpu()``.

Correctness (every timed run, untimed): every chain output against a float64
reference of the same chain on the device its inputs live on (CuPy float64 on the
GPU, NumPy in smoke), ||out - ref|| / ||ref|| <= 1e-2 and finite; chain 1 of the multi
run must live on device 1. Inputs rotate between two ``x`` per chain (and two
sources per copy), so a stale output from an earlier run cannot pass. Every copy
(ours and torch's) is compared bit for bit with an independent copy of its source
made at set-up. Any failure: the JSON record says ``checks.passed: false`` with the
failures, and the script exits 1. ``--inject-error`` corrupts the references (the
last GEMM dropped, the other copy source) to show the checks can fail.

``--smoke``: the same code on the emulated cpu devices ``cpu:0`` and ``cpu:1``, n = 64,
chains of 4, 1 MiB copies, no torch; seconds on two cores. Non-smoke runs need two
CUDA GPUs and exit 2 with a message otherwise. On the GPU machine::

    python benchmarks/multi_gpu.py --json benchmarks/results/multi_gpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from _common import (
    Bar,
    Bench,
    CheckFailed,
    EventTimer,
    add_common_args,
    check,
    env_info,
    interleave,
    main_guard,
    median,
    pct,
    print_bars,
    table,
    write_json,
)

import deviceops
from deviceops import api, kernels
from deviceops.scheduling import MultiDeviceRoundRobin

ZIP_BAR = 0.55
COPY_BAR = 0.8
SERVE_BAR = 1.8  # tokens/s of --devices d0,d1 over one device, same clients
CHAIN_TOL = 1e-2  # fp16 outputs rounded at each of the chain's steps: ~sqrt(steps) * 3e-4


# -- correctness record ------------------------------------------------------------------
@dataclass
class Checks:
    """Every comparison made, passed or not (``_common``'s summary cannot fail)."""

    records: list[dict[str, Any]] = field(default_factory=list)

    def add(self, what: str, ok: bool, **detail: Any) -> bool:
        ok = bool(ok)
        self.records.append({"what": what, "passed": ok, **detail})
        if ok:
            check(True, what)  # counted in _common's list too
        elif len(self.failed) <= 10:
            extra = ", ".join(f"{k}={v}" for k, v in detail.items())
            print(f"CHECK FAILED: {what}" + (f" ({extra})" if extra else ""), file=sys.stderr, flush=True)
        return ok

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.records if not r["passed"]]

    def summary(self, keep: int = 50) -> dict[str, Any]:
        distinct = list(dict.fromkeys(r["what"] for r in self.records))
        failed = self.failed
        first_failed = list({r["what"]: r for r in reversed(failed)}.values())[::-1]  # one of each
        return {"passed": bool(self.records) and not failed, "count": len(self.records),
                "distinct": len(distinct), "first": distinct[:keep],
                "failed": first_failed[:keep], "failed_count": len(failed)}


# -- devices -----------------------------------------------------------------------------
def parse_devices(spec: str) -> list[deviceops.Device]:
    out = []
    for tok in spec.split(","):
        tok = tok.strip()
        out.append(deviceops.device(int(tok) if tok.isdigit() else tok))
    return out


def device_name(dev: deviceops.Device, cp: Any) -> str:
    if dev.is_cpu or cp is None:
        return f"{dev} (emulated cpu device)"
    name = cp.cuda.runtime.getDeviceProperties(dev.index)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


@contextlib.contextmanager
def on(dev: deviceops.Device, cp: Any) -> Iterator[None]:
    """CuPy work in the block runs on ``dev`` (nothing on the cpu backend)."""
    if dev.is_cpu or cp is None:
        yield
    else:
        with cp.cuda.Device(dev.index):
            yield


def xp_of(dev: deviceops.Device) -> Any:
    return dev.xp


def finish(devs: Sequence[deviceops.Device]) -> None:
    for d in devs:
        d.synchronize()


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


# -- 2./3. copies --------------------------------------------------------------------------
def host_copy_of(t: deviceops.Tensor, cp: Any) -> np.ndarray:
    if cp is None or t.device.is_cpu:
        return np.array(t.array, copy=True)
    with cp.cuda.Device(t.device.index):
        return cp.asnumpy(t.array)


def independent_copy(t: deviceops.Tensor, dst: deviceops.Device, cp: Any) -> Any:
    """A copy of ``t``'s array on ``dst`` made without deviceops (CuPy's memcpy / NumPy)."""
    if cp is None or dst.is_cpu:
        return np.array(t.array, copy=True)
    with cp.cuda.Device(dst.index):
        r = cp.empty(t.array.shape, t.array.dtype)
        r.data.copy_from_device(t.array.data, t.array.nbytes)
    cp.cuda.Device(t.device.index).synchronize()
    cp.cuda.Device(dst.index).synchronize()
    return r


def same_bits(a: Any, ref: Any, dev: deviceops.Device, cp: Any) -> bool:
    xp = xp_of(dev)
    with on(dev, cp):
        if a.shape != ref.shape or a.dtype != ref.dtype:
            return False
        return bool(xp.array_equal(a.view(xp.uint32), ref.view(xp.uint32)))


class Torch:
    """The torch references (GPU runs only)."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.version = torch.__version__

    def wrap(self, arr: Any) -> Any:
        return self.torch.from_dlpack(arr)

    def unwrap(self, t: Any, cp: Any) -> Any:
        return cp.from_dlpack(t)


def copy_section(b: Bench, src_dev: deviceops.Device, dst_dev: deviceops.Device, nbytes: int,
                 reps: int, checks: Checks, torch: Torch | None, corrupt: bool) -> dict[str, Any]:
    """``api.to_device(src, dst).sync()`` (wall) and on a dst stream (events) vs torch."""
    cp = b.cupy
    tag = f"{src_dev}->{dst_dev}"
    s_src = src_dev.new_stream()
    srcs = [api.randn((nbytes // 4,), deviceops.float32).sync_on(s_src) for _ in range(2)]
    refs = [independent_copy(t, dst_dev, cp) for t in srcs]
    if corrupt:
        refs.reverse()
    s_dst = dst_dev.new_stream()
    turn = {"ours": 0, "ours_ev": 0, "torch": 0}
    ev_times: dict[str, list[float]] = {"ours_ev": [], "torch": []}
    variants: dict[str, Callable[[], Any]] = {}

    def run_ours() -> Any:
        k = turn["ours"] = turn["ours"] ^ 1
        return k, api.to_device(srcs[k], dst_dev).sync()

    variants["ours"] = run_ours
    if cp is not None:
        with cp.cuda.Device(dst_dev.index):
            timer = EventTimer(cp, s_dst.native)

        def run_ours_ev() -> Any:
            k = turn["ours_ev"] = turn["ours_ev"] ^ 1
            timer.begin()
            out = api.to_device(srcs[k], dst_dev).async_on(s_dst)
            timer.end()
            s_dst.synchronize()
            ev_times["ours_ev"].append(timer.seconds())
            return k, out

        variants["ours_ev"] = run_ours_ev
    if torch is not None:
        th = torch.torch
        tsrcs = [torch.wrap(t.array) for t in srcs]
        tdst = f"cuda:{dst_dev.index}"
        tstream = th.cuda.current_stream(src_dev.index)
        tev = (th.cuda.Event(enable_timing=True), th.cuda.Event(enable_timing=True))

        def run_torch() -> Any:
            k = turn["torch"] = turn["torch"] ^ 1
            tev[0].record(tstream)
            y = tsrcs[k].to(tdst)
            tev[1].record(tstream)
            th.cuda.synchronize(src_dev.index)
            th.cuda.synchronize(dst_dev.index)
            ev_times["torch"].append(tev[0].elapsed_time(tev[1]) * 1e-3)
            return k, y

        variants["torch"] = run_torch

    def after(name: str, res: Any) -> None:
        k, out = res
        if name == "torch":
            arr, dev = torch.unwrap(out, cp), dst_dev  # type: ignore[union-attr]
        else:
            arr, dev = out.array, out.device
            checks.add(f"copy {tag}/{name}: output lives on {dst_dev}", dev is dst_dev, got=str(dev))
        checks.add(f"copy {tag}/{name}: bytes equal the source's", same_bits(arr, refs[k], dst_dev, cp), src=k)

    warm = 2
    times = interleave(variants, reps, warmup=warm, after=after)
    gb = nbytes / 1e9
    row: dict[str, Any] = {"bench": "peer copy", "variant": f"{tag} {nbytes / 2**20:g} MiB",
                           "ours": f"api.to_device(t, {dst_dev!r}).sync()", "ours_ms": median(times["ours"]) * 1e3,
                           "ours_GBps": gb / median(times["ours"]), "ours_p10_GBps": gb / pct(times["ours"], 90),
                           "ours_ev_GBps": gb / median(ev_times["ours_ev"][warm:]) if ev_times["ours_ev"] else None,
                           "ours_ev_wall_GBps": gb / median(times["ours_ev"]) if "ours_ev" in times else None,
                           "reference": f"torch .to('cuda:{dst_dev.index}')" if torch else "torch (not installed)",
                           "ref_ms": None, "ref_GBps": None, "ref_ev_GBps": None, "ratio": None,
                           "ev_ratio": None, "samples": reps}
    if "torch" in times:
        row["ref_ms"] = median(times["torch"]) * 1e3
        row["ref_GBps"] = gb / median(times["torch"])
        row["ref_ev_GBps"] = gb / median(ev_times["torch"][warm:])
        row["ratio"] = row["ours_GBps"] / row["ref_GBps"]
        if row["ours_ev_GBps"]:
            row["ev_ratio"] = row["ours_ev_GBps"] / row["ref_ev_GBps"]
    return row


def host_section(b: Bench, dev: deviceops.Device, nbytes: int, reps: int, checks: Checks,
                 torch: Torch | None, corrupt: bool) -> list[dict[str, Any]]:
    """Staged copies through host memory (context): from_host of pageable data, to_host."""
    cp = b.cupy
    s = dev.new_stream()
    dsrcs = [api.randn((nbytes // 4,), deviceops.float32).sync_on(s) for _ in range(2)]
    hsrcs = [host_copy_of(t, cp) for t in dsrcs]  # pageable host data; dsrcs are their device refs
    if corrupt:
        hsrcs_ref, dsrcs_ref = hsrcs[::-1], dsrcs[::-1]
    else:
        hsrcs_ref, dsrcs_ref = hsrcs, dsrcs
    turn: dict[str, int] = {}

    def rot(name: str) -> int:
        k = turn[name] = turn.get(name, 0) ^ 1
        return k

    def h2d_ours() -> Any:
        k = rot("h2d_ours")
        return k, api.from_host(hsrcs[k]).sync()

    def d2h_ours() -> Any:
        k = rot("d2h_ours")
        return k, api.to_host(dsrcs[k]).sync()

    variants: dict[str, Callable[[], Any]] = {"h2d_ours": h2d_ours, "d2h_ours": d2h_ours}
    if torch is not None:
        th = torch.torch
        tdev = f"cuda:{dev.index}"
        thsrcs = [th.from_numpy(h) for h in hsrcs]
        tdsrcs = [torch.wrap(t.array) for t in dsrcs]

        def h2d_torch() -> Any:
            k = rot("h2d_torch")
            y = thsrcs[k].to(tdev)
            th.cuda.synchronize(dev.index)
            return k, y

        def d2h_torch() -> Any:
            k = rot("d2h_torch")
            return k, tdsrcs[k].cpu()

        variants["h2d_torch"] = h2d_torch
        variants["d2h_torch"] = d2h_torch

    def after(name: str, res: Any) -> None:
        k, out = res
        if name == "h2d_ours":
            ok = out.device is dev and same_bits(out.array, dsrcs_ref[k].array, dev, cp)
        elif name == "h2d_torch":
            ok = same_bits(torch.unwrap(out, cp), dsrcs_ref[k].array, dev, cp)  # type: ignore[union-attr]
        elif name == "d2h_ours":
            ok = same_bits(np.asarray(out), hsrcs_ref[k], deviceops.device("cpu"), None)
        else:
            ok = same_bits(out.numpy(), hsrcs_ref[k], deviceops.device("cpu"), None)
        checks.add(f"host copy {name}: bytes equal the source's", ok, src=k)

    times = interleave(variants, reps, warmup=1, after=after)
    gb = nbytes / 1e9
    rows = []
    for d, ours_desc, ref_desc in (("h2d", "api.from_host(pageable).sync()", "torch.from_numpy(h).to(dev)"),
                                   ("d2h", "api.to_host(t).sync()", "t.cpu()")):
        o = median(times[f"{d}_ours"])
        r = median(times[f"{d}_torch"]) if f"{d}_torch" in times else None
        rows.append({"bench": "host copy", "variant": f"{'host->' if d == 'h2d' else ''}{dev}"
                     f"{'->host' if d == 'd2h' else ''} {nbytes / 2**20:g} MiB",
                     "ours": ours_desc, "ours_ms": o * 1e3, "ours_GBps": gb / o,
                     "reference": ref_desc if torch else "torch (not installed)",
                     "ref_ms": None if r is None else r * 1e3, "ref_GBps": None if r is None else gb / r,
                     "ratio": None if r is None else (gb / o) / (gb / r), "samples": reps})
    return rows


# -- main ----------------------------------------------------------------------------------
# -- data-parallel serving ------------------------------------------------------------------
def serve_section(path: str, devs: Sequence[deviceops.Device], clients: int, requests: int,
                  new_tokens: int, max_batch: int, checks: Checks, client_procs: int
                  ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """HTTP serving through ``python -m deviceops.nn.serve`` (``benchmarks/serve.py``'s
    client): one device at ``clients // 2`` and ``clients`` clients, one device with twice
    the batch rows, and ``--devices d0,d1`` (one engine of ``max_batch`` rows each) at
    ``clients`` clients; the same random-token prompts (128-512 tokens), exactly
    ``new_tokens`` new tokens each (EOS ignored), greedy."""
    import random

    import gguf
    from serve import bench_http, workload

    vocab = len(gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].data)
    if devs[0].is_cpu:  # the server subprocess: the cpu backend too
        os.environ["DEVICEOPS_DEVICE"] = "cpu"
    plen = (16, 48) if devs[0].is_cpu else (128, 512)
    reqs = workload(random.Random(29), requests, vocab, plen, (new_tokens, new_tokens))
    both = f"{devs[0]},{devs[1]}"
    one = str(devs[0])
    runs = [(f"1 device ({one}), {clients // 2} clients", one, clients // 2, max_batch),
            (f"1 device ({one}), {clients} clients", one, clients, max_batch),
            (f"1 device ({one}), {clients} clients, {2 * max_batch} rows", one, clients, 2 * max_batch),
            (f"2 devices ({both}), {clients} clients", both, clients, max_batch)]
    rows: list[dict[str, Any]] = []
    for i, (label, where, c, mb) in enumerate(runs):
        r = bench_http(path, reqs, c, mb, 1024, port=18400 + i, devices=where if "," in where else None,
                       client_procs=min(client_procs, c), warm_prompts=True)
        want = len(reqs) * new_tokens
        ok = checks.add(f"serve {label}: every token arrived", r.get("tokens") == want,
                        tokens=r.get("tokens"), expected=want, error=r.get("error"))
        rows.append({"variant": label, "clients": c, "rows_per_engine": mb, "ok": ok,
                     **{k: r.get(k, float("nan")) for k in ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms",
                                                             "itl_p50_ms", "itl_p99_ms", "wall_s")}})
        print(f"# {label}: {r.get('tokens_per_s', float('nan')):.0f} tokens/s, p99 inter-token "
              f"{r.get('itl_p99_ms', float('nan')):.1f} ms" + (f"; error {r['error']}" if "error" in r else ""),
              flush=True)
    best_one = max(rows[1]["tokens_per_s"], rows[2]["tokens_per_s"])
    summary = {"variant": "serve", "tokens_per_s_two": rows[3]["tokens_per_s"],
               "tokens_per_s_one_best": best_one, "ratio": rows[3]["tokens_per_s"] / best_one,
               "itl_p99_two_ms": rows[3]["itl_p99_ms"], "itl_p99_one_half_clients_ms": rows[0]["itl_p99_ms"]}
    return rows, summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--devices", default=None,
                   help="two devices, comma-separated (default 0,1; smoke cpu:0,cpu:1)")
    p.add_argument("--n", type=int, default=None, help="GEMM size n (4096; smoke 64)")
    p.add_argument("--chain", type=int, default=None, help="GEMMs per chain (60; smoke 4)")
    p.add_argument("--reps", type=int, default=None, help="timed runs per zip variant (10; smoke 3)")
    p.add_argument("--copy-mib", type=float, default=None, help="copy size in MiB (1024; smoke 1)")
    p.add_argument("--copy-reps", type=int, default=None, help="timed runs per copy variant (20; smoke 10)")
    p.add_argument("--no-host", action="store_true", help="skip the staged host copies")
    p.add_argument("--serve", default=None, metavar="GGUF",
                   help="also measure HTTP serving of this model: --devices d0,d1 against one device")
    p.add_argument("--serve-only", action="store_true", help="only the serving section (needs --serve)")
    p.add_argument("--serve-clients", type=int, default=None, help="concurrent clients (128; smoke 4)")
    p.add_argument("--serve-requests", type=int, default=None, help="requests per run (512; smoke 8)")
    p.add_argument("--client-procs", type=int, default=None,
                   help="client processes sharing the clients (4; smoke 2): the load generator "
                        "must not be the bottleneck")
    p.add_argument("--inject-error", action="store_true",
                   help="corrupt the references: the checks must fail (exit 1)")
    args = p.parse_args()
    smoke = bool(args.smoke)
    spec = args.devices or ("cpu:0,cpu:1" if smoke else "0,1")
    n = args.n or (64 if smoke else 4096)
    steps = args.chain or (4 if smoke else 60)
    reps = args.reps or (3 if smoke else 10)
    copy_reps = max(10, args.copy_reps or (10 if smoke else 20))
    nbytes = int((args.copy_mib or (1 if smoke else 1024)) * 2**20) // 4 * 4

    toks = [t.strip() for t in spec.split(",") if t.strip()]
    if len(toks) != 2:
        print(f"multi_gpu: --devices needs exactly two devices, got {spec!r}", file=sys.stderr)
        return 2
    wants_cuda = any(not t.startswith("cpu") for t in toks)
    if not smoke or wants_cuda:
        if not deviceops.cuda_available():
            print("multi_gpu: no usable CUDA GPU; this benchmark needs two GPUs "
                  "(run with --smoke for the cpu emulation)", file=sys.stderr)
            return 2
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
        if count < 2:
            print(f"multi_gpu: found {count} CUDA GPU; this benchmark needs two "
                  "(run with --smoke for the cpu emulation)", file=sys.stderr)
            return 2
    devs = parse_devices(spec)
    if devs[0] is devs[1]:
        print(f"multi_gpu: the two devices must differ, got {spec!r}", file=sys.stderr)
        return 2
    if devs[0].backend is not devs[1].backend:
        print(f"multi_gpu: cannot mix cpu and CUDA devices ({spec!r})", file=sys.stderr)
        return 2
    cp = None
    if not devs[0].is_cpu:
        import cupy

        cp = cupy
        cupy.cuda.Device(devs[0].index).use()
    deviceops.set_default_device(devs[0])  # the default policy: StreamPoolRoundRobin(devs[0])
    b = Bench(devs[0], cp, smoke)
    names = [device_name(d, cp) for d in devs]
    info = env_info(b)
    peer = None
    if cp is not None:
        peer = {f"{a.index}->{c.index}": bool(cp.cuda.runtime.deviceCanAccessPeer(a.index, c.index))
                for a, c in ((devs[0], devs[1]), (devs[1], devs[0]))}
    print(f"# devices: {devs[0]} = {names[0]}, {devs[1]} = {names[1]}; "
          f"{'smoke' if smoke else 'full'} run, {info['date']}"
          + (f"; peer access {peer}" if peer else ""), flush=True)
    if devs[0].is_cpu:
        print("# cpu backend: figures measure the NumPy/worker-thread emulation; the bars are "
              "GPU targets and only informational here", flush=True)

    torch: Torch | None = None
    torch_note = "not used on the cpu backend"
    if cp is not None:
        try:
            torch = Torch()
            torch_note = torch.version
        except ImportError:
            torch_note = "not installed: torch references skipped"
            print(f"# torch {torch_note}", flush=True)

    checks = Checks()
    t_start = time.perf_counter()
    bars: list[Bar] = []
    zip_rows: list[dict[str, Any]] = []
    zip_summary: dict[str, Any] = {}
    copy_rows: list[dict[str, Any]] = []
    host_rows: list[dict[str, Any]] = []
    if args.serve_only and not args.serve:
        print("multi_gpu: --serve-only needs --serve GGUF", file=sys.stderr)
        return 2
    if not args.serve_only:
        zip_rows, zip_summary = zip_section(b, devs, n, steps, reps, checks, args.inject_error)
        copy_rows = [copy_section(b, devs[0], devs[1], nbytes, copy_reps, checks, torch, args.inject_error),
                     copy_section(b, devs[1], devs[0], nbytes, copy_reps, checks, torch, args.inject_error)]
        host_rows = ([] if args.no_host else
                     host_section(b, devs[0], nbytes, copy_reps, checks, torch, args.inject_error))
        wall = time.perf_counter() - t_start

        print()
        print(f"copies: {nbytes / 2**20:g} MiB float32, GB/s = 1e9 B/s of the tensor's size; median of "
              f"{copy_reps} interleaved runs (wall: host clock around .sync(); events: CUDA events on "
              "the copying stream)")
        print(table(copy_rows + host_rows,
                    [("variant", "copy", 0), ("ours_GBps", "ours GB/s", 1), ("ours_ev_GBps", "ours ev", 1),
                     ("ref_GBps", "torch GB/s", 1), ("ref_ev_GBps", "torch ev", 1), ("ratio", "ours/torch", 2),
                     ("ev_ratio", "ev ratio", 2), ("ours_ms", "ours ms", 3), ("ref_ms", "torch ms", 3)]))
        if torch is None:
            print(f"# torch reference: {torch_note}")
        print(f"# {wall:.1f} s of set-up and timed runs")
        bars += [Bar(f"zip 2 chains on {devs[0]}+{devs[1]}: multi / single wall time, build..sync()",
                     zip_summary["ratio"], "<=", ZIP_BAR),
                 Bar(f"zip 2 chains on {devs[0]}+{devs[1]}: multi / single wall time, .sync() of "
                     "prebuilt ops", zip_summary["sync_ratio"], "<=", ZIP_BAR),
                 Bar(f"peer copy {devs[0]}->{devs[1]}: ours / torch GB/s (wall)",
                     copy_rows[0]["ratio"], ">=", COPY_BAR),
                 Bar(f"peer copy {devs[1]}->{devs[0]}: ours / torch GB/s (wall)",
                     copy_rows[1]["ratio"], ">=", COPY_BAR)]
    serve_rows: list[dict[str, Any]] = []
    serve_summary: dict[str, Any] = {}
    if args.serve:
        clients = args.serve_clients or (4 if smoke else 128)
        nreq = args.serve_requests or (8 if smoke else 512)
        new_tok = 4 if smoke else 128
        serve_rows, serve_summary = serve_section(args.serve, devs, clients, nreq, new_tok,
                                                  max(1, clients // 2), checks,
                                                  args.client_procs or (1 if smoke else 4))
        print()
        print(f"serving over HTTP: {nreq} requests, {new_tok} new tokens each (EOS ignored), "
              f"streaming clients in {args.client_procs or (1 if smoke else 4)} client processes; "
              "one engine of the given rows per device")
        print(table(serve_rows, [("variant", "server", 0), ("tokens_per_s", "tokens/s", 0),
                                 ("ttft_p50_ms", "TTFT p50 ms", 1), ("ttft_p99_ms", "TTFT p99 ms", 1),
                                 ("itl_p50_ms", "ITL p50 ms", 2), ("itl_p99_ms", "ITL p99 ms", 2),
                                 ("wall_s", "wall s", 1)]))
        bars += [Bar(f"serve --devices {devs[0]},{devs[1]} / best one device, {clients} clients: "
                     "tokens/s", serve_summary["ratio"], ">=", SERVE_BAR),
                 Bar(f"serve --devices, {clients} clients: p99 inter-token ms vs one device at "
                     f"{clients // 2}", serve_summary["itl_p99_two_ms"], "<=",
                     serve_summary["itl_p99_one_half_clients_ms"])]
    print_bars(bars, b)

    summary = checks.summary()
    write_json(args.json, "multi_gpu", b,
               {"devices": [str(d) for d in devs], "n": n, "chain": steps, "dtype": "float16",
                "alpha": 1.0 / math.sqrt(n), "reps": reps, "copy_bytes": nbytes,
                "copy_reps": copy_reps, "host_copies": not args.no_host,
                "inject_error": bool(args.inject_error), "chain_tol": CHAIN_TOL},
               [r for r in (zip_summary, *copy_rows, *host_rows, *serve_rows) if r], bars,
               {"devices": [str(d) for d in devs], "device_names": names, "peer_access": peer,
                "torch": torch_note, "zip_rows": zip_rows, "serve": serve_summary,
                "ratios": {"zip_multi_over_single": zip_summary.get("ratio"),
                           "copy_0to1_ours_over_torch": copy_rows[0]["ratio"] if copy_rows else None,
                           "copy_1to0_ours_over_torch": copy_rows[1]["ratio"] if copy_rows else None,
                           "serve_two_over_one": serve_summary.get("ratio")},
                "checks": summary, "correctness": checks.records[-200:]})
    if not summary["passed"]:
        first = summary["failed"][0] if summary["failed"] else {"what": "no checks ran"}
        raise CheckFailed(f"{summary['failed_count']} of {summary['count']} checks failed; first: {first}")
    print(f"# correctness: {summary['count']} checks passed")
    return 0


if __name__ == "__main__":
    main_guard(main)
