"""The reference timing helpers of ``benchmarks/attention.py``: torch tensors as CuPy
arrays (:func:`_to_cupy`), the median of CUDA-event-timed calls on torch's or a CuPy stream
(:func:`_time_torch`, :func:`_time_cupy`), the device-to-device copy bandwidth the decode
points compare with (:func:`_copy_gbs`), and :class:`_Timer`, the decode tables' device
timer (host hidden behind a spin, L2 flushed before every call, names interleaved)."""

from __future__ import annotations

import random
import statistics
from typing import Any

import numpy as np


def _to_cupy(t: Any) -> Any:
    import cupy
    import torch

    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return cupy.from_dlpack(t.view(torch.int16)).view(np.dtype(ml_dtypes.bfloat16))
    return cupy.from_dlpack(t)


def _time_torch(fn: Any, iters: int, warmup: int = 3) -> float:
    import torch

    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def _time_cupy(fn: Any, stream: Any, iters: int, warmup: int = 3) -> float:
    import cupy

    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record(stream)
        fn()
        b.record(stream)
        b.synchronize()
        ts.append(cupy.cuda.get_elapsed_time(a, b))
    return statistics.median(ts)


def _copy_gbs(stream: Any) -> float:
    """Device-to-device copy bandwidth of a 1 GiB buffer (bytes read + written)."""
    import cupy

    n = 1 << 30
    src = cupy.empty(n, dtype=cupy.uint8)
    src.view(cupy.float32)[:] = 1.0
    dst = cupy.empty_like(src)

    def copy() -> None:
        dst.data.copy_from_device_async(src.data, n, stream=stream)

    ms = _time_cupy(copy, stream, 20)
    return 2 * n / ms / 1e6


L2_BYTES = 50 << 20


class _Timer:
    """Device time of one call with the host hidden behind a spin queued first."""

    def __init__(self) -> None:
        import cupy
        import torch

        self.torch = torch
        self.ts = torch.cuda.current_stream()
        self.stream = cupy.cuda.ExternalStream(self.ts.cuda_stream)
        self.clock_hz = cupy.cuda.Device().attributes["ClockRate"] * 1e3

    def median_us(self, calls: list[Any], reps: int, spin_us: float = 250.0) -> float:
        torch = self.torch
        for fn in calls[:3]:  # warm-up (compiles)
            fn()
        torch.cuda.synchronize()
        ts = []
        for r in range(reps):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(int(spin_us * 1e-6 * self.clock_hz))
            a.record(self.ts)
            calls[r % len(calls)]()
            b.record(self.ts)
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3)
        return statistics.median(ts)

    def flush_l2(self) -> None:
        """Read a buffer of 1.5x the L2 size, so the next call finds none of its data in L2
        (the buffer's lines are clean: evicting them costs the timed call no write-back)."""
        torch = self.torch
        if getattr(self, "_flush_buf", None) is None:
            self._flush_buf = torch.ones(3 * L2_BYTES // 8, dtype=torch.float32, device="cuda")
        self._flush_buf.sum()

    def compare_samples(self, named: dict[str, list[Any]], reps: int, spin_us: float = 250.0,
                        seed: int = 0) -> dict[str, list[float]]:
        """Every timed sample (device µs) of each named call list, the names interleaved rep
        by rep in a fresh random order each rep (seeded), so clock or thermal drift and
        whatever one call leaves behind hit all names alike. Before each call, L2 is flushed
        (:meth:`flush_l2`) and a spin kernel is queued; consecutive calls take consecutive
        data sets (the lists index the same sets)."""
        torch = self.torch
        for calls in named.values():  # warm-up (compiles)
            for fn in calls[:3]:
                fn()
        torch.cuda.synchronize()
        rng = random.Random(seed)
        names = list(named)
        ts: dict[str, list[float]] = {n: [] for n in names}
        k = 0
        for _ in range(reps):
            order = names[:]
            rng.shuffle(order)
            for name in order:
                calls = named[name]
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                self.flush_l2()
                torch.cuda._sleep(int(spin_us * 1e-6 * self.clock_hz))
                a.record(self.ts)
                calls[k % len(calls)]()
                k += 1
                b.record(self.ts)
                b.synchronize()
                ts[name].append(a.elapsed_time(b) * 1e3)
        return ts

    def compare_us(self, named: dict[str, list[Any]], reps: int, spin_us: float = 250.0) -> dict[str, float]:
        """Median device µs of each named call list (:meth:`compare_samples`: interleaved in
        random order, L2 flushed before every call)."""
        return {n: statistics.median(v) for n, v in self.compare_samples(named, reps, spin_us).items()}
