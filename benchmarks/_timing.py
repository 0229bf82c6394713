"""The timing helpers of the benchmarks, re-exported by ``_common.py``: :func:`no_gc` keeps
the cyclic GC out of a timed region, :func:`interleave` runs several variants round-robin
(so drift hits all of them alike) and returns per-sample seconds, timed with
``perf_counter`` around code that ends by synchronizing; :func:`median` and :func:`pct`
summarise them; :class:`EventTimer` times device spans of a CuPy stream with CUDA events.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np


@contextmanager
def no_gc() -> Iterator[None]:
    """Collect once, then keep the cyclic GC out of the timed region (as ``timeit`` does)."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def interleave(variants: dict[str, Callable[[], Any]], samples: int, warmup: int = 2,
               before: Callable[[str], Any] | None = None,
               after: Callable[[str, Any], Any] | None = None) -> dict[str, list[float]]:
    """Time each variant ``samples`` times, round-robin, rotating the order.

    Each call of a variant is one sample, timed on the host with
    ``perf_counter``; a variant must end by synchronizing (its device work is
    inside the sample). ``before(name)`` runs untimed before each call (reset
    buffers), ``after(name, result)`` untimed after it (check results).
    Warm-up calls are timed for nothing but still go through before/after.
    """
    names = list(variants)
    out: dict[str, list[float]] = {n: [] for n in names}
    with no_gc():
        for i in range(warmup + samples):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                if before is not None:
                    before(name)
                fn = variants[name]
                t0 = time.perf_counter()
                res = fn()
                dt = time.perf_counter() - t0
                if after is not None:
                    after(name, res)
                if i >= warmup:
                    out[name].append(dt)
    return out


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def pct(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear interpolation."""
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q))


class EventTimer:
    """Device time between two points of a CuPy stream (CUDA events with timing)."""

    def __init__(self, cp: Any, native_stream: Any) -> None:
        self.cp = cp
        self.stream = native_stream
        self.start = cp.cuda.Event()
        self.stop = cp.cuda.Event()

    def begin(self) -> None:
        self.start.record(self.stream)

    def end(self) -> None:
        self.stop.record(self.stream)

    def seconds(self) -> float:
        """Elapsed seconds (synchronizes on the stop event)."""
        self.stop.synchronize()
        return float(self.cp.cuda.get_elapsed_time(self.start, self.stop)) * 1e-3
