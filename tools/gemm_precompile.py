"""Compile every GEMM kernel variant in parallel processes, filling CuPy's on-disk kernel cache.

Usage (GPU machine, repo root): ``python3 tools/gemm_precompile.py [-j JOBS]``.

NVRTC takes 3-6 s per variant and a fresh machine has an empty cache; tests, the sanitizer
sweep and the benchmark then load the cached binaries instead of compiling one by one.
Each worker calls the launcher's own ``_kernel`` (same source, options and architecture,
so the same cache keys).
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

Variant = tuple[str, str, tuple[str, ...], str]


def variants() -> list[Variant]:
    """Every GEMM variant of an sm_90 GPU (the list lives in ``kernels/_precompile.py``, which
    ``python -m deviceops.precompile`` uses too)."""
    from deviceops.kernels.gemm._precompile import gemm_variants

    return gemm_variants(90)


def _compile(v: Variant) -> tuple[str, float, str]:
    from deviceops.kernels.gemm import _cuda as _gemm_cuda

    t0 = time.perf_counter()
    try:
        _gemm_cuda._kernel(0, v[0], v[1], v[2], v[3])
        err = ""
    except Exception as exc:  # report, keep going
        err = repr(exc)[:400]
    return f"{v[0]} {' '.join(v[2])}", time.perf_counter() - t0, err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-j", "--jobs", type=int, default=16)
    ap.add_argument("--only", default="", help="compile only sources whose name contains this")
    args = ap.parse_args()
    vs = [v for v in variants() if args.only in v[0]]
    t0 = time.perf_counter()
    bad = 0
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
        for name, _dt, err in ex.map(_compile, vs):
            if err:
                bad += 1
                print(f"FAILED {name}: {err}", flush=True)
    print(f"precompiled {len(vs)} gemm variants in {time.perf_counter() - t0:.1f} s, {bad} failed", flush=True)


if __name__ == "__main__":
    main()
