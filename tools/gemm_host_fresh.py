"""Host cost per call of GEMMs whose output is new each call (the allocating form users write,
``kernels.gemm(x, w, trans_b=True).async_on(s)``, and the raw launcher with the output rotated
over 1,000 buffers so every call misses the tensor-map cache), beside torch's ``x @ w.t()``.

Usage (GPU machine): ``python3 tools/gemm_host_fresh.py``
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np


def _per_call(fn: Any, sync: Any, n: int = 400, reps: int = 7) -> float:
    for _ in range(50):
        fn()
    sync()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
        sync()
    return statistics.median(out)


def main() -> None:
    import cupy as cp
    import torch

    import deviceops

    s = deviceops.default_device().new_stream()
    ts = torch.cuda.ExternalStream(s.native.ptr)
    for m, n, k in ((128, 768, 768), (512, 3072, 768), (32, 4096, 4096)):
        res = _shape(cp, torch, s, ts, m, n, k)
        print(f"M={m} N={n} K={k} bf16 trans_b host us/call: " + ", ".join(f"{a} {b:.2f}" for a, b in res.items()),
              flush=True)


def _shape(cp: Any, torch: Any, s: Any, ts: Any, m: int, n: int, k: int) -> dict[str, float]:
    from deviceops import api, kernels
    from deviceops.kernels import _gemm

    x = api.randn((m, k), "bfloat16").sync_on(s)
    w = api.randn((n, k), "bfloat16").sync_on(s)
    tx, tw = torch.from_dlpack(x.array), torch.from_dlpack(w.array)
    outs = [cp.empty((m, n), dtype=x.array.dtype) for _ in range(1000)]
    wsp = cp.empty(max(_gemm.gemm_workspace_nbytes((m, k), (n, k), x.array.dtype, True), 4) // 4, np.float32)
    i = [0]

    def alloc_op() -> None:
        kernels.gemm(x, w, trans_b=True).async_on(s)

    def raw_rotating() -> None:
        i[0] = (i[0] + 1) % 1000
        _gemm.gemm_cuda(x.array, w.array, outs[i[0]], trans_b=True, workspace=wsp, stream=s.native)

    def torch_alloc() -> None:
        with torch.cuda.stream(ts):
            _ = tx @ tw.t()

    return {name: _per_call(fn, s.synchronize) for name, fn in
            (("kernels.gemm allocating", alloc_op), ("gemm_cuda, out rotated over 1000", raw_rotating),
             ("torch x @ w.t()", torch_alloc))}  # fmt: skip

if __name__ == "__main__":
    main()
