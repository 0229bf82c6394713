"""The BLAS thread count of the cpu backend's GEMMs (:mod:`._cpu`): one process-wide
choice, OpenBLAS's, made once at import from the load average unless asked to adapt.

``DEVICEOPS_CPU_BLAS_THREADS`` (``auto``, ``0`` or a count) and ``DEVICEOPS_CPU_BLAS_ADAPT``
are described in :class:`BlasThreads`.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np

from deviceops import _env

__all__ = ["BlasThreads", "adaptive_blas", "blas"]


def adaptive_blas() -> bool:
    """Whether ``DEVICEOPS_CPU_BLAS_ADAPT=1`` asks for the measured, revised thread count
    (:class:`BlasThreads`; only safe while one thread at a time runs GEMMs). Default: the
    count is chosen once, at import, from the load average."""
    return _env.get("DEVICEOPS_CPU_BLAS_ADAPT") == "1"


def _openblas() -> tuple[Any, Any] | None:
    """``(set_num_threads, get_num_threads)`` of the OpenBLAS NumPy runs, or ``None``."""
    import ctypes

    paths: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "openblas" in line.lower()
                            and line.split()[-1].startswith("/")})
    except OSError:
        pass
    if not paths:
        import glob

        base = os.path.dirname(os.path.dirname(np.__file__))
        paths = glob.glob(os.path.join(base, "numpy.libs", "*openblas*")) + glob.glob(
            os.path.join(os.path.dirname(np.__file__), ".dylibs", "*openblas*"))
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for suffix in ("64_", "_64_", ""):
            for prefix in ("scipy_openblas", "openblas"):
                try:
                    set_n = getattr(lib, f"{prefix}_set_num_threads{suffix}")
                    get_n = getattr(lib, f"{prefix}_get_num_threads{suffix}")
                except AttributeError:
                    continue
                set_n.argtypes, set_n.restype = [ctypes.c_int], None
                get_n.argtypes, get_n.restype = [], ctypes.c_int
                return set_n, get_n
    return None


class BlasThreads:
    """The BLAS thread count of the cpu GEMMs: 1 or all, chosen by measuring.

    A GEMM of a decode step reads a weight once (tens of microseconds). With every core
    free, splitting it over all BLAS threads is faster (2 cores: batch-1 decode 29 ms a
    token with 2 threads, 43 ms with 1); with the cores busy (another process), OpenBLAS's
    threads wait for each other a scheduler tick at a time and the same step takes 2-10x
    longer (median 92 ms, 90th percentile 480 ms with 2 threads; 48 / 68 ms with 1). And
    changing the count between calls costs a thread wake-up each time, so the choice is
    process-wide and revised per window of :attr:`WINDOW` GEMMs. It starts at one thread,
    and every thread is considered only while the other processes leave the cores free (the
    1-minute load average less this process's GEMM threads is at most half a core; trying
    the other count costs most exactly when they do not). Each window measures the time per
    multiply-add of its GEMMs; every :attr:`EXPLORE` windows one window tries the other
    count, and the faster one is kept. A try that confirms the choice doubles the
    interval to the next (up to 64x); a try that wins switches and resets it; a kept choice
    whose windows get slower than the other's last measurement is dropped at once. GEMMs below
    :attr:`MIN_MACS` always run on one thread (not counted).

    ``DEVICEOPS_CPU_BLAS_THREADS``: ``auto`` (default: every thread if the load average
    leaves the cores free at import, else one, then fixed; the revising scheme above only
    with ``DEVICEOPS_CPU_BLAS_ADAPT=1``), or a fixed count (``1``, ``2``, ...; ``0``: leave
    the BLAS alone). Without a controllable OpenBLAS (another BLAS) the
    BLAS is left as configured. The setting is OpenBLAS's, process-wide: NumPy code of the
    application runs with the count last set.
    """

    WINDOW = 256  # GEMMs per measurement window (about two decode steps of a 30-layer model)
    EXPLORE = 8  # windows between two tries of the other count (doubling to 64x on confirm)
    MIN_MACS = 1 << 16  # below this many multiply-adds: one thread, not measured

    def __init__(self, setting: str | None = None) -> None:
        raw = (_env.get("DEVICEOPS_CPU_BLAS_THREADS") if setting is None
               else setting).strip().lower()
        self.ctl = _openblas()
        self.max = 1
        if self.ctl is not None:
            try:
                self.max = max(1, int(self.ctl[1]()))
            except Exception:
                self.ctl = None
        if raw in ("", "auto"):
            self.fixed: int | None = None
        else:
            try:
                self.fixed = int(raw)
            except ValueError:
                raise ValueError(f"DEVICEOPS_CPU_BLAS_THREADS={raw!r}: use auto, 0 (leave the "
                                 "BLAS alone) or a thread count") from None
            if self.fixed < 0:
                raise ValueError(f"DEVICEOPS_CPU_BLAS_THREADS={raw!r} must be >= 0")
        self.current = self.max
        self.many = False  # the kept choice: every thread (else one)
        self.trying = False  # this window tries the other choice
        self.cost = [0.0, 0.0]  # seconds per multiply-add, [one thread, every thread]
        self.calls = 0
        self.win_s = 0.0
        self.win_macs = 0
        self.windows = 0  # windows since the last try
        self.interval = float(self.EXPLORE)
        self._lock = threading.Lock()
        if self.ctl is not None and self.fixed:
            self._set(self.fixed)
        elif self.ctl is not None and self.fixed is None and not adaptive_blas():
            # auto, decided once here, before any stream thread runs a GEMM: OpenBLAS's
            # set_num_threads while another thread is inside a BLAS call is not safe (it
            # crashed a GPU-machine test run with two cpu devices multiplying at once)
            self.fixed = self.max if self._spare_cores() else 1
            self._set(self.fixed)

    @property
    def adaptive(self) -> bool:
        """True when the count is chosen by measuring (OpenBLAS found, ``auto``, > 1 core)."""
        return self.ctl is not None and self.fixed is None and self.max > 1

    def _set(self, n: int) -> None:
        if n != self.current and self.ctl is not None:
            self.ctl[0](n)
            self.current = n

    def threads(self) -> int:
        """The count the current window runs with."""
        return self.max if self.many != self.trying else 1

    def matmul(self, a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``np.matmul(a, b, out=out)`` under the current choice (see the class docstring)."""
        if not self.adaptive:
            return np.matmul(a, b, out=out)
        macs = a.size * (b.shape[-1] if b.ndim > 1 else 1)
        if macs < self.MIN_MACS:  # (tiny: one thread, outside the measurement)
            return np.matmul(a, b, out=out)
        self._set(self.threads())
        t0 = time.perf_counter()
        r = np.matmul(a, b, out=out)
        self.record(macs, time.perf_counter() - t0)
        return r

    def record(self, macs: int, seconds: float) -> None:
        """Count one measured GEMM; at the end of a window, update the choice."""
        with self._lock:
            self.calls += 1
            self.win_s += seconds
            self.win_macs += macs
            if self.calls < self.WINDOW:
                return
            per = self.win_s / max(self.win_macs, 1)
            used_many = self.many != self.trying
            i = 1 if used_many else 0
            self.cost[i] = per if self.cost[i] == 0.0 else 0.5 * (self.cost[i] + per)
            self.calls, self.win_s, self.win_macs = 0, 0.0, 0
            if self.trying:
                self.trying = False
                better_many = self.cost[1] < self.cost[0]
                if better_many == self.many:  # confirmed: try less often
                    self.interval = min(self.interval * 2.0, self.EXPLORE * 64.0)
                else:
                    self.many = better_many
                    self.interval = float(self.EXPLORE)
                self.windows = 0
                return
            if not self._spare_cores():  # other processes want the cores: one thread
                self.many = False
                return
            if self.cost[0] == 0.0 or self.cost[1] == 0.0:  # one window of each first
                self.trying = True
                return
            if (self.cost[1] < self.cost[0]) != self.many:  # the kept choice got slower
                self.many = not self.many
                self.interval = float(self.EXPLORE)
                self.windows = 0
                return
            self.windows += 1
            if self.windows >= self.interval:
                self.trying = True

    def _spare_cores(self) -> bool:
        """Whether the other processes leave the cores free enough for every BLAS thread:
        the 1-minute load average less this process's own GEMM threads is at most half a
        core (unknown load: yes)."""
        try:
            load = os.getloadavg()[0]
        except (OSError, AttributeError):
            return True
        return load - self.threads() <= 0.5


blas = BlasThreads()
