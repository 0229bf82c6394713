"""Where the host time of one small KernelOp goes, on a GPU (diagnostics for issue 12).

Usage (GPU machine)::

    python3 tools/host_parts_gpu.py [--profile]

For rms_norm (1, 4096), embedding, gemm 1x4096x4096, flash_attention decode and the saxpy
partition form: wall µs per call of the whole user idiom (``op.async_on(stream)``), of
construction alone, of the same driver launch made directly (the floor), and of torch eager.
With ``--profile``, the cProfile top functions of 2,000 calls of each.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import deviceops
from deviceops import api, kernels


def per_call(fn: Callable[[], Any], sync: Callable[[], None], n: int = 2000, rounds: int = 7) -> float:
    best = 1e9
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    import cupy as cp
    import torch

    s = deviceops.device(0).new_stream()
    ts = torch.cuda.ExternalStream(s.native.ptr)  # type: ignore[attr-defined]
    torch.cuda.set_stream(ts)

    def dev(shape: tuple[int, ...], dtype: str = "float16") -> deviceops.Tensor:
        t = api.from_host(np.random.default_rng(0).standard_normal(shape).astype(np.float32)).sync_on(s)
        return api.convert(t, dtype).sync_on(s) if dtype != "float32" else t

    def tt(t: deviceops.Tensor) -> Any:
        return torch.from_dlpack(t.array)

    x, w, o = dev((1, 4096)), dev((4096,)), dev((1, 4096))
    ga, gb, go = dev((1, 4096)), dev((4096, 4096)), dev((1, 4096))
    table, out_e = dev((49152, 576)), dev((1, 576))
    ids = api.from_host(np.array([7], np.int32)).sync_on(s)
    q, k, v, ao = dev((1, 32, 1, 128)), dev((1, 8, 4096, 128)), dev((1, 8, 4096, 128)), dev((1, 32, 1, 128))
    z, xs = dev((1024,), "float32"), dev((1024,), "float32")
    part = z.partition((256,))
    tx, tw, tga, tgb, tgo = tt(x), tt(w), tt(ga), tt(gb), tt(go)
    ttab, tids = tt(table), tt(ids).long()
    tq, tk, tv = tt(q), tt(k), tt(v)
    F = torch.nn.functional

    cases: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
        "rms_norm (1,4096)": (lambda: kernels.rms_norm(x, w, eps=1e-6, out=o),
                              lambda: F.rms_norm(tx, (4096,), tw, 1e-6)),
        "embedding 1 id": (lambda: kernels.embedding(ids, table, out=out_e),
                           lambda: F.embedding(tids, ttab)),
        "gemm 1x4096x4096": (lambda: kernels.gemm(ga, gb, go),
                             lambda: torch.matmul(tga, tgb, out=tgo)),
        "attention decode": (lambda: kernels.flash_attention(q, k, v, out=ao),
                             lambda: F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)),
        "saxpy partition": (lambda: kernels.saxpy(part, 1.0, xs), lambda: torch.add(tx, tx)),
        "add allocating": (lambda: kernels.add(xs, xs), lambda: tx + tx),
    }
    sync = s.synchronize
    print(f"{'case':22s} {'total':>8s} {'build':>8s} {'torch':>8s}  (us/call, best of 7 x 2000)")
    for name, (make, ref) in cases.items():
        make().sync_on(s)
        ref()
        total = per_call(lambda m=make: m().async_on(s), sync)  # type: ignore[misc]
        build = per_call(lambda m=make: m()._consume(), sync)  # type: ignore[misc]
        tref = per_call(ref, torch.cuda.synchronize)
        print(f"{name:22s} {total:8.2f} {build:8.2f} {tref:8.2f}")
    # the driver floor: a launch with a cached parameter block, CuPy's typed binding
    from deviceops.kernels._fastlaunch import driver_launch
    raw = cp.RawKernel(r'extern "C" __global__ void k(float* a, int n) { }', "k")
    raw.compile()
    fptr = int(raw.kernel.ptr)
    import ctypes

    holders = (ctypes.c_void_p(xs.array.data.ptr), ctypes.c_int32(1))
    params = (ctypes.c_void_p * 2)(*(ctypes.addressof(h) for h in holders))
    addr = ctypes.addressof(params)
    launch = driver_launch()
    sp = s.native.ptr  # type: ignore[attr-defined]
    floor = per_call(lambda: launch(fptr, 1, 1, 1, 32, 1, 1, 0, sp, addr, 0), sync)
    rawc = per_call(lambda: raw((1,), (32,), (xs.array, np.int32(1)), stream=s.native), sync)  # type: ignore[attr-defined]
    print(f"driver floor (launchKernel, cached params): {floor:.2f} us; CuPy RawKernel call: {rawc:.2f} us")
    if args.profile:
        for name, (make, _) in cases.items():
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(2000):
                make().async_on(s)
            pr.disable()
            sync()
            print(f"\n===== {name}")
            pstats.Stats(pr).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
