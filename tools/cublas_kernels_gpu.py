"""Which cuBLAS kernels torch runs for the decode GEMM rows (names encode tile, stages and
split-K / stream-K): a diagnostic for the M = 32 rows. Usage: ``python3 tools/cublas_kernels_gpu.py``."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

SHAPES = [(32, 14336, 4096), (32, 4096, 4096), (32, 4096, 14336), (32, 28672, 4096), (32, 49152, 576)]


def main() -> None:
    for m, n, k in SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            a @ w.t()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                a @ w.t()
            torch.cuda.synchronize()
        names = {}
        for e in prof.events():
            if e.device_type.name == "CUDA":
                names.setdefault(e.name, []).append(e.device_time)
        print(f"M={m} N={n} K={k}")
        for name, ts in names.items():
            print(f"   {sum(ts) / len(ts):8.2f} us x{len(ts)}  {name[:200]}")


if __name__ == "__main__":
    main()
