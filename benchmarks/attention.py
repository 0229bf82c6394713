"""Flash-attention benchmark: deviceops kernels beside torch SDPA (FA2 and cuDNN) in one run.

Usage::

    python benchmarks/attention.py [--json PATH] [--quick] [--variants]   # on a GPU
    python benchmarks/attention.py --smoke                                # anywhere, seconds

Forward points: B*L = 16k tokens, Hq*D = 2048 (Hq = Hkv), L in {1024, 4096, 8192},
D in {64, 128}, causal and not, float16 and bfloat16. FLOPs = 4*B*H*Lq*Lk*D, halved when
causal. Each implementation runs on the same inputs (torch tensors shared with CuPy through
DLPack), timed with CUDA events around each call after warm-up; the median is reported.
The q/k/v set (3 x 64 MiB) exceeds the 50 MiB L2, so no rotation is needed.

Decode point: Lq = 1, Lk = 4096, B = 8, Hq = 32, Hkv = 8, D = 128; 20 calls rotating over
4 input sets (4 x 67 MB, larger than L2) captured in one CUDA graph; bandwidth counts q, k, v
read once and o written once, and is compared with a 1 GiB device-to-device copy timed in the
same run (bytes read + written).

``--smoke`` runs the NumPy reference on tiny shapes through the same code (no timings).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deviceops.kernels import _attention as attn

POINTS = [(L, D, causal) for L in (1024, 4096, 8192) for D in (64, 128) for causal in (False, True)]


def flops(b: int, h: int, lq: int, lk: int, d: int, causal: bool) -> float:
    f = 4.0 * b * h * lq * lk * d
    return f / 2 if causal else f


def smoke() -> dict[str, Any]:
    """Run the reference on tiny shapes (no GPU, no timing claims)."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    rows = []
    for dt in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)):
        for lq, lk, d, causal in ((8, 8, 64, False), (5, 9, 128, True), (1, 33, 128, False)):
            q = rng.standard_normal((1, 4, lq, d)).astype(dt)
            k = rng.standard_normal((1, 2, lk, d)).astype(dt)
            v = rng.standard_normal((1, 2, lk, d)).astype(dt)
            attn.attention_check(q.shape, q.dtype, k.shape, k.dtype, v.shape, v.dtype)
            o = attn.attention_reference(q, k, v, causal=causal)
            ok = bool(np.isfinite(o.astype(np.float32)).all())
            rows.append(
                {"dtype": str(dt), "lq": lq, "lk": lk, "d": d, "causal": causal, "finite": ok}
            )
            print(f"smoke {dt!s:9} Lq={lq:3} Lk={lk:3} D={d:3} causal={causal!s:5} finite={ok}")
            assert ok
    return {"mode": "smoke", "rows": rows}


def _to_cupy(t: Any) -> Any:
    import cupy
    import torch

    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return cupy.from_dlpack(t.view(torch.int16)).view(np.dtype(ml_dtypes.bfloat16))
    return cupy.from_dlpack(t)


def _time_torch(fn: Any, iters: int, warmup: int = 3) -> float:
    import torch

    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def _time_cupy(fn: Any, stream: Any, iters: int, warmup: int = 3) -> float:
    import cupy

    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record(stream)
        fn()
        b.record(stream)
        b.synchronize()
        ts.append(cupy.cuda.get_elapsed_time(a, b))
    return statistics.median(ts)


