"""Split-KV decode with the cp.async K/V ring (ATTN_STAGES) beside the register-load kernel and
the best torch SDPA backend, same run, at the decode-table points below 1.0x (diagnostics).

Usage (GPU machine): ``python3 tools/s10_attn_ring_gpu.py [--reps N] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)) + "/../benchmarks")
import attention as A

POINTS = [
    ("GQA", 32, 8, 128, 32, 1024),
    ("GQA", 32, 8, 128, 8, 32768),
    ("GQA", 32, 8, 128, 32, 32768),
    ("GQA", 32, 8, 128, 32, 4096),
    ("GQA", 32, 8, 128, 1, 1024),
    ("GQA", 32, 8, 128, 8, 4096),
    ("SmolLM2", 9, 3, 64, 1, 2048),
    ("SmolLM2", 9, 3, 64, 8, 2048),
    ("SmolLM2", 9, 3, 64, 32, 512),
    ("SmolLM2", 9, 3, 64, 32, 1024),
]
VARIANTS = [
    "",
    "-DATTN_STAGES=2",
    "-DATTN_STAGES=3",
    "-DATTN_STAGES=4 -DATTN_UK=2",
    "-DATTN_STAGES=6 -DATTN_UK=2",
    "-DATTN_STAGES=3 warps=4",
    "-DATTN_STAGES=4 -DATTN_UK=2 warps=4",
]


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
    ap.add_argument("--targets", default="4,8")
    a = ap.parse_args()
    A.SWEEP_POINTS = POINTS
    targets = [int(t) for t in a.targets.split(",")]
    rows = A.sweep_decode(a.reps, VARIANTS, targets)
    for r, p in zip(rows, POINTS, strict=True):
        r["sdpa_best"] = round(sdpa_best(p, a.reps), 2)
        t = {k: v for k, v in r.items() if "|" in k and not k.endswith("BAD_ERR")}
        best = min(t, key=t.__getitem__)
        dflt = t["default|4"]
        print(f"{r['point']:24s} sdpa {r['sdpa_best']:8.2f} default {dflt:8.2f} ({r['sdpa_best'] / dflt:.3f}x)"
              f"  best {t[best]:8.2f} ({r['sdpa_best'] / t[best]:.3f}x) {best}", flush=True)
    A.report_sweep(rows, a.json)


if __name__ == "__main__":
    main()
