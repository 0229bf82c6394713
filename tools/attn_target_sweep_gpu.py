"""Split-KV decode: split targets (blocks per SM) x warps per block beside the best torch
SDPA backend, same run, at the decode-table points near 1.0x (diagnostics for the planner's
split rule, ``_attention_plan.plan_splitkv``).

Usage (GPU machine): ``python3 tools/attn_target_sweep_gpu.py [--reps N] [--json out.json]``.

It times each configuration in a block with the older timer (no L2 flush, not interleaved);
``tools/attn_variants_gpu.py`` sweeps the same knobs (``target=T``, ``warps=W``) interleaved
with SDPA and L2 flushed before every call, and is the one to trust for ratios near 1.0x.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)) + "/../benchmarks")
import attention as A

POINTS = [
    ("GQA", 32, 8, 128, 8, 32768),
    ("GQA", 32, 8, 128, 32, 32768),
    ("GQA", 32, 8, 128, 1, 32768),
    ("GQA", 32, 8, 128, 8, 4096),
    ("GQA", 32, 8, 128, 32, 4096),
    ("SmolLM2", 9, 3, 64, 1, 2048),
    ("SmolLM2", 9, 3, 64, 32, 1024),
    ("SmolLM2", 9, 3, 64, 32, 512),
    ("SmolLM2", 9, 3, 64, 32, 256),
    ("GQA", 32, 8, 128, 32, 1024),
    ("GQA", 32, 8, 128, 1, 4096),
]
VARIANTS = ["", "warps=8", "warps=16"]


def sdpa_best(point: tuple, reps: int) -> float:
    import torch

    _, hq, hkv, d, b, lk = point
    timer = A._Timer()
    sets = A._decode_sets(b, hq, hkv, lk, d, torch.float16)
    best = min(timer.median_us(c, reps) for c in A._sdpa_calls(sets).values())
    del sets
    torch.cuda.empty_cache()
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--json", default="")
    ap.add_argument("--targets", default="3,4,6,8,12,16")
    ap.add_argument("--only", default="", help="points whose 'label B Lk' contains this, e.g. 'SmolLM2 B32'")
    ap.add_argument("--variants", default="", help="';'-separated variants (default: planned, warps=8, warps=16)")
    a = ap.parse_args()
    points = [p for p in POINTS if a.only in f"{p[0]} B{p[4]} Lk{p[5]}"]
    A.SWEEP_POINTS = points
    targets = [int(t) for t in a.targets.split(",")]
    variants = a.variants.split(";") if a.variants else VARIANTS
    rows = A.sweep_decode(a.reps, variants, targets)
    for r, p in zip(rows, points, strict=True):
        r["sdpa_best"] = round(sdpa_best(p, a.reps), 2)
        t = {k: v for k, v in r.items() if "|" in k and not k.endswith("BAD_ERR")}
        best = min(t, key=t.__getitem__)
        dflt = t["default|4"]
        print(f"{r['point']:24s} sdpa {r['sdpa_best']:8.2f} default {dflt:8.2f} ({r['sdpa_best'] / dflt:.3f}x)"
              f"  best {t[best]:8.2f} ({r['sdpa_best'] / t[best]:.3f}x) {best}", flush=True)
    A.report_sweep(rows, a.json)


if __name__ == "__main__":
    main()
