"""GEMM benchmark: deviceops kernels beside cuBLAS at inference shapes and the classic sizes.

Usage::

    python benchmarks/gemm.py [--models smol,8b] [--m 1,8,32,128,512,2048] [--quick] [--classic]
                              [--host] [--variants skinny,tma] [--json PATH] [--smoke]

Tables:

* **models** (default): every Linear of SmolLM2-135M (hidden 576, 9/3 heads of 64, FFN
  1536, vocab 49152) and of an 8B-class model (hidden 4096, 32/8 heads of 128, FFN 14336,
  vocab 128256) at M = 1 ... 2048 rows, bfloat16, the weight stored ``(N, K)`` as a
  checkpoint has it: ours ``gemm(x, w, trans_b=True)`` beside cuBLAS ``x @ w.t()``
  (``torch.matmul`` with the weight as stored). The decode rows also get the bandwidth
  floor: bytes moved (x, w, out) / measured device copy bandwidth (read + write of 1 GiB).
* ``--classic``: the earlier square / BERT-sized table, b given ``(K, N)`` (``a @ b``).
* ``--host``: host cost per call (enqueue only, no sync inside the timed loop) of
  ``kernels.gemm(...).async_on(s)``, the raw launcher ``gemm_cuda`` and ``torch.matmul(out=)``.

Device time with the host hidden: on one stream, ``torch.cuda._sleep`` first (longer than
the host needs to enqueue the timed calls), then CUDA events around ``inner`` calls; median
over repetitions, ours and cuBLAS alternating in 3 rounds. Inputs rotate over enough copies
to exceed 2x L2 (50 MB on H100) where one set is smaller, so weights come from DRAM as in a
model whose layers all differ. ``ratio`` = cuBLAS µs / ours µs (>= 1: ours at least as fast).
``--smoke`` runs without a GPU: the NumPy reference on tiny shapes (both b layouts), and the
table layout.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deviceops.kernels.gemm import (  # the family package (deviceops.kernels.gemm is the function)
    _NOMINAL_SMS,
    SKINNY_MAX_M,
    GemmOverride,
    _dims,
    gemm_cuda,
    gemm_reference,
    gemm_workspace_nbytes,
    plan_path,
)
from deviceops.kernels.runtime import overrides

L2_BYTES = 50 << 20


def _override(name: str) -> GemmOverride:
    """The ``--force`` option's named configs: a path (``sm80``, ``simt``, ``skinny``, ``tma``),
    an sm_90 tile (``128x256``, ``128x128``, ``64x128``), or ``regstore`` (the planned path with
    the sm_90 epilogue storing from registers)."""
    if name == "regstore":
        return GemmOverride(sm90_tma_store=False)
    if name in ("sm80", "simt", "skinny", "tma"):
        return GemmOverride(path=name)
    return GemmOverride(path="sm90", sm90_tile=name)
M_LIST = [1, 8, 32, 128, 512, 2048]
# (model, layer, K, N): the weight is (N, K)
MODELS: dict[str, list[tuple[str, str, int, int]]] = {
    "smol": [
        ("SmolLM2-135M", "qkv 9/3 heads (576->960)", 576, 960),
        ("SmolLM2-135M", "qkv as 3x576 (576->1728)", 576, 1728),
        ("SmolLM2-135M", "o (576->576)", 576, 576),
        ("SmolLM2-135M", "gate_up (576->3072)", 576, 3072),
        ("SmolLM2-135M", "down (1536->576)", 1536, 576),
        ("SmolLM2-135M", "lm_head (576->49152)", 576, 49152),
    ],
    "8b": [
        ("8B", "qkv 32/8 heads (4096->6144)", 4096, 6144),
        ("8B", "o (4096->4096)", 4096, 4096),
        ("8B", "up or gate (4096->14336)", 4096, 14336),
        ("8B", "gate_up (4096->28672)", 4096, 28672),
        ("8B", "down (14336->4096)", 14336, 4096),
        ("8B", "lm_head (4096->128256)", 4096, 128256),
    ],
}
CLASSIC: list[tuple[str, int, int, int]] = [  # dtype, M, N, K; b given (K, N)
    ("bfloat16", 4096, 4096, 4096),
    ("float16", 4096, 4096, 4096),
    ("bfloat16", 2048, 2048, 2048),
    ("bfloat16", 128, 768, 768),
    ("bfloat16", 512, 3072, 768),
    ("bfloat16", 512, 768, 3072),
    ("float32", 2048, 2048, 2048),
]


def _np_dtype(kind: str) -> np.dtype[Any]:
    if kind == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(np.float32 if kind in ("float32", "tf32") else np.float16)


def _fmt(x: Any, w: int, p: int = 2) -> str:
    return f"{x:>{w}.{p}f}" if isinstance(x, float) else f"{'-' if x is None else x!s:>{w}}"


def _table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'model':>12} {'layer':>28} {'M':>5} {'N':>6} {'K':>6} {'dtype':>8} {'path':>22} {'ours us':>9} "
            f"{'cuBLAS us':>9} {'ratio':>6} {'floor us':>8} {'ours GB/s':>9} {'err':>8}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.get('model', '-'):>12} {r.get('layer', '-')[:28]:>28} {r['M']:>5} {r['N']:>6} {r['K']:>6} "
            f"{r['dtype']:>8} {r.get('path', '-')[:22]:>22} {_fmt(r.get('ours_us'), 9)} {_fmt(r.get('cublas_us'), 9)} "
            f"{_fmt(r.get('ratio'), 6, 3)} {_fmt(r.get('floor_us'), 8)} {_fmt(r.get('ours_gbs'), 9, 0)} "
            f"{_fmt(r.get('err'), 8, 5)}"
        )
    return "\n".join(lines)


def smoke() -> list[dict[str, Any]]:
    """Reference path on tiny shapes (no GPU): both b layouts against float64 NumPy."""
    rng = np.random.default_rng(0)
    rows = []
    for kind, m, n, k in [("float32", 3, 5, 7), ("float16", 4, 9, 17), ("bfloat16", 1, 8, 33), ("tf32", 5, 5, 5)]:
        dt = _np_dtype(kind)
        a = rng.standard_normal((m, k)).astype(dt)
        w = rng.standard_normal((n, k)).astype(dt)
        ref = a.astype(np.float64) @ w.astype(np.float64).T
        ref = 0.5 * ref * (1 + np.tanh(math.sqrt(2 / math.pi) * (ref + 0.044715 * ref**3)))
        for tb in (False, True):
            b = w if tb else np.ascontiguousarray(w.T)
            out = gemm_reference(a, b, activation="gelu", tf32=kind == "tf32", trans_b=tb)
            err = float(np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref))
            assert err < 2e-2, (kind, tb, err)
            rows.append({"model": "smoke", "layer": f"trans_b={tb}", "M": m, "N": n, "K": k, "dtype": kind,
                         "path": "reference", "err": err})  # fmt: skip
    return rows


class _Timer:
    """Device time per call with the host hidden: sleep kernel first, events around the calls."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self.ts = torch.cuda.Stream()
        self.start = torch.cuda.Event(enable_timing=True)
        self.stop = torch.cuda.Event(enable_timing=True)

    def once(self, fn: Any, n_sets: int, inner: int, host_us: float = 40.0) -> float:
        torch = self.torch
        cycles = int((inner * host_us + 200.0) * 2000)  # ~2 GHz upper bound: sleep >= enqueue time
        with torch.cuda.stream(self.ts):
            torch.cuda._sleep(cycles)
            self.start.record(self.ts)
            for i in range(inner):
                fn(i % n_sets)
            self.stop.record(self.ts)
        self.stop.synchronize()
        return float(self.start.elapsed_time(self.stop)) * 1e3 / inner

    def compare(self, fns: dict[str, Any], n_sets: int, reps: int = 7) -> dict[str, float]:
        """Median µs per call of each callable, alternating in 3 rounds."""
        for fn in fns.values():  # warm-up: compile, load, plan, first touch
            for i in range(min(n_sets, 3)):
                fn(i)
        self.ts.synchronize()
        est = max(1.0, min(self.once(fn, n_sets, 2) for fn in fns.values()))
        inner = max(2, min(50, int(3000.0 / est)))
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(3):
            for name, fn in fns.items():
                times[name] += [self.once(fn, n_sets, inner) for _ in range(reps)]
        return {k: statistics.median(v) for k, v in times.items()}


