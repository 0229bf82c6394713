"""Diagnose the two-block-cluster sm_90 GEMM configs: the occupancy query's cluster count and
the time per call with the persistent grid forced to other cluster counts (H100).

Usage: ``python3 tools/c2_diag.py``
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import gemm as B

from deviceops.kernels import _gemm_cuda as GCU
from deviceops.kernels._experiment import overrides


def main() -> None:
    import cupy as cp
    import torch

    seen: list[Any] = []
    real = GCU.max_active_clusters

    def spy(*a: Any) -> int:
        v = real(*a)
        seen.append((a[1:4], v))
        return FORCE[0] or v

    FORCE = [0]
    GCU.max_active_clusters = spy
    timer = B._Timer(torch)
    for m, n, k in ((2048, 2048, 2048), (4096, 4096, 4096)):
        _one(cp, torch, timer, FORCE, m, n, k)
        print("occupancy queries (grid, block, smem) -> clusters:", seen[-4:], flush=True)


def _one(cp: Any, torch: Any, timer: Any, force_slots: list[int], m: int, n: int, k: int) -> None:
    xs = torch.randn((m, k), device="cuda", dtype=torch.bfloat16)
    ws = torch.randn((n, k), device="cuda", dtype=torch.bfloat16) / k**0.5
    os_ = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
    cx, cw, co = cp.from_dlpack(xs), cp.from_dlpack(ws), cp.from_dlpack(os_)
    st = cp.cuda.ExternalStream(timer.ts.cuda_stream)
    fns: dict[str, Any] = {}
    for force, slots in (("128x256", 0), ("128x256c2", 0), ("128x256c2", 66), ("128x256c2", 64),
                         ("128x256c2", 32), ("128x128c2", 0), ("128x128c2", 66)):
        def f(i: int, force: str = force, slots: int = slots) -> None:
            force_slots[0] = slots
            with overrides(gemm_path=force, gemm_sm90_defines=(f"DIAG_SLOTS={slots}",)):
                GCU.gemm_cuda(cx, cw, co, trans_b=True, stream=st)
        fns[f"{force}@{slots}"] = f
    fns["cublas"] = lambda i: torch.matmul(xs, ws.t(), out=os_)
    t = timer.compare(fns, 1)
    print(m, n, k, {a: round(b, 2) for a, b in t.items()}, flush=True)

if __name__ == "__main__":
    main()
