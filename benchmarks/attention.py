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

Decode tables (``--decode-tables``, issue 13): GQA 32/8 heads of 128 at B 1/8/32 and
Lk 1k/4k/32k, SmolLM2's 9/3 heads of 64 at B 1/8/32 and Lk 128..2048, Lq = 1, float16.
Device time with the host hidden: a ``torch.cuda._sleep`` spin is queued first on the same
stream, then CUDA events around ONE call; median of ``--reps`` calls rotating over input
sets. Ours and every reference are interleaved call by call in a fresh random order each
rep, and before every call L2 is flushed (a read of 1.5x its size): a call never finds the
K/V that the previous call read in L2 (with one 134 MB set, the call after another reading
the same K/V ran up to 15% faster). Beside it, in the same run and on the same
inputs: torch SDPA (``enable_gqa=True``) with its default backend choice and with each of
the FLASH / EFFICIENT / CUDNN backends that accept the call; "ratio" = best SDPA time /
ours (>= 1.0 means ours is faster). "ours kv_len" is the same call with an int32 kv_len
tensor (= Lk) as a captured decode graph uses; "floor" = KV bytes / copy bandwidth measured
in the same run. ``--decode-sweep`` times split-KV variants (:class:`AttentionOverride` knobs) and
split targets at a few of these points. ``--check`` runs kv_len / float32 / paged cases
against the float64 reference (the compute-sanitizer driver: ``compute-sanitizer --tool
memcheck python3 benchmarks/attention.py --check``).

``--smoke`` runs the NumPy reference on tiny shapes through the same code (no timings).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _attention_check import check_cases
from _attention_decode import bench_decode_tables, print_decode_tables, sweep_decode
from _attention_overrides import apply_variant, best_variant, current, set_overrides
from _attention_timing import _copy_gbs, _time_cupy, _time_torch, _to_cupy

from deviceops.kernels import attention as attn

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
    # kv_len, float32 and a paged cache through the reference, as the decode tables use them
    q = rng.standard_normal((2, 9, 1, 64)).astype(np.float32)
    k = rng.standard_normal((2, 3, 40, 64)).astype(np.float32)
    v = rng.standard_normal((2, 3, 40, 64)).astype(np.float32)
    kv_len = np.array([7, 40], np.int32)
    o = attn.attention_reference(q, k, v, causal=True, kv_len=kv_len)
    o7 = attn.attention_reference(q[:1], k[:1, :, :7], v[:1, :, :7], causal=True)
    assert np.allclose(o[:1], o7, rtol=1e-6, atol=1e-7)
    table = np.arange(10, dtype=np.int32).reshape(2, 5)  # 2 rows x 5 blocks of 8 keys
    pool_k = k.reshape(2, 3, 5, 8, 64).transpose(0, 2, 1, 3, 4).reshape(10, 3, 8, 64)
    pool_v = v.reshape(2, 3, 5, 8, 64).transpose(0, 2, 1, 3, 4).reshape(10, 3, 8, 64)
    op = attn.attention_reference(q, pool_k, pool_v, causal=True, kv_len=kv_len, block_table=table)
    assert np.allclose(op, o, rtol=1e-6, atol=1e-7)
    print("smoke float32 kv_len and paged KV: reference consistent")
    rows.append({"dtype": "float32", "kv_len": [7, 40], "paged": True, "finite": True})
    return {"mode": "smoke", "rows": rows}


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

        def ours() -> None:
            attn.flash_attention_cuda(cq, ck, cv, co, causal=causal, stream=stream)

        prev = set_overrides(replace(current(), sm90_config=cfg))
        try:
            ms = _time_cupy(ours, stream, iters)
        except Exception as exc:  # a variant may not fit (shared memory)
            print(f"  variant {cfg} failed: {exc}")
            continue
        finally:
            set_overrides(prev)
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
    ap.add_argument(
        "--decode-defines",
        default="",
        help="split-KV variant: knobs, e.g. 'min_steps=0 target=4 bulk=2'; "
        "'auto' = the --decode-sweep's best",
    )
    ap.add_argument("--decode-tables", action="store_true", help="issue-13 decode tables only")
    ap.add_argument("--only", default="", help="decode table label filter, e.g. SmolLM2")
    ap.add_argument("--reps", type=int, default=50, help="timed calls per decode point")
    ap.add_argument("--decode-sweep", default="", help="split-KV variants 'DEFS;DEFS;...'")
    ap.add_argument("--sweep-targets", default="8", help="split targets (blocks/SM), e.g. 4,8")
    ap.add_argument("--check", action="store_true", help="kv_len/f32/paged correctness cases")
    ap.add_argument("--variant-out", type=Path, default=None, help="write the auto choice here")
    args = ap.parse_args()
    t0 = time.time()
    if args.smoke:
        result = smoke()
    elif args.check:
        if args.decode_defines != "auto":
            apply_variant(args.decode_defines)
        sys.exit(1 if check_cases() else 0)
    elif args.decode_tables or args.decode_sweep:
        import cupy
        import torch

        if args.decode_defines != "auto":
            apply_variant(args.decode_defines)
        result: dict[str, Any] = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "cupy": cupy.__version__,
            "date": time.strftime("%Y-%m-%d"),
        }
        if args.decode_sweep:
            variants = [v.strip() for v in args.decode_sweep.split(";")]
            targets = [int(t) for t in args.sweep_targets.split(",")]
            result["sweep"] = sweep_decode(args.reps, variants, targets)
            if args.decode_defines == "auto":
                chosen = best_variant(result["sweep"])
                print(f"decode tables with the sweep's best variant: {chosen!r}", flush=True)
                if args.variant_out:
                    args.variant_out.write_text(chosen)
                apply_variant(chosen)
                result["variant"] = chosen
        if args.decode_tables:
            result["decode_tables"] = bench_decode_tables(args.reps, args.only)
            print_decode_tables(result["decode_tables"])
    else:
        import cupy
        import torch

        dtypes = args.dtypes.split(",")
        if args.decode_defines not in ("", "auto"):
            apply_variant(args.decode_defines)
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
