"""Split-KV decode: the partials merged in a thread-block cluster or through the workspace.

Times ``flash_attention`` at every point of the issue-13 decode tables under
``attention_cluster`` = 0 (workspace + combine kernel), the planner's rule, 4 and 8, each
checked against a float32 reference (``benchmarks/attention.py``'s sweep), and prints the
per-point times side by side.

Usage (GPU machine, from benchmarks/): ``python3 ../tools/attn_cluster_gpu.py [--reps N]``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)) + "/../benchmarks")
import attention as A

VARIANTS = ["cluster=0", "", "cluster=4", "cluster=8"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    A.SWEEP_POINTS = A.decode_table_points()
    rows = A.sweep_decode(a.reps, VARIANTS, [A.attn.SPLIT_BLOCKS_PER_SM])
    keys = [f"{v or 'default'}|{A.attn.SPLIT_BLOCKS_PER_SM}" for v in VARIANTS]
    print("\npoint                  " + "  ".join(f"{k.split('|')[0]:>10s}" for k in keys)
          + "   rule/off")
    for r in rows:
        t = [r[k] for k in keys]
        print(f"{r['point']:22s} " + "  ".join(f"{x:10.2f}" for x in t) + f"   {t[1] / t[0]:.3f}")
    A.report_sweep(rows, a.json)


if __name__ == "__main__":
    main()
