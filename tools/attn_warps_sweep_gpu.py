"""Split-KV decode: warps per block x split target at every decode-table point (diagnostics).

Runs ``benchmarks/attention.py``'s variant sweep over all 24 points of the issue-13 decode
tables, then prints, per point, the best configuration beside the default one and the best
SDPA backend, so the planner's rule (``_attention_plan.splitkv_warps``) can be read off.

Usage (GPU machine, from benchmarks/): ``python3 ../tools/attn_warps_sweep_gpu.py [--reps N]``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)) + "/../benchmarks")
import attention as A


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default="")
    ap.add_argument("--only", default="", help="point label filter")
    a = ap.parse_args()
    A.SWEEP_POINTS = [p for p in A.decode_table_points() if a.only in p[0]]
    variants = ["warps=4", "warps=8", "warps=16", "warps=8 min_steps=0", "warps=16 min_steps=0"]
    rows = A.sweep_decode(a.reps, variants, [1, 2, 4, 8])
    print("\npoint | default (warps=4|8) | best | best config")
    for r in rows:
        t = {k: v for k, v in r.items() if k != "point" and not k.endswith("BAD_ERR")}
        best = min(t, key=t.__getitem__)
        print(f"{r['point']:22s} {t['warps=4|8']:8.2f} {t[best]:8.2f}  {best}")
    A.report_sweep(rows, a.json)


if __name__ == "__main__":
    main()