def bench_forward(
    dtypes: list[str],
    points: list[tuple[int, int, bool]],
    iters: int,
    variants: list[tuple[int, int, int]] | None,
    refs: bool = True,
) -> list[dict[str, Any]]:
    """Time every (dtype, L, D, causal) point: ours (and variants), FA2, cuDNN."""
    import torch

    rows = []
    for dname in dtypes:
        for L, D, causal in points:
            row = _bench_point(dname, L, D, causal, iters, variants, refs)
            print(json.dumps(row), flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
    return rows


def _bench_point(
    dname: str,
    L: int,
    D: int,
    causal: bool,
    iters: int,
    variants: list[tuple[int, int, int]] | None,
    refs: bool,
) -> dict[str, Any]:
    import cupy
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    stream = cupy.cuda.Stream(non_blocking=True)
    tdt = torch.float16 if dname == "float16" else torch.bfloat16
    B, H = 16384 // L, 2048 // D
    torch.manual_seed(L * 1000 + D + int(causal))
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=tdt) for _ in range(3))
    o = torch.empty_like(q)
    cq, ck, cv, co = (_to_cupy(t) for t in (q, k, v, o))
    torch.cuda.synchronize()
    f = flops(B, H, L, L, D, causal)
    row: dict[str, Any] = {"dtype": dname, "L": L, "D": D, "causal": causal, "B": B, "H": H}
    for cfg in [None, *(variants or [])]:

        def ours(cfg: tuple[int, int, int] | None = cfg) -> None:
            attn.flash_attention_cuda(
                cq, ck, cv, co, causal=causal, stream=stream, _sm90_config=cfg
            )

        try:
            ms = _time_cupy(ours, stream, iters)
        except Exception as exc:  # a variant may not fit (shared memory)
            print(f"  variant {cfg} failed: {exc}")
            continue
        key = "ours" if cfg is None else f"ours_{cfg[0]}_{cfg[1]}_{cfg[2]}"
        row[key + "_tflops"] = round(f / ms / 1e9, 1)
    # correctness against FA2's output on the same inputs (default config)
    attn.flash_attention_cuda(cq, ck, cv, co, causal=causal, stream=stream)
    stream.synchronize()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref = sdpa(q, k, v, is_causal=causal)
    num = torch.linalg.vector_norm(o.float() - ref.float())
    err = (num / torch.linalg.vector_norm(ref.float())).item()
    row["rel_err_vs_fa2"] = float(f"{err:.2e}")
    row["finite"] = bool(torch.isfinite(o).all().item())
    backends = (("fa2", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION))
    for name, be in backends if refs else ():

        def theirs() -> None:
            sdpa(q, k, v, is_causal=causal)

        try:
            with sdpa_kernel(be):
                ms = _time_torch(theirs, iters)
            row[name + "_tflops"] = round(f / ms / 1e9, 1)
        except Exception as exc:
            print(f"  {name} failed: {exc}")
    ours_tf = row.get("ours_tflops", float("nan"))
    row["ratio_fa2"] = round(ours_tf / row.get("fa2_tflops", float("nan")), 3)
    row["ratio_cudnn"] = round(ours_tf / row.get("cudnn_tflops", float("nan")), 3)
    return row


def _copy_gbs(stream: Any) -> float:
    """Device-to-device copy bandwidth of a 1 GiB buffer (bytes read + written)."""
    import cupy

    n = 1 << 30
    src = cupy.empty(n, dtype=cupy.uint8)
    src.view(cupy.float32)[:] = 1.0
    dst = cupy.empty_like(src)

    def copy() -> None:
        dst.data.copy_from_device_async(src.data, n, stream=stream)

    ms = _time_cupy(copy, stream, 20)
    return 2 * n / ms / 1e6