def copy_bandwidth(torch: Any) -> float:
    """Device copy bandwidth in bytes/s: (read + write) of 1 GiB, median of 7."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dst.copy_(src)
    ts = []
    for _ in range(7):
        t0.record()
        dst.copy_(src)
        t1.record()
        t1.synchronize()
        ts.append(t0.elapsed_time(t1) * 1e-3)
    del src, dst
    return 2 * n / statistics.median(ts)


def _bench(cp: Any, torch: Any, timer: _Timer, kind: str, m: int, n: int, k: int, trans_b: bool,
           variants: list[str], bw: float | None) -> dict[str, Any]:  # fmt: skip
    dt = _np_dtype(kind)
    tf32 = kind == "tf32"
    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(kind, torch.float32)
    per_set = (m * k + k * n + m * n) * dt.itemsize
    n_sets = max(1, min(256, math.ceil(2 * L2_BYTES / per_set)))
    gen = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn((m, k), generator=gen, device="cuda", dtype=tdt) for _ in range(n_sets)]
    wshape = (n, k) if trans_b else (k, n)
    ws_ = [torch.randn(wshape, generator=gen, device="cuda", dtype=tdt) * (1 / math.sqrt(k)) for _ in range(n_sets)]
    os_ = [torch.empty((m, n), device="cuda", dtype=tdt) for _ in range(n_sets)]
    cx = [cp.from_dlpack(x) for x in xs]
    cw = [cp.from_dlpack(w) for w in ws_]
    co = [cp.from_dlpack(o) for o in os_]
    wsn = gemm_workspace_nbytes((m, k), wshape, dt, trans_b)
    wsp = cp.empty(max(wsn, 4) // 4, dtype=np.float32)
    cstream = cp.cuda.ExternalStream(timer.ts.cuda_stream)  # our launches go to torch's timing stream
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.cuda.synchronize()  # inputs were written on torch's default stream; timing runs on timer.ts

    def ours(i: int, force: str | None = None) -> None:
        if force is None:  # the default path exactly as users call it
            gemm_cuda(cx[i], cw[i], co[i], tf32=tf32, trans_b=trans_b, workspace=wsp, stream=cstream)
            return
        with overrides(_override(force)):
            gemm_cuda(cx[i], cw[i], co[i], tf32=tf32, trans_b=trans_b, workspace=wsp, stream=cstream)

    def blas(i: int) -> None:
        torch.matmul(xs[i], ws_[i].t() if trans_b else ws_[i], out=os_[i])

    # correctness of set 0 against cuBLAS's fp32-accumulated product
    with torch.cuda.stream(timer.ts):
        ours(0)
        ref = torch.matmul(xs[0].float(), (ws_[0].t() if trans_b else ws_[0]).float())
        err = float((os_[0].float() - ref).norm() / ref.norm().clamp_min(1e-30))
    timer.ts.synchronize()
    batch, mm, nn, kk, _ = _dims((m, k), wshape, trans_b)
    sm90 = kind in ("bfloat16", "float16") and k % 8 == 0 and n % 8 == 0
    path, cfg, splits, _ = plan_path(batch, mm, nn, kk, dt, tf32, sm90, _NOMINAL_SMS, True, trans_b, True)
    if path == "skinny":
        path += " mf{} tr{} u{} ks{}".format(*cfg[:4])
    elif path == "tma":
        path += f" bn{cfg[0]} cl{cfg[1]} kps{cfg[2]} st{cfg[3]} w{cfg[4]}" + (f" pb{cfg[5]}" if cfg[5] else "")
        path += f" mc{cfg[6]}" if cfg[6] > 1 else ""
    elif isinstance(cfg, str):
        path = cfg
    path += f"/s{splits}" if splits > 1 else ""
    fns: dict[str, Any] = {"ours": ours, "cublas": blas}
    for v in variants:
        fns[v] = lambda i, v=v: ours(i, v)
    t = timer.compare(fns, n_sets)
    row: dict[str, Any] = {"M": m, "N": n, "K": k, "dtype": kind, "trans_b": trans_b, "path": path, "err": err,
                           "sets": n_sets, "ours_us": t["ours"], "cublas_us": t["cublas"],
                           "ratio": t["cublas"] / t["ours"],
                           "ours_gbs": per_set / (t["ours"] * 1e-6) / 1e9,
                           "tflops": 2.0 * m * n * k / t["ours"] * 1e-6,
                           "cublas_tflops": 2.0 * m * n * k / t["cublas"] * 1e-6}  # fmt: skip
    if bw:
        row["floor_us"] = per_set / bw * 1e6
    for v in variants:
        row[f"var_{v}_us"] = t[v]
    return row


def bench_models(models: list[str], ms: list[int], variants: list[str], bw: float,
                 layouts: tuple[bool, ...] = (True,)) -> list[dict[str, Any]]:
    """Model-shape rows; ``layouts``: ``trans_b`` values (True: weights (N, K); False: (K, N))."""
    import cupy as cp
    import torch

    timer = _Timer(torch)
    rows = []
    for key in models:
        for (model, layer, k, n), m, tb in itertools.product(MODELS[key], ms, layouts):
            vs = [v for v in variants if not v.startswith(("skinny", "tma")) or m <= SKINNY_MAX_M]
            try:
                row = _bench(cp, torch, timer, "bfloat16", m, n, k, tb, vs, bw)
            except Exception as exc:  # keep the table going; the row records the failure
                row = {"M": m, "N": n, "K": k, "dtype": "bfloat16", "error": repr(exc)[:300]}
            row.update(model=model, layer=layer + ("" if tb else " b (K, N)"))
            rows.append(row)
            extra = {k2: round(v, 2) for k2, v in row.items() if k2.startswith("var_")}
            print(_table([row]).splitlines()[-1], extra, row.get("error", ""), flush=True)
            torch.cuda.empty_cache()
            cp.get_default_memory_pool().free_all_blocks()
    return rows


def bench_classic(variants: list[str]) -> list[dict[str, Any]]:
    """The classic shapes, both b layouts; ``variants`` (forced sm_90 tile configs) are timed
    for the 16-bit rows."""
    import cupy as cp
    import torch

    timer = _Timer(torch)
    rows = []
    for kind, m, n, k in CLASSIC:
        for tb in (False, True):
            vs = variants if kind != "float32" else []
            row = _bench(cp, torch, timer, kind, m, n, k, tb, vs, None)
            row.update(model="classic", layer=f"trans_b={tb}")
            rows.append(row)
            extra = {k2: round(v, 2) for k2, v in row.items() if k2.startswith("var_")}
            print(_table([row]).splitlines()[-1], extra, flush=True)
            torch.cuda.empty_cache()
            cp.get_default_memory_pool().free_all_blocks()
    return rows


def _host_row(cp: Any, torch: Any, s: Any, kind: str, m: int, n: int, k: int, tb: bool) -> dict[str, Any]:
    from deviceops import api, kernels

    ts = torch.cuda.ExternalStream(s.native.ptr)
    x = api.randn((m, k), kind).sync_on(s)
    w = api.randn((n, k) if tb else (k, n), kind).sync_on(s)
    o = api.empty((m, n), kind).sync_on(s)
    tx, tw, to = (torch.from_dlpack(t.array) for t in (x, w, o))
    wsn = gemm_workspace_nbytes((m, k), tuple(w.shape), _np_dtype(kind), tb)
    wsp = cp.empty(max(wsn, 4) // 4, dtype=np.float32)

    def op_call() -> None:
        kernels.gemm(x, w, o, trans_b=tb).async_on(s)

    def raw_call() -> None:
        gemm_cuda(x.array, w.array, o.array, trans_b=tb, workspace=wsp, stream=s.native)

    def torch_call() -> None:
        with torch.cuda.stream(ts):
            torch.matmul(tx, tw.t() if tb else tw, out=to)

    res = {}
    for name, fn in (("kernels.gemm().async_on", op_call), ("gemm_cuda", raw_call), ("torch.matmul(out=)", torch_call)):
        for _ in range(50):
            fn()
        s.synchronize()
        per = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(200):
                fn()
            per.append((time.perf_counter() - t0) / 200 * 1e6)
            s.synchronize()
        res[name] = statistics.median(per)
    return {"M": m, "N": n, "K": k, "dtype": kind, "trans_b": tb, **{f"host_us {k2}": v for k2, v in res.items()}}


def bench_host() -> list[dict[str, Any]]:
    """Host µs per call, enqueue only (the timed loop does not synchronize)."""
    import cupy as cp
    import torch

    import deviceops

    s = deviceops.default_device().new_stream()
    rows = []
    for kind, m, n, k, tb in (("float16", 1, 4096, 4096, True), ("float16", 1, 4096, 4096, False),
                              ("bfloat16", 128, 768, 768, True), ("bfloat16", 8, 576, 576, True)):  # fmt: skip
        row = _host_row(cp, torch, s, kind, m, n, k, tb)
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--models", default="smol,8b", help="comma list of smol, 8b; empty: none")
    ap.add_argument("--m", default=",".join(str(x) for x in M_LIST), help="comma list of row counts")
    ap.add_argument("--classic", action="store_true", help="also the classic (K, N) table")
    ap.add_argument("--host", action="store_true", help="also host cost per call")
    ap.add_argument("--variants", default="",
                    help="extra forced configs timed for ours, e.g. skinny,tma,128x128; regstore: the planned "
                         "path with the sm_90 epilogue storing from registers (no TMA store)")
    ap.add_argument("--quick", action="store_true", help="model tables at M = 1 and 32 only")
    ap.add_argument("--layout", choices=("nk", "kn", "both"), default="nk",
                    help="model weights as (N, K) with trans_b (checkpoints), as (K, N), or both")
    args = ap.parse_args()
    if args.quick:
        args.m = "1,32"
    meta: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M")}
    out: dict[str, Any] = {"meta": meta}
    if args.smoke:
        rows = smoke()
        meta["mode"] = "smoke (reference only, no timings)"
        out["rows"] = rows
        print(_table(rows))
    else:
        import cupy as cp
        import torch

        props = cp.cuda.runtime.getDeviceProperties(0)
        meta["device"] = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        meta["cupy"], meta["torch"] = cp.__version__, torch.__version__
        bw = copy_bandwidth(torch)
        meta["copy_bandwidth_GBs"] = bw / 1e9
        print(f"device {meta['device']}: copy bandwidth {bw / 1e9:.0f} GB/s (read + write of 1 GiB)", flush=True)
        variants = [v for v in args.variants.split(",") if v]
        models = [x for x in args.models.split(",") if x]
        ms = [int(x) for x in args.m.split(",") if x]
        print(_table([]))
        layouts = {"nk": (True,), "kn": (False,), "both": (True, False)}[args.layout]
        out["rows"] = bench_models(models, ms, variants, bw, layouts) if models else []
        if args.classic:
            out["classic"] = bench_classic([v for v in variants if not v.startswith(("skinny", "tma"))])
        if args.host:
            out["host"] = bench_host()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
