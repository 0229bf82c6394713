"""GEMM benchmark: deviceops kernels beside cuBLAS (torch.matmul, else cupy.matmul).

Usage::

    python benchmarks/gemm.py [--json PATH] [--quick] [--configs] [--smoke]

Timing: CUDA events around batches of calls, warm-up first, median over batches; the
inputs rotate over enough copies to exceed L2 (50 MB on H100); random normal data.
Both sides run plain ``a @ b`` (no bias, no activation) on the same arrays.
``--smoke`` runs in seconds without a GPU: checks the NumPy reference on tiny shapes
and prints the table without timings.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deviceops.kernels import _gemm

L2_BYTES = 50 << 20
SHAPES: list[tuple[str, int, int, int]] = [
    ("bfloat16", 4096, 4096, 4096),
    ("float16", 4096, 4096, 4096),
    ("bfloat16", 8192, 8192, 8192),
    ("float16", 8192, 8192, 8192),
    ("float32", 4096, 4096, 4096),
    ("tf32", 4096, 4096, 4096),
    ("bfloat16", 1, 768, 768),
    ("bfloat16", 128, 768, 768),
    ("bfloat16", 512, 3072, 768),
    ("bfloat16", 512, 768, 3072),
    ("float16", 512, 3072, 768),
]


def _np_dtype(kind: str) -> np.dtype[Any]:
    if kind == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(np.float32 if kind in ("float32", "tf32") else np.float16)


def _table(rows: list[dict[str, Any]]) -> str:
    head = f"{'M':>6} {'N':>6} {'K':>6} {'dtype':>9} {'path':>14} {'ours TF/s':>10} {'cuBLAS TF/s':>12} {'ratio':>6} {'ours us':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        def f(x: Any, w: int, p: int = 1) -> str:
            return f"{x:>{w}.{p}f}" if isinstance(x, float) else f"{'-':>{w}}"

        lines.append(
            f"{r['M']:>6} {r['N']:>6} {r['K']:>6} {r['dtype']:>9} {r.get('path', '-'):>14} {f(r.get('ours_tflops'), 10)} "
            f"{f(r.get('cublas_tflops'), 12)} {f(r.get('ratio'), 6, 3)} {f(r.get('ours_us'), 9, 2)}"
        )
    return "\n".join(lines)


def smoke() -> list[dict[str, Any]]:
    """Reference path on tiny shapes (no GPU): checks against float64 NumPy."""
    rng = np.random.default_rng(0)
    rows = []
    for kind, m, n, k in [("float32", 3, 5, 7), ("float16", 4, 9, 17), ("bfloat16", 1, 8, 33), ("tf32", 5, 5, 5)]:
        dt = _np_dtype(kind)
        a = rng.standard_normal((m, k)).astype(dt)
        b = rng.standard_normal((k, n)).astype(dt)
        out = _gemm.gemm_reference(a, b, activation="gelu", tf32=kind == "tf32")
        ref = a.astype(np.float64) @ b.astype(np.float64)
        ref = 0.5 * ref * (1 + np.tanh(math.sqrt(2 / math.pi) * (ref + 0.044715 * ref**3)))
        err = float(np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref))
        assert err < 2e-2, (kind, err)
        rows.append({"M": m, "N": n, "K": k, "dtype": kind, "path": "reference", "rel_err": err})
    return rows


class _Timer:
    """Times a callable by replaying a CUDA graph of many calls between CUDA events."""

    def __init__(self, cupy: Any) -> None:
        self.cupy = cupy

    def _reps(self, fn: Any, n_sets: int, stream: Any) -> int:
        cp = self.cupy
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        for i in range(max(3, n_sets)):  # warm-up (compiles, loads, creates handles)
            fn(i % n_sets)
        start.record(stream)
        for i in range(n_sets):
            fn(i)
        stop.record(stream)
        stop.synchronize()
        one_us = cp.cuda.get_elapsed_time(start, stop) * 1e3 / n_sets  # eager: an upper bound
        return min(4000, max(1, math.ceil(3000.0 / max(one_us, 0.5) / n_sets))) * n_sets

    def build(self, fn: Any, n_sets: int, stream: Any, torch: Any = None) -> tuple[Any, int]:
        """Capture ``reps`` calls of ``fn`` into a CUDA graph; return (replay on ``stream``, reps)."""
        reps = self._reps(fn, n_sets, stream)
        stream.synchronize()
        if torch is None:
            stream.begin_capture()
            for i in range(reps):
                fn(i % n_sets)
            graph = stream.end_capture()
            return (lambda: graph.launch(stream)), reps
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(reps):
                fn(i % n_sets, capture=True)
        ts = torch.cuda.ExternalStream(stream.ptr)

        def replay() -> None:
            with torch.cuda.stream(ts):
                g.replay()

        return replay, reps

    def measure(self, replay: Any, reps: int, stream: Any, n_rep: int = 7) -> list[float]:
        """Per-call microseconds of ``n_rep`` graph replays (after one warm replay)."""
        cp = self.cupy
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        replay()
        times = []
        for _ in range(n_rep):
            start.record(stream)
            replay()
            stop.record(stream)
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3 / reps)
        return times

    def median_us(self, fn: Any, n_sets: int, stream: Any) -> float:
        replay, reps = self.build(fn, n_sets, stream)
        return statistics.median(self.measure(replay, reps, stream, 15))


def _bench_one(cp: Any, torch: Any, timer: _Timer, stream: Any, kind: str, m: int, n: int, k: int,
               configs: bool) -> dict[str, Any]:  # fmt: skip
    dt = _np_dtype(kind)
    tf32 = kind == "tf32"
    per_set = (m * k + k * n + m * n) * dt.itemsize
    n_sets = max(2, min(64, math.ceil(2 * L2_BYTES / per_set)))
    rng = cp.random.default_rng(1)
    with stream:
        a_s = [rng.standard_normal((m, k), dtype=np.float32).astype(dt) for _ in range(n_sets)]
        b_s = [rng.standard_normal((k, n), dtype=np.float32).astype(dt) for _ in range(n_sets)]
        o_s = [cp.empty((m, n), dtype=dt) for _ in range(n_sets)]
        ws_n = _gemm.gemm_workspace_nbytes((m, k), (k, n), dt)
        ws = cp.empty(max(ws_n, 6 * 4 * m * n if m * n <= 1 << 22 else 4) // 4, dtype=np.float32)
    stream.synchronize()
    flops = 2.0 * m * n * k
    sm90 = kind in ("bfloat16", "float16") and k % 8 == 0 and n % 8 == 0
    pth, cfg, splits, _ = _gemm._plan(1, m, n, k, dt, tf32, sm90, _gemm._NOMINAL_SMS)
    path = cfg if isinstance(cfg, str) else pth
    path += f"/s{splits}" if splits > 1 else ""

    def ours(i: int, force: str | None = None) -> None:
        _gemm.gemm_cuda(a_s[i], b_s[i], o_s[i], tf32=tf32, workspace=ws, stream=stream, _force=force)

    # correctness spot check on set 0 (float32 product of the same inputs)
    ours(0)
    stream.synchronize()
    with stream:
        ref = cp.matmul(a_s[0].astype(cp.float32), b_s[0].astype(cp.float32))
        err = float(cp.linalg.norm(o_s[0].astype(cp.float32) - ref) / cp.linalg.norm(ref))
    row: dict[str, Any] = {"M": m, "N": n, "K": k, "dtype": kind, "path": path, "rel_err_vs_fp32": err,
                           "sets": n_sets}  # fmt: skip
    if torch is not None:
        t_a = [torch.from_dlpack(x) for x in a_s]
        t_b = [torch.from_dlpack(x) for x in b_s]
        t_o = [torch.from_dlpack(x) for x in o_s]
        torch.backends.cuda.matmul.allow_tf32 = tf32
        ts = torch.cuda.ExternalStream(stream.ptr)

        def blas(i: int, capture: bool = False) -> None:
            if capture:  # inside torch.cuda.graph: its own capture stream
                torch.matmul(t_a[i], t_b[i], out=t_o[i])
                return
            with torch.cuda.stream(ts):
                torch.matmul(t_a[i], t_b[i], out=t_o[i])

        row["reference"] = "torch.matmul (cuBLAS), CUDA-graph replay"
        blas_r = timer.build(blas, n_sets, stream, torch)
    else:  # pragma: no cover

        def blas(i: int) -> None:
            with stream:
                cp.matmul(a_s[i], b_s[i], out=o_s[i])

        row["reference"] = "cupy.matmul (cuBLAS)"
        blas_r = timer.build(blas, n_sets, stream)
    ours_r = timer.build(ours, n_sets, stream)
    t_ours: list[float] = []
    t_blas: list[float] = []
    for _ in range(3):  # alternate, so that clock / temperature drift hits both sides alike
        t_ours += timer.measure(*ours_r, stream)
        t_blas += timer.measure(*blas_r, stream)
    us, bus = statistics.median(t_ours), statistics.median(t_blas)
    row["ours_us"] = us
    row["ours_tflops"] = flops / us * 1e-6
    row["cublas_us"] = bus
    row["cublas_tflops"] = flops / bus * 1e-6
    row["ratio"] = row["ours_tflops"] / row["cublas_tflops"]
    if configs and sm90:
        variants = list(_gemm.SM90_CONFIGS) if m >= 1024 else [
            "128x128:1", "128x128:2", "128x128:4", "64x128:1", "64x128:2", "64x128:4", "64x128:6", "sm80"]
        for name in variants:
            cus = timer.median_us(lambda i, nm=name: ours(i, nm), n_sets, stream)
            row[f"cfg_{name}_tflops"] = flops / cus * 1e-6
    return row


def bench(quick: bool, configs: bool, only: list[int] | None = None) -> list[dict[str, Any]]:
    """Time every shape in SHAPES (``quick``: a subset) beside cuBLAS."""
    import cupy as cp

    try:
        import torch
    except Exception:  # pragma: no cover
        torch = None
    stream = cp.cuda.Stream(non_blocking=True)
    timer = _Timer(cp)
    rows = []
    shapes = SHAPES[:1] + SHAPES[4:5] + SHAPES[6:8] if quick else SHAPES
    if only is not None:
        shapes = [SHAPES[i] for i in only]
    for kind, m, n, k in shapes:
        row = _bench_one(cp, torch, timer, stream, kind, m, n, k, configs)
        rows.append(row)
        extra = {k2: round(v, 1) for k2, v in row.items() if k2.startswith("cfg_")}
        print(_table([row]).splitlines()[-1], extra, f"err={row['rel_err_vs_fp32']:.2e}", flush=True)
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--configs", action="store_true", help="also time every sm_90 tile config")
    ap.add_argument("--define", action="append", default=[], help="extra -D for the sm_90 kernel (experiments)")
    ap.add_argument("--no-plain", action="store_true", help="sm_90: always compile the full epilogue")
    ap.add_argument("--only", default=None, help="comma-separated row indices of SHAPES to run")
    args = ap.parse_args()
    meta: dict[str, Any] = {"date": time.strftime("%Y-%m-%d")}
    if args.smoke:
        rows = smoke()
        meta["mode"] = "smoke (reference only, no timings)"
    else:
        import cupy as cp

        props = cp.cuda.runtime.getDeviceProperties(0)
        meta["device"] = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        meta["cupy"] = cp.__version__
        _gemm.SM90_EXTRA_DEFINES = tuple(args.define)
        _gemm.SM90_PLAIN_EPILOGUE = not args.no_plain
        meta["sm90_plain_epilogue"] = not args.no_plain
        meta["sm90_defines"] = list(args.define)
        only = [int(x) for x in args.only.split(",")] if args.only else None
        rows = bench(args.quick, args.configs, only)
    print(_table(rows))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