def bench_decode(dtypes: list[str]) -> list[dict[str, Any]]:
    import cupy
    import torch

    rows = []
    stream = cupy.cuda.Stream(non_blocking=True)
    copy_gbs = _copy_gbs(stream)
    B, Hq, Hkv, Lk, D = 8, 32, 8, 4096, 128
    for dname in dtypes:
        tdt = torch.float16 if dname == "float16" else torch.bfloat16
        sets = []
        for _ in range(4):
            q = torch.randn(B, Hq, 1, D, device="cuda", dtype=tdt)
            k = torch.randn(B, Hkv, Lk, D, device="cuda", dtype=tdt)
            v = torch.randn(B, Hkv, Lk, D, device="cuda", dtype=tdt)
            o = torch.empty_like(q)
            sets.append((q, k, v, o, *(_to_cupy(t) for t in (q, k, v, o))))
        ws = cupy.empty(
            attn.attention_workspace_nbytes((B, Hq, 1, D), (B, Hkv, Lk, D), None), dtype=cupy.uint8
        )
        torch.cuda.synchronize()
        for s in sets:  # warm-up / compile
            attn.flash_attention_cuda(*s[4:], workspace=ws, stream=stream)
        stream.synchronize()
        reps = 20
        stream.begin_capture()
        for r in range(reps):
            s = sets[r % 4]
            attn.flash_attention_cuda(*s[4:], workspace=ws, stream=stream)
        graph = stream.end_capture()
        graph.launch(stream=stream)
        stream.synchronize()
        ms = _time_cupy(functools.partial(graph.launch, stream=stream), stream, 30) / reps
        nbytes = 2 * (B * Hq * D * 2) + 2 * (B * Hkv * Lk * D * 2)
        gbs = nbytes / ms / 1e6
        q, k, v, o = sets[0][:4]
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.float(),
            k.float().repeat_interleave(Hq // Hkv, 1),
            v.float().repeat_interleave(Hq // Hkv, 1),
        )
        attn.flash_attention_cuda(*sets[0][4:], workspace=ws, stream=stream)
        stream.synchronize()
        err = (torch.linalg.vector_norm(o.float() - ref) / torch.linalg.vector_norm(ref)).item()
        row = {
            "dtype": dname, "B": B, "Hq": Hq, "Hkv": Hkv, "Lq": 1, "Lk": Lk, "D": D,
            "us": round(ms * 1e3, 2), "gbs": round(gbs, 1), "copy_gbs": round(copy_gbs, 1),
            "ratio_copy": round(gbs / copy_gbs, 3), "rel_err_vs_fp32": float(f"{err:.2e}"),
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--quick", action="store_true", help="L >= 4096 points only, bf16 subset")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--points", default="", help="e.g. 4096:128:0,8192:64:1")
    ap.add_argument("--variants", default="", help="sm90 configs BN:NWG:MINB,...")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--no-ref", action="store_true", help="skip the torch SDPA timings")
    ap.add_argument("--decode-defines", default="", help="extra split-KV defines, e.g. -DATTN_UK=8")
    ap.add_argument("--defines", default="", help="extra sm90 NVRTC defines, e.g. -DATTN_PIPE=0")
    args = ap.parse_args()
    t0 = time.time()
    if args.smoke:
        result = smoke()
    else:
        import cupy
        import torch

        dtypes = args.dtypes.split(",")
        attn.EXTRA_SM90_DEFINES = tuple(args.defines.split())
        attn.EXTRA_SPLITKV_DEFINES = tuple(args.decode_defines.split())
        points = POINTS
        if args.points:
            points = [
                (int(a), int(b), bool(int(c)))
                for a, b, c in (p.split(":") for p in args.points.split(","))
            ]
        variants = [
            tuple(int(x) for x in v.split(":")) for v in args.variants.split(",") if v
        ] or None
        result = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "cupy": cupy.__version__,
            "date": time.strftime("%Y-%m-%d"),
            "forward": bench_forward(dtypes, points, args.iters, variants, not args.no_ref),  # type: ignore[arg-type]
            "decode": [] if args.no_decode else bench_decode(dtypes),
        }
        print_table(result)
    result["seconds"] = round(time.time() - t0, 1)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


def print_table(result: dict[str, Any]) -> None:
    """Print the forward and decode tables (markdown)."""
    print(f"\n{result['device']}  torch {result['torch']}  cupy {result['cupy']}  {result['date']}")
    print(
        "| dtype | L | D | causal | ours TFLOP/s | FA2 | cuDNN | ours/FA2 | ours/cuDNN | rel err vs FA2 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in result["forward"]:
        print(f"| {r['dtype']} | {r['L']} | {r['D']} | {r['causal']} | {r.get('ours_tflops')} | "
              f"{r.get('fa2_tflops')} | {r.get('cudnn_tflops')} | {r['ratio_fa2']} | {r['ratio_cudnn']} | "
              f"{r['rel_err_vs_fa2']} |")  # fmt: skip
    if result["decode"]:
        print("\n| dtype | decode shape | us | GB/s | copy GB/s | ratio | rel err |")
        print("|---|---|---|---|---|---|---|")
        for r in result["decode"]:
            print(f"| {r['dtype']} | B{r['B']} Hq{r['Hq']} Hkv{r['Hkv']} Lk{r['Lk']} D{r['D']} | {r['us']} | "
                  f"{r['gbs']} | {r['copy_gbs']} | {r['ratio_copy']} | {r['rel_err_vs_fp32']} |")  # fmt: skip


if __name__ == "__main__":
    main()
