"""The decode tables of ``benchmarks/attention.py`` (``--decode-tables``, issue 13) and the
split-KV variant sweep (``--decode-sweep``): the table and sweep points, the rotating input
sets, ours and every torch SDPA backend as lists of calls, :func:`bench_decode_tables`,
:func:`sweep_decode` and the tables' markdown (:func:`print_decode_tables`)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from _attention_overrides import apply_variant, current, set_overrides
from _attention_timing import L2_BYTES, _copy_gbs, _Timer, _to_cupy

from deviceops.kernels import attention as attn

#: (label, Hq, Hkv, D, batches, key lengths)
DECODE_TABLES = [
    ("GQA 32/8 D128", 32, 8, 128, (1, 8, 32), (1024, 4096, 32768)),
    ("SmolLM2 9/3 D64", 9, 3, 64, (1, 8, 32), (128, 256, 512, 1024, 2048)),
]
#: The torch SDPA backends the decode tables time beside ours ("sdpa": its own choice).
SDPA_NAMES = ("sdpa", "flash", "efficient", "cudnn")


def decode_table_points() -> list[tuple[str, int, int, int, int, int]]:
    """Every point of :data:`DECODE_TABLES` as a :data:`SWEEP_POINTS` entry
    ``(label, Hq, Hkv, D, B, Lk)`` (label: the table's first word, e.g. ``"GQA"``)."""
    return [(label.split()[0], hq, hkv, d, b, lk)
            for label, hq, hkv, d, batches, lks in DECODE_TABLES for b in batches for lk in lks]


def report_sweep(rows: list[dict[str, Any]], json_path: str) -> None:
    """The end of a decode sweep tool: the points with a wrong result, and the JSON."""
    bad = [(r["point"], k) for r in rows for k in r if k.endswith("BAD_ERR")]
    print("wrong results:", bad or "none")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)


