# ruff: noqa: B023
"""Device time of forced GEMM configurations beside cuBLAS (diagnostics for issue 13).

Usage (GPU machine): ``python3 tools/gemm_sweep_gpu.py [--planner-only]``. For each shape, the planner's
choice and every forced sm_90 config x split count (and sm80), device µs per call with the
host hidden (a spin first), median of 5 x 50 calls, and cuBLAS (torch.matmul) in the same
run; the result is checked against torch first.
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np

import deviceops
from deviceops import kernels
from deviceops.kernels._experiment import overrides

SHAPES = [(128, 768, 768, "bfloat16", False), (128, 576, 576, "float16", True),
          (128, 1536, 576, "float16", True), (512, 3072, 768, "float16", True),
          (512, 576, 1536, "float16", True), (2048, 2048, 2048, "float16", False),
          (128, 4096, 4096, "float16", True), (512, 4096, 4096, "bfloat16", True)]
FORCED = ["", "64x128:1", "64x128:2", "64x128:3", "64x128:4", "128x128:1", "128x128:2",
          "128x128:4", "128x256:1", "128x256:2", "sm80:1", "sm80:2"]


def dev_us(s: deviceops.Stream, launch: Any, torch: Any, n: int = 50) -> float:
    import cupy as cp

    ts = torch.cuda.ExternalStream(s.native.ptr)  # type: ignore[attr-defined]
    out = []
    for _ in range(5):
        with torch.cuda.stream(ts):
            torch.cuda._sleep(int(2e-3 * 1.98e9))
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(s.native)  # type: ignore[attr-defined]
        for _ in range(n):
            launch()
        e1.record(s.native)  # type: ignore[attr-defined]
        e1.synchronize()
        out.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / n)
    return statistics.median(out)


def main() -> None:
    import sys

    import torch

    forced = [""] if "--planner-only" in sys.argv else FORCED

    s = deviceops.device(0).new_stream()
    ts = torch.cuda.ExternalStream(s.native.ptr)  # type: ignore[attr-defined]
    torch.cuda.set_stream(ts)
    rng = np.random.default_rng(3)
    for m, n, k, dt, tb in SHAPES:
        td = getattr(torch, dt)
        ta = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to("cuda", td)
        tbm = torch.from_numpy((rng.standard_normal((n, k) if tb else (k, n)) / k**0.5).astype(np.float32)).to("cuda", td)
        to = torch.empty((m, n), device="cuda", dtype=td)
        import cupy

        a, b, o = (deviceops.Tensor(cupy.from_dlpack(t)) for t in (ta, tbm, to))
        ref = ta.float() @ (tbm.float().t() if tb else tbm.float())
        bt = tbm.t() if tb else tbm
        t_ref = dev_us(s, lambda: torch.matmul(ta, bt, out=to), torch)
        print(f"\n{m}x{n}x{k} {dt}{' trans_b' if tb else ''}: cuBLAS {t_ref:.2f} us")
        for f in forced:
            try:
                with overrides(gemm_path=f or None):
                    kernels.gemm(a, b, o, trans_b=tb).sync_on(s)
                    err = float((torch.from_dlpack(o.array).float() - ref).abs().max() / ref.abs().max())
                    t = dev_us(s, lambda: kernels.gemm(a, b, o, trans_b=tb).async_on(s), torch)
                print(f"  {f or 'planner':10s} {t:7.2f} us  x{t_ref / t:5.2f} of cuBLAS  err {err:.1e}")
            except Exception as e:  # a config that cannot run this shape
                print(f"  {f or 'planner':10s} n/a ({type(e).__name__}: {str(e)[:60]})")
            s.synchronize()


if __name__ == "__main__":
    main()
