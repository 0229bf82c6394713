"""Quantized-weight GEMV and prefill GEMM (issue 45) beside cuBLAS fp16, device time.

Rows:

* ``gemv``: ``kernels.qmatmul`` at M = 1 (and 8, 32) on a 4096 x 4096 weight in Q4_K and
  Q4_1 (also Q8_0, Q5_0, Q6_K, Q4_0, informational), float16 activations, against torch's
  ``x @ w.T`` on the fp16 weight of the same shape (cuBLAS) in the same run. Effective
  bandwidth counts the quantized weight's bytes (plus x and out) per launch.
* ``copy``: a device-to-device copy of 1 GiB through torch, (read + written bytes) / time:
  the bandwidth ceiling of the GEMV bar.
* ``prefill``: 512 x 4096 x 4096 with Q4_K weights as the nn layer runs it (``dequantize``
  into a float16 scratch, then ``gemm(..., trans_b=True)``) against torch fp16 ``x @ w.T``.

Method (GPU): one deviceops stream, torch on the same CUDA stream (``ExternalStream``).
Each sample queues a ``torch.cuda._sleep`` spin long enough to cover the host's enqueue
time, then an event, ``N`` launches over a rotating set of weights (together more than
twice the L2), an event; per-launch time = elapsed / N; the median of the samples. Every
variant's output is checked against the float64 reference (``gguf.quants.dequantize``) first.

Bars (issue 45): GEMV M = 1 (Q4_K, Q4_1) effective bandwidth >= 75% of the copy bandwidth
and >= 2.5x faster than cuBLAS fp16; prefill Q4_K >= 0.8x cuBLAS fp16.

``--smoke`` runs small shapes on the cpu backend (CI keeps the script alive).
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
    check_close,
    main_guard,
    print_bars,
    setup,
    table,
    write_json,
)

import deviceops
from deviceops import api, kernels
from deviceops.kernels import quant

L2_BYTES = 60 << 20
BAR_FORMATS = ("Q4_K", "Q4_1")
INFO_FORMATS = ("Q8_0", "Q5_0", "Q6_K", "Q4_0")


def _host_us(fn: Any, n: int, stream: deviceops.Stream) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    stream.synchronize()
    return (time.perf_counter() - t0) * 1e6 / n


def _copy_gbps(timer: SpinTimer) -> float:
    torch = timer.torch
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = timer.per_launch_us(lambda i: dst.copy_(src), 5, 10)[0]
    return 2 * src.numel() / (us * 1e-6) / 1e9


def _gemv_rows(b: Any, stream: deviceops.Stream, timer: SpinTimer | None, n_dim: int, k_dim: int,
               ms: list[int], fmts: tuple[str, ...], n: int, reps: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    rows = []
    for fmt in fmts:
        f = quant.get_format(fmt)
        w_bytes = n_dim * quant.row_bytes(f, k_dim)
        sets = max(1, min(16, -(-2 * L2_BYTES // w_bytes))) if b.is_cuda else 1
        host = quant.random_packed(rng, fmt, n_dim, k_dim, quantize=False)
        ws = [api.from_host(host).sync_on(stream)]
        for _ in range(1, sets):  # (the same values, other memory: the L2 cannot hold them all)
            ws.append(api.dup(ws[0]).sync_on(stream))
        w64 = quant.dequantize_reference(host, fmt, k_dim)
        for m in ms:
            x = api.from_host(rng.standard_normal((m, k_dim)).astype(np.float16)).sync_on(stream)
            out = api.empty((m, n_dim), "float16").sync_on(stream)
            kernels.qmatmul(x, ws[-1], out, fmt=fmt).sync_on(stream)
            xh = np.asarray(api.to_host(x).sync_on(stream)).astype(np.float64)
            check_close(np.asarray(api.to_host(out).sync_on(stream)), xh @ w64.T,
                        f"qmatmul {fmt} M={m} {n_dim}x{k_dim}", rtol=2e-3)

            def ours(i: int, x: Any = x, out: Any = out, ws: Any = ws, fmt: str = fmt) -> None:
                kernels.qmatmul(x, ws[i % len(ws)], out, fmt=fmt).async_on(stream)

            row: dict[str, Any] = {"bench": "gemv", "fmt": fmt, "M": m, "N": n_dim, "K": k_dim,
                                   "bar": fmt in BAR_FORMATS and m == 1}
            if timer is None:
                row.update(ours_us=_host_us(ours, n, stream), reference=None, ref_us=None, ratio=None)
            else:
                row.update(ours_us=timer.per_launch_us(ours, n, reps)[0])
                row.update(_cublas(timer, m, n_dim, k_dim, n, reps, rng))
            moved = w_bytes + 2 * m * (k_dim + n_dim)
            row["ours_GBps"] = moved / (row["ours_us"] * 1e-6) / 1e9
            rows.append(row)
            print(f"  gemv {fmt} M={m:<3d} ours {row['ours_us']:8.2f} us {row['ours_GBps']:7.0f} GB/s"
                  + (f"  cuBLAS fp16 {row['ref_us']:8.2f} us  speedup {row['ref_us'] / row['ours_us']:.2f}x"
                     if row["ref_us"] else ""), flush=True)
    return rows


_cublas_cache: dict[tuple[int, int, int], float] = {}


def _cublas(timer: SpinTimer, m: int, n_dim: int, k_dim: int, n: int, reps: int,
            rng: np.random.Generator) -> dict[str, Any]:
    torch = timer.torch
    key = (m, n_dim, k_dim)
    if key not in _cublas_cache:
        sets = max(1, min(16, -(-2 * L2_BYTES // (n_dim * k_dim * 2))))
        with torch.cuda.stream(timer.ts):
            w = [torch.randn(n_dim, k_dim, dtype=torch.float16, device="cuda") / k_dim ** 0.5
                 for _ in range(sets)]
            x = torch.randn(m, k_dim, dtype=torch.float16, device="cuda")
        _cublas_cache[key] = timer.per_launch_us(lambda i: x @ w[i % sets].T, n, reps)[0]
    ref = _cublas_cache[key]
    return {"reference": "torch fp16 x @ w.T (cuBLAS)", "ref_us": ref}


def _finish_ratio(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        r["ratio"] = None if not r.get("ref_us") else r["ref_us"] / r["ours_us"]


def _prefill_row(b: Any, stream: deviceops.Stream, timer: SpinTimer | None, m: int, n_dim: int, k_dim: int,
                 n: int, reps: int) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    fmt = "Q4_K"
    host = quant.random_packed(rng, fmt, n_dim, k_dim, quantize=False)
    w = api.from_host(host).sync_on(stream)
    x = api.from_host(rng.standard_normal((m, k_dim)).astype(np.float16)).sync_on(stream)
    scratch = api.empty((n_dim, k_dim), "float16").sync_on(stream)
    out = api.empty((m, n_dim), "float16").sync_on(stream)

    def ours(i: int) -> None:
        kernels.dequantize(w, out=scratch, fmt=fmt, k=k_dim).async_on(stream)
        kernels.gemm(x, scratch, out, trans_b=True).async_on(stream)

    ours(0)
    stream.synchronize()
    xh = np.asarray(api.to_host(x).sync_on(stream)).astype(np.float64)
    check_close(np.asarray(api.to_host(out).sync_on(stream)),
                xh @ quant.dequantize_reference(host, fmt, k_dim).T, f"prefill {fmt} {m}x{n_dim}x{k_dim}",
                rtol=3e-3)
    row: dict[str, Any] = {"bench": "prefill", "fmt": fmt, "M": m, "N": n_dim, "K": k_dim, "bar": True}
    if timer is None:
        row.update(ours_us=_host_us(ours, n, stream), reference=None, ref_us=None)
    else:
        torch = timer.torch
        row["ours_us"] = timer.per_launch_us(ours, n, reps)[0]
        with torch.cuda.stream(timer.ts):
            tw = torch.randn(n_dim, k_dim, dtype=torch.float16, device="cuda")
            tx = torch.randn(m, k_dim, dtype=torch.float16, device="cuda")
        row.update(reference="torch fp16 x @ w.T (cuBLAS)", ref_us=timer.per_launch_us(lambda i: tx @ tw.T, n, reps)[0])
    row["ours_TFLOPs"] = 2 * m * n_dim * k_dim / (row["ours_us"] * 1e-6) / 1e12
    print(f"  prefill {fmt} {m}x{n_dim}x{k_dim} ours {row['ours_us']:9.2f} us"
          + (f"  cuBLAS fp16 {row['ref_us']:9.2f} us" if row["ref_us"] else ""), flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--launches", type=int, default=50, help="launches per timed sample")
    p.add_argument("--reps", type=int, default=30, help="timed samples per variant (median)")
    p.add_argument("--all-formats", action="store_true", help="also time Q8_0, Q5_0, Q6_K, Q4_0")
    args = p.parse_args()
    b = setup(args)
    stream = b.device.new_stream()
    timer = SpinTimer(stream) if b.is_cuda else None
    if b.smoke:
        n_dim, k_dim, ms, fmts, n, reps, pm = 64, 256, [1, 3], BAR_FORMATS, 2, 1, 40
    else:
        n_dim, k_dim, ms, n, reps, pm = 4096, 4096, [1, 8, 32], args.launches, args.reps, 512
        fmts = BAR_FORMATS + (INFO_FORMATS if args.all_formats else ())
    copy = None if timer is None else _copy_gbps(timer)
    if copy is not None:
        print(f"# device-to-device copy: {copy:.0f} GB/s (read + written)")
    print(f"# qmatmul GEMV {n_dim}x{k_dim}, float16 activations: {n} launches per sample, "
          f"median of {reps}")
    rows = _gemv_rows(b, stream, timer, n_dim, k_dim, ms, fmts, n, reps)
    rows.append(_prefill_row(b, stream, timer, pm, n_dim, k_dim, max(1, n // 10), reps))
    _finish_ratio(rows)
    for r in rows:
        r["of_copy"] = None if copy is None or r["bench"] != "gemv" else r["ours_GBps"] / copy
    cols = [("bench", "bench", 0), ("fmt", "fmt", 0), ("M", "M", 0), ("ours_us", "ours us", 2),
            ("ref_us", "cuBLAS fp16 us", 2), ("ratio", "cuBLAS/ours", 2), ("ours_GBps", "ours GB/s", 0),
            ("of_copy", "of copy", 2)]
    print()
    print(table(rows, cols))
    bars = []
    for r in rows:
        if not r["bar"]:
            continue
        if r["bench"] == "gemv":
            bars.append(Bar(f"gemv {r['fmt']} M=1 {r['N']}x{r['K']} bandwidth of copy", r["of_copy"], ">=", 0.75,
                            note="effective GB/s over the quantized bytes / copy GB/s"))
            bars.append(Bar(f"gemv {r['fmt']} M=1 {r['N']}x{r['K']} vs cuBLAS fp16", r["ratio"], ">=", 2.5, "x",
                            note="cuBLAS time / ours"))
        else:
            bars.append(Bar(f"prefill {r['fmt']} {r['M']}x{r['N']}x{r['K']} vs cuBLAS fp16", r["ratio"], ">=",
                            0.8, "x", note="cuBLAS time / ours (dequantize + gemm)"))
    print_bars(bars, b)
    write_json(args.json, "quant_gemv", b, {"N": n_dim, "K": k_dim, "M": ms, "formats": list(fmts),
                                            "launches": n, "reps": reps, "prefill_M": pm,
                                            "copy_GBps": copy}, rows, bars)
    return 0


if __name__ == "__main__":
    main_guard(main)
