"""Shared helpers for the overhead/latency/graph/overlap benchmarks.

* device selection: :func:`setup` returns a :class:`Bench` (the default deviceops
  device, CuPy or ``None``); ``DEVICEOPS_DEVICE=cpu`` forces the cpu backend;
* timing (``_timing.py``, re-exported here): :func:`interleave` runs several variants
  round-robin (so drift hits all of them alike) and returns per-sample seconds, timed with
  ``perf_counter`` around code that ends by synchronizing; :class:`EventTimer` times device
  spans with CUDA events; :func:`median`, :func:`pct`, :func:`no_gc`;
* correctness: :func:`check_equal` / :func:`check_close` compare with a reference
  (:func:`check` takes a comparison the script made), record every comparison, passed
  or not, and raise :class:`CheckFailed` on a failure; :func:`main_guard` turns it into a
  clear message, exit status 1 and a JSON record saying ``checks.passed: false``;
  ``DEVICEOPS_BENCH_INJECT_ERROR=1`` corrupts every reference to show the checks fail;
* output: :func:`table`, :class:`Bar` (PASS/FAIL lines; a missed bar is a
  measurement, not a failure: exit status stays 0), :func:`write_json` (device
  name, date, versions, config, rows, bars, checks).

Import as ``from _common import ...`` (the script's folder is on ``sys.path``).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from _timing import EventTimer, interleave, median, no_gc, pct

from deviceops import _env

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import deviceops

__all__ = [
    "Bar",
    "Bench",
    "CheckFailed",
    "EventTimer",
    "add_common_args",
    "check",
    "check_close",
    "check_equal",
    "checks_summary",
    "download",
    "env_info",
    "fmt",
    "int_data",
    "interleave",
    "launch_geometry",
    "main_guard",
    "median",
    "no_gc",
    "pct",
    "print_bars",
    "raw_kernels",
    "setup",
    "table",
    "upload",
    "write_json",
]


# -- correctness -----------------------------------------------------------------
class CheckFailed(Exception):
    """A correctness check failed: the benchmark's numbers are not to be trusted."""


# every comparison made in this process, passed or not: {"what", "passed"[, "detail"]}
_checks: list[dict[str, Any]] = []
_json_path: str | None = None  # where main_guard writes the record of a failed run

INJECT_ENV = "DEVICEOPS_BENCH_INJECT_ERROR"


def _inject() -> bool:
    """``DEVICEOPS_BENCH_INJECT_ERROR=1``: every reference is corrupted before the comparison
    (:func:`check_equal`, :func:`check_close`), to show the checks can fail."""
    return _env.get(INJECT_ENV) not in ("", "0")


def _corrupt(want: np.ndarray) -> np.ndarray:
    bad = np.array(want, dtype=np.float64 if want.dtype.kind in "biu" else want.dtype, copy=True)
    if bad.size:
        bad.flat[0] = bad.flat[0] + 1 + abs(bad.flat[0])
    return bad


def _record(ok: bool, what: str, detail: str | None = None) -> None:
    rec: dict[str, Any] = {"what": what, "passed": bool(ok)}
    if detail:
        rec["detail"] = detail
    _checks.append(rec)
    if not ok:
        raise CheckFailed(f"{what}: {detail}" if detail else what)


def check(cond: bool, what: str) -> None:
    """Record a correctness check; raise :class:`CheckFailed` if ``cond`` is false.

    ``cond`` must come from a comparison with a reference the script computed
    independently (prefer :func:`check_equal` / :func:`check_close`, which do the
    comparison and can be shown to fail with ``DEVICEOPS_BENCH_INJECT_ERROR=1``).
    """
    _record(bool(cond), what)


