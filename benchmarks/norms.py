"""rms_norm and the fused residual add + rms_norm beside torch, device time with the host hidden.

Issue 13's bar: ``kernels.rms_norm`` and ``kernels.add_rms_norm`` at least as fast as torch
(``F.rms_norm``; for the fused op torch's ``residual += x`` then ``F.rms_norm``) at
(1, 768), (1, 4096), (32, 4096), (4096, 4096), float16 and bfloat16.

Method (GPU): one deviceops stream; torch works on the same CUDA stream (an
``ExternalStream``), so both run in one process on one queue. Each sample queues a
``torch.cuda._sleep`` spin first, long enough to cover the host's enqueue time (measured),
then an event, ``N`` launches over a rotating set of inputs (more than twice the L2 for the
large shapes), an event; per-launch device time = elapsed / N; the median of many samples.
A sample whose spin ended before the host finished enqueueing is detected (the first
event already complete) and reported (``hidden`` column: fraction of samples hidden).
Outputs are checked against float64 NumPy and against torch before timing.

Also (informational, no torch reference): the other transformer kernels at decode shapes.

``--smoke`` runs tiny shapes on the cpu backend (CI keeps the script alive).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
from _common import (
    Bar,
    SpinTimer,
    add_common_args,
    check,
    main_guard,
    print_bars,
    setup,
    table,
    write_json,
)

import deviceops
from deviceops import api, kernels

SHAPES = [(1, 768), (1, 4096), (32, 4096), (4096, 4096)]
DTYPES = ["float16", "bfloat16"]
EPS = 1e-6
L2_BYTES = 50 << 20
TOL = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}


def _np_dtype(name: str) -> Any:
    import ml_dtypes

    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def _ref64(x: np.ndarray, r: np.ndarray | None, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    s = x.astype(np.float64) if r is None else (x.astype(np.float64) + r.astype(np.float64)).astype(
        x.dtype).astype(np.float64)
    y = s / np.sqrt((s * s).mean(-1, keepdims=True) + EPS) * w.astype(np.float64)
    return y, s


def _check_close(got: Any, ref: np.ndarray, dtype: str, what: str) -> None:
    g = np.asarray(got).astype(np.float64)
    err = float(np.max(np.abs(g - ref) / (np.abs(ref) + 1.0)))
    check(bool(np.isfinite(g).all()) and err <= TOL[dtype], f"{what}: max rel err {err:.2e}")


def _sets(rows: int, cols: int, dtype: str, n_tensors: int) -> int:
    per = rows * cols * np.dtype(_np_dtype(dtype)).itemsize * n_tensors
    return max(1, min(32, -(-2 * L2_BYTES // per)))


def _norm_rows(b: Any, stream: deviceops.Stream, shapes: list[tuple[int, int]], dtypes: list[str],
               n: int, reps: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    timer = SpinTimer(stream) if b.is_cuda else None
    rows = []
    for dtype in dtypes:
        for shape in shapes:
            nd = _np_dtype(dtype)
            k = _sets(*shape, dtype, 4) if b.is_cuda else 1
            xs = [api.from_host(rng.standard_normal(shape).astype(nd)).sync_on(stream) for _ in range(k)]
            rs = [api.from_host(rng.standard_normal(shape).astype(nd)).sync_on(stream) for _ in range(k)]
            w = api.from_host(rng.standard_normal(shape[-1]).astype(nd)).sync_on(stream)
            outs = [api.empty(shape, dtype).sync_on(stream) for _ in range(k)]
            ros = [api.empty(shape, dtype).sync_on(stream) for _ in range(k)]
            xh = np.asarray(api.to_host(xs[0]).sync_on(stream))
            rh = np.asarray(api.to_host(rs[0]).sync_on(stream))
            wh = np.asarray(api.to_host(w).sync_on(stream))
            # correctness first (float64), on the tensors that are then timed
            kernels.rms_norm(xs[0], w, eps=EPS, out=outs[0]).sync_on(stream)
            _check_close(api.to_host(outs[0]).sync_on(stream), _ref64(xh, None, wh)[0], dtype,
                         f"rms_norm {shape} {dtype}")
            kernels.add_rms_norm(xs[0], rs[0], w, eps=EPS, out=outs[0], residual_out=ros[0]).sync_on(stream)
            y64, s64 = _ref64(xh, rh, wh)
            _check_close(api.to_host(outs[0]).sync_on(stream), y64, dtype, f"add_rms_norm {shape} {dtype}")
            _check_close(api.to_host(ros[0]).sync_on(stream), s64, dtype, f"add_rms_norm sum {shape} {dtype}")

            def ours_rms(i: int, xs: Any = xs, outs: Any = outs, w: Any = w, k: int = k) -> None:
                kernels.rms_norm(xs[i % k], w, eps=EPS, out=outs[i % k]).async_on(stream)

            def ours_add(i: int, xs: Any = xs, rs: Any = rs, outs: Any = outs, ros: Any = ros,
                         w: Any = w, k: int = k) -> None:
                kernels.add_rms_norm(xs[i % k], rs[i % k], w, eps=EPS, out=outs[i % k],
                                     residual_out=ros[i % k]).async_on(stream)

            for op, ours in (("rms_norm", ours_rms), ("add_rms_norm", ours_add)):
                row: dict[str, Any] = {"op": op, "shape": f"{shape[0]}x{shape[1]}", "dtype": dtype}
                if timer is None:
                    t0 = time.perf_counter()
                    for i in range(n):
                        ours(i)
                    stream.synchronize()
                    row.update(ours_us=(time.perf_counter() - t0) * 1e6 / n, reference=None,
                               ref_us=None, ratio=None, hidden=None)
                else:
                    row.update(_torch_side(timer, op, ours, xs, rs, w, outs, ros, k, n, reps, dtype,
                                           shape, stream))
                nbytes = shape[0] * shape[1] * np.dtype(nd).itemsize * (2 if op == "rms_norm" else 4)
                row["ours_GBps"] = nbytes / (row["ours_us"] * 1e-6) / 1e9
                rows.append(row)
                print(f"  {op:13s} {row['shape']:>10s} {dtype:9s} ours {row['ours_us']:8.2f} us"
                      + (f"  torch {row['ref_us']:8.2f} us  ratio {row['ratio']:.2f}"
                         f"  hidden {row['hidden']:.2f}" if row["ref_us"] else ""), flush=True)
    return rows


def _torch_side(timer: SpinTimer, op: str, ours: Any, xs: list[Any], rs: list[Any], w: Any,
                outs: list[Any], ros: list[Any], k: int, n: int, reps: int, dtype: str, shape: tuple[int, int],
                stream: deviceops.Stream) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    tx = [torch.from_dlpack(t) for t in xs]
    tr = [torch.from_dlpack(t) for t in rs]
    tw = torch.from_dlpack(w)
    d = shape[-1]
    if op == "rms_norm":
        def ref(i: int) -> None:
            F.rms_norm(tx[i % k], (d,), tw, EPS)
        name = "torch F.rms_norm"
        with torch.cuda.stream(timer.ts):
            want = F.rms_norm(tx[0].float(), (d,), tw.float(), EPS)
            kernels.rms_norm(xs[0], w, eps=EPS, out=outs[0]).sync_on(stream)
    else:
        trc = [t.clone() for t in tr]

        def ref(i: int) -> None:
            r = trc[i % k]
            r += tx[i % k]
            F.rms_norm(r, (d,), tw, EPS)
        name = "torch r += x; F.rms_norm"
        with torch.cuda.stream(timer.ts):
            want = F.rms_norm((tx[0] + tr[0]).float(), (d,), tw.float(), EPS)
            kernels.add_rms_norm(xs[0], rs[0], w, eps=EPS, out=outs[0],
                                 residual_out=ros[0]).sync_on(stream)
    torch.cuda.synchronize()
    got = torch.from_dlpack(outs[0]).float()
    err = float(((got - want).abs() / (want.abs() + 1)).max())
    check(err <= TOL[dtype], f"{op} {shape} {dtype} vs torch: max rel err {err:.2e}")
    ours_us, hidden = timer.per_launch_us(ours, n, reps)
    ref_us, _ = timer.per_launch_us(ref, n, reps)
    return {"ours_us": ours_us, "reference": name, "ref_us": ref_us, "ratio": ref_us / ours_us,
            "hidden": hidden}


def _other_rows(b: Any, stream: deviceops.Stream, n: int, reps: int) -> list[dict[str, Any]]:
    """Decode-shaped timings of the other transformer kernels (no reference)."""
    if not b.is_cuda:
        return []
    timer = SpinTimer(stream)
    rng = np.random.default_rng(1)
    rows = []

    def up(a: np.ndarray) -> Any:
        return api.from_host(a).sync_on(stream)

    f16 = np.float16
    for bsz, hq, hkv, d, s_len in [(1, 32, 8, 128, 4096), (32, 32, 8, 128, 4096), (8, 9, 3, 64, 2048)]:
        qkv = up(rng.standard_normal((bsz, 1, (hq + 2 * hkv) * d)).astype(f16))
        st = up(rng.integers(0, s_len, bsz).astype(np.int32))
        kc, vc = up(np.zeros((bsz, hkv, s_len, d), f16)), up(np.zeros((bsz, hkv, s_len, d), f16))
        qo = up(np.zeros((bsz, hq, 1, d), f16))

        def kv(i: int, qkv: Any = qkv, st: Any = st, kc: Any = kc, vc: Any = vc, qo: Any = qo,
               hq: int = hq, hkv: int = hkv) -> None:
            kernels.rope_kv_write(qkv, st, kc, vc, n_heads=hq, n_kv_heads=hkv, q_out=qo).async_on(stream)

        us, _ = timer.per_launch_us(kv, n, reps)
        rows.append({"op": "rope_kv_write", "shape": f"B{bsz} Hq{hq}/{hkv} D{d}", "dtype": "float16",
                     "ours_us": us})
    for m, f in [(1, 14336), (32, 14336), (1, 1536)]:
        gu = up(rng.standard_normal((m, 2 * f)).astype(f16))
        o = up(np.zeros((m, f), f16))

        def sw(i: int, gu: Any = gu, o: Any = o) -> None:
            kernels.swiglu(gu, out=o).async_on(stream)

        us, _ = timer.per_launch_us(sw, n, reps)
        rows.append({"op": "swiglu", "shape": f"{m}x{2 * f}", "dtype": "float16", "ours_us": us})
    for bsz, v, k, p in [(1, 49152, 50, 0.9), (32, 49152, 50, 0.9), (1, 128256, 0, 1.0),
                         (32, 128256, 40, 0.95)]:
        lg = up(rng.standard_normal((bsz, v)).astype(np.float32))
        t, kk, pp = up(np.full(bsz, 0.8, np.float32)), up(np.full(bsz, k, np.int32)), up(np.full(bsz, p, np.float32))
        sd, ct = up(np.arange(bsz, dtype=np.int64)), up(np.zeros(bsz, np.int64))
        o = up(np.zeros(bsz, np.int32))

        def sm(i: int, lg: Any = lg, t: Any = t, kk: Any = kk, pp: Any = pp, sd: Any = sd,
               ct: Any = ct, o: Any = o) -> None:
            kernels.sample(lg, t, kk, pp, sd, ct, out=o).async_on(stream)

        us, _ = timer.per_launch_us(sm, n, reps)
        rows.append({"op": "sample", "shape": f"{bsz}x{v} k{k} p{p}", "dtype": "float32", "ours_us": us})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--launches", type=int, default=20, help="launches per timed sample")
    p.add_argument("--reps", type=int, default=50, help="timed samples per variant (median)")
    args = p.parse_args()
    b = setup(args)
    stream = b.device.new_stream()
    if b.smoke:
        shapes, dtypes, n, reps = [(1, 8), (3, 40)], ["float32", "float16"], 3, 1
    else:
        shapes, dtypes, n, reps = SHAPES, DTYPES, args.launches, args.reps
    print(f"# rms_norm / add_rms_norm: {n} launches per sample, median of {reps} samples")
    rows = _norm_rows(b, stream, shapes, dtypes, n, reps)
    cols = [("op", "op", 0), ("shape", "shape", 0), ("dtype", "dtype", 0), ("ours_us", "ours us", 2),
            ("ref_us", "torch us", 2), ("ratio", "torch/ours", 2), ("ours_GBps", "ours GB/s", 0),
            ("hidden", "hidden", 2)]
    print()
    print(table(rows, cols))
    other = _other_rows(b, stream, n, reps)
    if other:
        print("\n# other transformer kernels (decode shapes; no reference)")
        print(table(other, [("op", "op", 0), ("shape", "shape", 0), ("dtype", "dtype", 0),
                            ("ours_us", "ours us", 2)]))
    bars = [Bar(f"{r['op']} {r['shape']} {r['dtype']} vs torch", r["ratio"], ">=", 1.0, "x",
                note="torch time / ours") for r in rows]
    print_bars(bars, b)
    write_json(args.json, "norms", b, {"shapes": shapes, "dtypes": dtypes, "launches": n,
                                       "reps": reps, "eps": EPS}, rows, bars, {"other_rows": other})
    return 0


if __name__ == "__main__":
    main_guard(main)
