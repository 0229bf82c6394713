"""Where the time of an allocating op goes on a GPU (diagnostics for issue 12's allocating add).

Usage (GPU machine): ``python3 tools/alloc_parts_gpu.py [--profile]``. Prints µs per call,
best of 7 x 2000; ``--profile``: then a cProfile (internal time) of the allocating ``add``,
the partition-form ``saxpy`` and ``argmax`` loops.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import deviceops
from deviceops import api, kernels
from deviceops._tensor import Storage, Tensor, allocate
from deviceops.extend import DeviceOp, ExecutionContext
from deviceops.kernels import _elementwise


class _Nothing(DeviceOp[None]):
    """An op that enqueues nothing: what async_on costs around an op's own work."""

    def _execute(self, ctx: ExecutionContext) -> None:
        return None


def per_call(fn: Callable[[], Any], n: int = 2000, rounds: int = 7) -> float:
    best = 1e9
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def main() -> None:
    import cupy as cp
    import torch

    s = deviceops.device(0).new_stream()
    ns = s.native  # type: ignore[attr-defined]
    f32 = np.dtype("float32")
    x = api.ones((1024,)).sync_on(s)
    tx = torch.ones(1024, device="cuda")
    mp = cp.cuda.alloc(4096)
    rt = cp.cuda.runtime
    arr0 = cp.empty((1024,), f32)
    rows = {
        "torch.empty(1024)": lambda: torch.empty(1024, device="cuda"),
        "torch y = x + x": lambda: tx + tx,
        "cupy.empty (current stream)": lambda: cp.empty((1024,), f32),
        "with stream: cupy.empty": lambda: _with(ns, cp, f32),
        "stream enter/exit": lambda: _enter(ns),
        "runtime.getDevice": rt.getDevice,
        "cupy.cuda.alloc(4096)": lambda: cp.cuda.alloc(4096),
        "cupy.ndarray(memptr)": lambda: cp.ndarray((1024,), f32, mp),
        "Storage+Tensor": lambda: Tensor(arr0, s.device, _storage=Storage(arr0, s.device, s)),
        "Storage only": lambda: Storage(arr0, s.device, s),
        "allocate()": lambda: allocate(s, (1024,), f32, "x"),
        "kernels.add(x, x).async_on": lambda: kernels.add(x, x).async_on(s),
        "kernels.add(x, x, out=o).async_on": None,
    }
    o = api.empty((1024,)).sync_on(s)
    rows["kernels.add(x, x, out=o).async_on"] = lambda: kernels.add(x, x, out=o).async_on(s)
    part = api.zeros((1024,)).sync_on(s).partition((256,))
    rows["kernels.saxpy(part, 1.0, x).async_on"] = lambda: kernels.saxpy(part, 1.0, x).async_on(s)
    logits = api.ones((1, 49152), "float16").sync_on(s)
    tok = api.zeros((1,), "int32").sync_on(s)
    rows["kernels.argmax(logits, out=tok).async_on"] = (
        lambda: kernels.argmax(logits, out=tok).async_on(s))
    rows["_Nothing().async_on (op + async_on)"] = lambda: _Nothing().async_on(s)
    ln = _elementwise._launcher(0, "add_flat", f32)
    out0 = cp.empty((1024,), f32)
    args = (out0.data.ptr, x.array.data.ptr, x.array.data.ptr, 1024)
    sptr = ns.ptr
    rows["Launcher call (driver launch only)"] = lambda: ln((4, 1, 1), (256, 1, 1), args, sptr)
    for name, fn in rows.items():
        assert fn is not None
        fn()
        print(f"{name:36s} {per_call(fn):7.2f} us", flush=True)
        s.synchronize()
        torch.cuda.synchronize()
    if "--profile" in sys.argv:
        for name in ("kernels.add(x, x).async_on", "kernels.saxpy(part, 1.0, x).async_on",
                     "kernels.argmax(logits, out=tok).async_on"):
            fn = rows[name]
            assert fn is not None
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(5000):
                fn()
            pr.disable()
            s.synchronize()
            print(f"--- cProfile: {name} x 5000")
            pstats.Stats(pr).sort_stats("tottime").print_stats(14)


def _with(ns: Any, cp: Any, f32: Any) -> Any:
    with ns:
        return cp.empty((1024,), f32)


def _enter(ns: Any) -> None:
    with ns:
        pass


if __name__ == "__main__":
    main()
