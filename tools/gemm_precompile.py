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
    from deviceops.kernels import _gemm

    out: list[Variant] = []
    for tb in (0, 1):
        for wm in (1, 2):
            for tf32, bf16 in ((0, 0), (0, 1), (1, 0)):
                out.append(("gemm_sm80.cu", "gemm_sm80",
                            (f"WARPS_M={wm}", f"GEMM_TF32={tf32}", f"GEMM_BF16={bf16}", f"GEMM_TRANS_B={tb}"), ""))
        out.append(("gemm_simt.cu", "gemm_simt", (f"GEMM_TRANS_B={tb}",), ""))
        for bn, ncw, st, cl in _gemm.SM90_CONFIGS.values():
            for bf16 in (0, 1):
                for plain, epi_tma in ((0, 0), (0, 1), (1, 1)):
                    out.append(("gemm_sm90.cu", "gemm_sm90",
                                (f"BN={bn}", f"NCW={ncw}", f"STAGES={st}", f"GEMM_BF16={bf16}",
                                 f"GEMM_EPI_PLAIN={plain}", f"GEMM_TRANS_B={tb}", f"SM90_CL={cl}",
                                 f"GEMM_EPI_TMA={epi_tma}"), "a"))
    for bf16 in (0, 1):
        for mr in (1, 2, 4, 8):
            out.append(("gemm_gemv.cu", "gemm_gemv", (f"GEMM_BF16={bf16}", "GV_CL=8", f"GV_MR={mr}"), ""))
        out.append(("gemm_reduce.cu", "gemm_splitk_reduce", ("GEMM_OUT_F32=0", f"GEMM_BF16={bf16}"), ""))
        for m in range(1, _gemm.SKINNY_MAX_M + 1, 8):
            for nk in (4096, 576):  # large and small weights
                mf, tr, u, _, _ = _gemm.skinny_config(1, m, nk, nk)
                v = ("gemm_skinny.cu", "gemm_skinny", (f"SK_MF={mf}", f"SK_TR={tr}", f"SK_U={u}", f"GEMM_BF16={bf16}"),
                     "")
                if v not in out:
                    out.append(v)
    out.append(("gemm_reduce.cu", "gemm_splitk_reduce", ("GEMM_OUT_F32=1", "GEMM_BF16=0"), ""))
    return out


def _compile(v: Variant) -> tuple[str, float, str]:
    from deviceops.kernels import _gemm_cuda

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
