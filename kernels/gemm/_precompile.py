"""The GEMM kernel variants, for compiling them ahead of time (``python -m deviceops.precompile``,
``tools/gemm_precompile.py``).

Part of the gemm family (the variants are the GEMM planner's); the compiling itself is the
runtime's (:mod:`..runtime._module`). A variant is ``(source file, function, defines, arch
suffix)``, exactly what the launchers pass to :func:`._cuda._kernel`, so compiling one here fills the same cache entries
(in-process and CuPy's on-disk cache, keyed by source and options) that the first launch
would otherwise fill. The sm_90a variants (TMA, ``wgmma``) exist only for compute
capability 9.0.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Variant", "compile_gemm_variant", "gemm_variants"]

Variant = tuple[str, str, tuple[str, ...], str]


def gemm_variants(cc: int = 90) -> list[Variant]:
    """Every GEMM variant a device of compute capability ``cc`` (e.g. 90, 86) may launch."""
    from . import _plan as _gemm

    out: list[Variant] = []
    for tb in (0, 1):
        for wm in (1, 2):
            for tf32, bf16 in ((0, 0), (0, 1), (1, 0)):
                out.append(("gemm_sm80.cu", "gemm_sm80",
                            (f"WARPS_M={wm}", f"GEMM_TF32={tf32}", f"GEMM_BF16={bf16}",
                             f"GEMM_TRANS_B={tb}"), ""))
        out.append(("gemm_simt.cu", "gemm_simt", (f"GEMM_TRANS_B={tb}",), ""))
        if cc != 90:
            continue
        for bn, ncw, st in _gemm.SM90_CONFIGS.values():
            for bf16 in (0, 1):
                for plain, epi_tma in ((0, 0), (0, 1), (1, 1)):
                    out.append(("gemm_sm90.cu", "gemm_sm90",
                                (f"BN={bn}", f"NCW={ncw}", f"STAGES={st}", f"GEMM_BF16={bf16}",
                                 f"GEMM_EPI_PLAIN={plain}", f"GEMM_TRANS_B={tb}",
                                 f"GEMM_EPI_TMA={epi_tma}"), "a"))
    for bf16 in (0, 1):
        for mr in (1, 2, 4, 8):
            out.append(("gemm_gemv.cu", "gemm_gemv", (f"GEMM_BF16={bf16}", "GV_CL=8", f"GV_MR={mr}"),
                        ""))
        out.append(("gemm_reduce.cu", "gemm_splitk_reduce", ("GEMM_OUT_F32=0", f"GEMM_BF16={bf16}"),
                    ""))
        for m in range(1, _gemm.SKINNY_MAX_M + 1, 8):
            for nk in (4096, 576):  # large and small weights
                mf, tr, u, _, _ = _gemm.skinny_config(1, m, nk, nk)
                v = ("gemm_skinny.cu", "gemm_skinny",
                     (f"SK_MF={mf}", f"SK_TR={tr}", f"SK_U={u}", f"GEMM_BF16={bf16}"), "")
                if v not in out:
                    out.append(v)
    out.append(("gemm_reduce.cu", "gemm_splitk_reduce", ("GEMM_OUT_F32=1", "GEMM_BF16=0"), ""))
    return out


def compile_gemm_variant(device_id: int, v: Variant) -> Any:
    """Compile (or load from the cache) variant ``v`` for CUDA device ``device_id``."""
    from . import _cuda as _gemm_cuda

    return _gemm_cuda._kernel(device_id, v[0], v[1], v[2], v[3])