def check_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Exact elementwise equality (the benchmarks use integer-valued floats), NaN fails."""
    got = np.asarray(got)
    want = np.asarray(want)
    if _inject():
        want = _corrupt(want)
    ok = got.shape == want.shape and bool(np.array_equal(got, want))
    detail = None
    if not ok:
        bad = int(np.count_nonzero(got != want)) if got.shape == want.shape else -1
        idx = int(np.argmax(got != want)) if bad > 0 else 0
        detail = (f"shape {got.shape} != {want.shape}" if bad < 0 else
                  f"{bad}/{want.size} elements differ, first at flat index {idx}: "
                  f"got {got.ravel()[idx]!r}, want {want.ravel()[idx]!r}")
    _record(ok, what, detail)


def check_close(got: np.ndarray, want: np.ndarray, what: str, *, rtol: float) -> float:
    """``max|got - want| <= rtol * max|want|`` (float64 math; NaN or a shape mismatch fails).

    Returns the relative error.
    """
    g = np.asarray(got, dtype=np.float64)
    w = np.asarray(want, dtype=np.float64)
    if _inject():
        w = _corrupt(w)
    if g.shape != w.shape:
        _record(False, what, f"shape {g.shape} != {w.shape}")
        return float("inf")
    scale = float(np.max(np.abs(w))) if w.size else 0.0
    err = float(np.max(np.abs(g - w))) / (scale or 1.0) if w.size else 0.0
    ok = bool(np.isfinite(g).all()) and err <= rtol
    _record(ok, what, None if ok else f"relative error {err:.3e} > {rtol:g}")
    return err


def checks_summary(checks: Sequence[dict[str, Any]] | None = None, keep: int = 50) -> dict[str, Any]:
    """The comparisons made (default: this process's), counted: ``passed`` is true only when
    at least one ran and none failed; the first ``keep`` distinct descriptions and the
    failures are listed.

    A load benchmark records thousands of per-op checks; the JSON keeps their count, not
    the whole list.
    """
    recs = list(_checks if checks is None else checks)
    failed = [r for r in recs if not r["passed"]]
    distinct = list(dict.fromkeys(r["what"] for r in recs))
    return {"passed": bool(recs) and not failed, "count": len(recs), "distinct": len(distinct),
            "first": distinct[:keep], "failed": failed[:keep], "failed_count": len(failed)}


def main_guard(main: Callable[[], int | None]) -> None:
    """Run ``main``; exit 1 with a clear message if a correctness check failed (the JSON
    record, when ``--json`` was given, then says ``checks.passed: false``)."""
    try:
        rc = main()
    except CheckFailed as exc:
        print(f"\nCORRECTNESS FAIL: {exc}", file=sys.stderr, flush=True)
        if _json_path:
            Path(_json_path).write_text(json.dumps({
                "benchmark": Path(sys.argv[0]).stem, "error": f"CORRECTNESS FAIL: {exc}",
                "checks": checks_summary()}, indent=1, default=_jsonable))
        sys.exit(1)
    except Exception:
        traceback.print_exc()
        print("\nERROR: the benchmark raised; no results", file=sys.stderr, flush=True)
        sys.exit(2)
    sys.exit(rc or 0)


# -- device ----------------------------------------------------------------------
@dataclass
class Bench:
    """Where the benchmark runs."""

    device: deviceops.Device
    cupy: Any  # the cupy module on cuda, else None
    smoke: bool

    @property
    def is_cuda(self) -> bool:
        return not self.device.is_cpu

    def sync_all(self) -> None:
        """Block until every stream of the device is idle."""
        self.device.synchronize()


def setup(args: Any) -> Bench:
    """The default deviceops device (``DEVICEOPS_DEVICE`` honoured), printed once."""
    dev = deviceops.default_device()
    cp = None
    if not dev.is_cpu:
        import cupy

        cp = cupy
        cupy.cuda.Device(dev.index).use()
    global _json_path
    _json_path = getattr(args, "json", None)
    b = Bench(dev, cp, bool(getattr(args, "smoke", False)))
    info = env_info(b)
    mode = "smoke" if b.smoke else "full"
    print(f"# device: {info['device_name']} ({dev}), {mode} run, {info['date']}", flush=True)
    if dev.is_cpu:
        print("# cpu backend: figures measure the NumPy/worker-thread emulation; "
              "the bars are GPU targets and only informational here", flush=True)
    return b


def add_common_args(p: Any) -> None:
    """``--smoke`` and ``--json PATH``."""
    p.add_argument("--smoke", action="store_true",
                   help="tiny counts; runs in seconds on the cpu backend (CI)")
    p.add_argument("--json", metavar="PATH", default=None, help="write the results as JSON")


def env_info(b: Bench) -> dict[str, Any]:
    """Device name, date and versions for the JSON record."""
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "device": str(b.device),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "deviceops": getattr(deviceops, "__version__", "?"),
        "platform": platform.platform(),
        "host_cpus": os.cpu_count(),
    }
    try:
        import trio

        info["trio"] = trio.__version__
    except ImportError:
        info["trio"] = None
    if b.cupy is not None:
        cp = b.cupy
        props = cp.cuda.runtime.getDeviceProperties(b.device.index)
        name = props["name"]
        info["device_name"] = name.decode() if isinstance(name, bytes) else str(name)
        info["cupy"] = cp.__version__
        info["cuda_runtime"] = cp.cuda.runtime.runtimeGetVersion()
        info["cuda_driver"] = cp.cuda.runtime.driverGetVersion()
        info["sm_count"] = props.get("multiProcessorCount")
        info["clock_khz"] = props.get("clockRate")
    else:
        info["device_name"] = f"cpu backend ({platform.processor() or platform.machine()})"
        info["cupy"] = None
    return info


# -- output ----------------------------------------------------------------------
def fmt(x: Any, prec: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if x != x:
            return "nan"
        return f"{x:.{prec}f}"
    return str(x)


def table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, int]]) -> str:
    """A fixed-width table: ``columns`` are (key, header, decimals)."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append([fmt(r.get(k), p) for k, _, p in columns])
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = []
    for j, c in enumerate(cells):
        lines.append("  ".join(s.rjust(w) if i else s.ljust(w) for i, (s, w) in enumerate(zip(c, widths, strict=True))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


_OPS: dict[str, Callable[..., bool]] = {
    "~": lambda a, b, tol: abs(a - b) <= tol,
    "<=": lambda a, b: a <= b,
    "<": lambda a, b: a < b,
    ">=": lambda a, b: a >= b,
    ">": lambda a, b: a > b,
}


@dataclass
class Bar:
    """A performance target: ``value op limit`` (e.g. ratio <= 1.3; ``~`` means within ``tol``)."""

    name: str
    value: float | None
    op: str
    limit: float
    unit: str = ""
    note: str = ""
    tol: float = 0.0
    passed: bool | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"Bar: unknown comparison {self.op!r}")
        v = self.value
        if v is None or v != v:
            self.passed = None
        elif self.op == "~":
            self.passed = _OPS["~"](v, self.limit, self.tol)
        else:
            self.passed = _OPS[self.op](v, self.limit)

    def line(self) -> str:
        tag = {True: "PASS", False: "FAIL", None: "SKIP"}[self.passed]
        unit = f" {self.unit}" if self.unit else ""
        note = f"  ({self.note})" if self.note else ""
        want = f"~ {self.limit:g} +- {self.tol:g}" if self.op == "~" else f"{self.op} {self.limit:g}"
        return f"{tag} {self.name}: {fmt(self.value, 3)}{unit} {want}{unit}{note}"


def print_bars(bars: Sequence[Bar], b: Bench) -> None:
    """Print one PASS/FAIL/SKIP line per bar (informational on the cpu backend)."""
    print()
    suffix = "  [cpu backend: informational]" if not b.is_cuda else ""
    for bar in bars:
        print(bar.line() + suffix)
    sys.stdout.flush()


def write_json(path: str | None, name: str, b: Bench, config: dict[str, Any],
               rows: Sequence[dict[str, Any]], bars: Sequence[Bar],
               extra: dict[str, Any] | None = None) -> None:
    """Write the run's record to ``path`` (if given)."""
    if not path:
        return
    rec: dict[str, Any] = {
        "benchmark": name,
        "device": str(b.device),
        "env": env_info(b),
        "smoke": b.smoke,
        "config": config,
        "rows": list(rows),
        "bars": [asdict(x) for x in bars],
        "checks": checks_summary(_checks),
    }
    if extra:
        rec.update(extra)
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(rec, indent=1, default=_jsonable))
    print(f"# wrote {p}")


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


# -- data and raw references ---------------------------------------------------------
def int_data(rng: np.random.Generator, shape: int | tuple[int, ...], lo: int, hi: int) -> np.ndarray:
    """Random integer-valued float32 data in ``[lo, hi]``.

    The benchmarks accumulate many ops into one buffer; with integer values
    (and sums below 2**24) float32 arithmetic is exact, so results are checked
    for exact equality however many times the timed loops ran.
    """
    return rng.integers(lo, hi + 1, size=shape).astype(np.float32)


def upload(x: np.ndarray, stream: deviceops.Stream) -> deviceops.Tensor:
    """A device tensor holding ``x`` (synchronized)."""
    return deviceops.api.from_host(x).sync_on(stream)


def download(t: deviceops.Tensor, stream: deviceops.Stream) -> np.ndarray:
    """A host copy of ``t`` (synchronized, ordered after every stream that wrote it)."""
    return np.array(deviceops.api.to_host(t).sync_on(stream))


RAW_SOURCE = r"""
extern "C" __global__ void raw_saxpy(float* __restrict__ z, float a, const float* __restrict__ x,
                                     long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        z[i] = a * x[i] + z[i];
}
extern "C" __global__ void raw_add(float* __restrict__ out, const float* __restrict__ x,
                                   const float* __restrict__ y, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = x[i] + y[i];
}
"""


def raw_kernels(cp: Any) -> dict[str, Any]:
    """The raw-CuPy references: ``raw_saxpy(z, a, x, n)`` and ``raw_add(out, x, y, n)``.

    Our own tiny :class:`cupy.RawModule` (not the library's module or cache),
    launched as a raw CuPy user would; same arithmetic as deviceops' kernels.
    """
    mod = cp.RawModule(code=RAW_SOURCE, options=("-std=c++17",))
    return {k: mod.get_function(k) for k in ("raw_saxpy", "raw_add")}


def launch_geometry(n: int) -> tuple[tuple[int], tuple[int]]:
    """(grid, block) deviceops' elementwise kernels use for ``n`` contiguous elements.

    One block of 256 threads per 1024-element tile (``kernels/elementwise/``).
    """
    return (max(1, -(-n // 1024)),), (256,)


class SpinTimer:
    """Per-launch device time of a batch of launches queued behind a GPU spin (so the host's
    enqueue is hidden), on a torch view of a deviceops stream (CUDA only)."""

    def __init__(self, stream: deviceops.Stream) -> None:
        import cupy
        import torch

        self.torch = torch
        self.ts = torch.cuda.ExternalStream(stream.native.ptr)
        self.clock_hz = cupy.cuda.Device().attributes["ClockRate"] * 1e3

    def per_launch_us(self, fn: Any, n: int, reps: int) -> tuple[float, float]:
        """(median per-launch µs, fraction of samples whose host enqueue was hidden)."""
        torch = self.torch
        with torch.cuda.stream(self.ts):
            for i in range(3):
                fn(i)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(n):
                fn(i)
            host_us = (time.perf_counter() - t0) * 1e6
            torch.cuda.synchronize()
            spin_us = 2.0 * host_us + 50.0
            ts, hidden = [], 0
            for _ in range(reps):
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(int(spin_us * 1e-6 * self.clock_hz))
                a.record(self.ts)
                for i in range(n):
                    fn(i)
                hidden += not a.query()
                b.record(self.ts)
                b.synchronize()
                ts.append(a.elapsed_time(b) * 1e3 / n)
        return statistics.median(ts), hidden / reps
