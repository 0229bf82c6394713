"""Summarise a ``benchmarks/gemm.py --variants ...`` JSON: per row the planner's path and
time, cuBLAS, and the forced variants sorted fastest first (used by tools/s8_gpu.sh sweep).

Usage: ``python3 tools/gemm_sweep_report.py out.json``
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    with open(path) as f:
        d = json.load(f)
    rows = d["rows"] + d.get("classic", [])
    for r in rows:
        if "error" in r:
            print(f"{r.get('layer', '?'):28s} M{r['M']:<3d} error {r['error'][:120]}")
            continue
        v = sorted(((x, k[4:-3]) for k, x in r.items() if k.startswith("var_")))
        best = ", ".join(f"{name} {t:.2f}" for t, name in v[:4])
        head = (f"{r['layer']:28s} M{r['M']:<3d} {r['path']:24s} ours {r['ours_us']:7.2f} cuBLAS {r['cublas_us']:7.2f}"
                f" ratio {r['ratio']:.3f} floor {r.get('floor_us', 0):.2f} err {r['err']:.1e}")
        print(head + (f" | best {best} -> {r['cublas_us'] / v[0][0]:.3f}x" if v else ""))


if __name__ == "__main__":
    main(sys.argv[1])