def _decode_sets(b: int, hq: int, hkv: int, lk: int, d: int, tdt: Any) -> list[tuple[Any, ...]]:
    import torch

    kv_bytes = 2 * b * hkv * lk * d * 2
    n = max(1, min(64, -(-2 * L2_BYTES // kv_bytes)))
    sets = []
    for _ in range(n):
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=tdt)
        k = torch.randn(b, hkv, lk, d, device="cuda", dtype=tdt)
        v = torch.randn(b, hkv, lk, d, device="cuda", dtype=tdt)
        sets.append((q, k, v, torch.empty_like(q)))
    return sets


def _sdpa_calls(sets: list[tuple[Any, ...]]) -> dict[str, list[Any]]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    out: dict[str, list[Any]] = {}
    backends = [
        ("sdpa", None),
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
    ]
    for name, be in backends:

        def mk(s: tuple[Any, ...], be: Any = be) -> Any:
            q, k, v, _ = s
            if be is None:
                return lambda: sdpa(q, k, v, enable_gqa=True)

            def call() -> Any:
                with sdpa_kernel(be):
                    return sdpa(q, k, v, enable_gqa=True)

            return call

        calls = [mk(s) for s in sets]
        try:
            ref = calls[0]()
            torch.cuda.synchronize()
            del ref
        except Exception as exc:  # backend refuses the shape / GQA
            print(f"    {name}: not available ({str(exc).splitlines()[0][:80]})")
            continue
        out[name] = calls
    return out


def _ours_calls(sets: list[tuple[Any, ...]], stream: Any, ws: Any, kv_len: Any = None) -> list[Any]:
    calls = []
    for q, k, v, o in sets:
        cq, ck, cv, co = (_to_cupy(t) for t in (q, k, v, o))

        def call(cq: Any = cq, ck: Any = ck, cv: Any = cv, co: Any = co) -> None:
            attn.flash_attention_cuda(cq, ck, cv, co, kv_len=kv_len, workspace=ws, stream=stream)

        calls.append(call)
    return calls


def bench_decode_tables(reps: int, only: str = "") -> list[dict[str, Any]]:
    """The issue-13 decode tables: ours beside torch SDPA (every backend that runs the point),
    float16, Lq = 1, timed interleaved (:meth:`_Timer.compare_us`)."""
    import cupy
    import torch

    timer = _Timer()
    copy_gbs = _copy_gbs(timer.stream)
    rows = []
    for label, hq, hkv, d, batches, lks in DECODE_TABLES:
        if only and only not in label:
            continue
        for b in batches:
            for lk in lks:
                torch.manual_seed(b * 100000 + lk)
                sets = _decode_sets(b, hq, hkv, lk, d, torch.float16)
                nbytes = attn.attention_workspace_nbytes((b, hq, 1, d), (b, hkv, lk, d), None)
                ws = cupy.empty(max(nbytes, 1), dtype=cupy.uint8)
                lens = cupy.full((b,), lk, dtype=cupy.int32)
                row: dict[str, Any] = {"table": label, "B": b, "Lk": lk, "sets": len(sets)}
                named = {"ours": _ours_calls(sets, timer.stream, ws),
                         "ours_kvlen": _ours_calls(sets, timer.stream, ws, lens), **_sdpa_calls(sets)}
                for name, us in timer.compare_us(named, reps).items():  # interleaved
                    row[name + "_us"] = us
                best = min(row.get(n + "_us", float("inf")) for n in SDPA_NAMES)
                row["best_sdpa_us"] = best
                row["ratio"] = round(best / row["ours_us"], 3)
                row["ratio_kvlen"] = round(best / row["ours_kvlen_us"], 3)
                kv_bytes = 2 * b * hkv * lk * d * 2
                row["floor_us"] = round(kv_bytes / (copy_gbs * 1e3), 2)
                # correctness of ours on set 0 against fp32 torch
                q, k, v, o = sets[0]
                _ours_calls(sets[:1], timer.stream, ws, lens)[0]()
                torch.cuda.synchronize()
                g = hq // hkv
                ref = torch.nn.functional.scaled_dot_product_attention(
                    q.float(), k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
                )
                err = torch.linalg.vector_norm(o.float() - ref) / torch.linalg.vector_norm(ref)
                row["rel_err_vs_fp32"] = float(f"{err.item():.2e}")
                for key in list(row):
                    if key.endswith("_us") and isinstance(row[key], float):
                        row[key] = round(row[key], 2)
                print(json.dumps(row), flush=True)
                rows.append(row)
                del sets
                torch.cuda.empty_cache()
    # a long cache holding few valid keys costs what a short one costs
    for s_len, n_valid in ((8192, 10), (32768, 1000)):
        b, hq, hkv, d = 8, 32, 8, 128
        sets = _decode_sets(b, hq, hkv, s_len, d, torch.float16)[:2]
        short = [(q, k[:, :, :n_valid].contiguous(), v[:, :, :n_valid].contiguous(), o)
                 for q, k, v, o in sets]  # fmt: skip
        nbytes = attn.attention_workspace_nbytes((b, hq, 1, d), (b, hkv, s_len, d), None)
        ws = cupy.empty(max(nbytes, 1), dtype=cupy.uint8)
        lens = cupy.full((b,), n_valid, dtype=cupy.int32)
        row = {
            "table": "kv_len bound", "B": b, "S": s_len, "kv_len": n_valid,
            "cache_S_kvlen_us": round(timer.median_us(
                _ours_calls(sets, timer.stream, ws, lens), reps), 2),
            "Lk_eq_kvlen_us": round(timer.median_us(
                _ours_calls(short, timer.stream, ws), reps), 2),
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
        del sets, short
        torch.cuda.empty_cache()
    for r in rows:
        r["copy_gbs"] = round(copy_gbs, 1)
    return rows


#: (label, Hq, Hkv, D, B, Lk) points of the variant sweep
SWEEP_POINTS = [
    ("GQA", 32, 8, 128, 1, 1024),
    ("GQA", 32, 8, 128, 8, 32768),
    ("SmolLM2", 9, 3, 64, 1, 128),
    ("SmolLM2", 9, 3, 64, 32, 512),
    ("GQA", 32, 8, 128, 1, 4096),
    ("GQA", 32, 8, 128, 8, 4096),
    ("GQA", 32, 8, 128, 32, 1024),
    ("GQA", 32, 8, 128, 1, 32768),
    ("SmolLM2", 9, 3, 64, 1, 512),
    ("SmolLM2", 9, 3, 64, 8, 1024),
    ("SmolLM2", 9, 3, 64, 32, 2048),
]


def sweep_decode(reps: int, variants: list[str], targets: list[int]) -> list[dict[str, Any]]:
    """Time split-KV build variants x split targets (blocks per SM) at SWEEP_POINTS."""
    import cupy
    import torch

    timer = _Timer()
    rows = []
    saved = current()
    try:
        for label, hq, hkv, d, b, lk in SWEEP_POINTS:
            sets = _decode_sets(b, hq, hkv, lk, d, torch.float16)
            nbytes = attn.attention_workspace_nbytes((b, hq, 1, d), (b, hkv, lk, d), None)
            ws = cupy.empty(max(nbytes, 1), dtype=cupy.uint8)
            q, k, v, o = sets[0]
            g = hq // hkv
            ref = torch.nn.functional.scaled_dot_product_attention(
                q.float(), k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
            )
            row: dict[str, Any] = {"point": f"{label} B{b} Lk{lk}"}
            for var in variants:
                for tgt in targets:
                    apply_variant(var)
                    set_overrides(replace(current(), split_blocks_per_sm=tgt))
                    calls = _ours_calls(sets, timer.stream, ws)
                    us = timer.median_us(calls, reps)
                    o.fill_(float("nan"))
                    calls[0]()
                    torch.cuda.synchronize()
                    err = torch.linalg.vector_norm(o.float() - ref) / torch.linalg.vector_norm(ref)
                    key = f"{var or 'default'}|{tgt}"
                    row[key] = round(us, 2)
                    if not err.item() < 2e-3:
                        row[key + "|BAD_ERR"] = err.item()
            print(json.dumps(row), flush=True)
            rows.append(row)
            del sets
            torch.cuda.empty_cache()
    finally:
        set_overrides(saved)
    return rows

def print_decode_tables(rows: list[dict[str, Any]]) -> None:
    """Markdown of the issue-13 decode tables."""
    print("\n| shape | B | Lk | ours us | ours kv_len us | SDPA default | flash | efficient | "
          "cuDNN | best SDPA / ours | floor us | rel err |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["table"] == "kv_len bound":
            continue
        print(f"| {r['table']} | {r['B']} | {r['Lk']} | {r['ours_us']} | {r['ours_kvlen_us']} | "
              f"{r.get('sdpa_us')} | {r.get('flash_us')} | {r.get('efficient_us')} | "
              f"{r.get('cudnn_us')} | {r['ratio']} | {r['floor_us']} | {r['rel_err_vs_fp32']} |")  # fmt: skip
    for r in rows:
        if r["table"] == "kv_len bound":
            print(
                f"kv_len bound: B{r['B']} cache S={r['S']} kv_len={r['kv_len']}: "
                f"{r['cache_S_kvlen_us']} us; Lk={r['kv_len']} cache: {r['Lk_eq_kvlen_us']} us"
            )
