"""Shape sweep for ``compute-sanitizer --tool memcheck`` over every GEMM path (GPU only).

Usage: ``compute-sanitizer --tool memcheck --error-exitcode 3 python3 tools/gemm_sanitize.py``.
Each case runs once on small odd shapes (tails in M, N, K; batches; split-K; every
sm_90 config, sm_80, tf32, SIMT, the skinny and TMA skinny kernels; b as (K, N) and, with trans_b, as
(N, K)) and is checked against the NumPy reference.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ml_dtypes

from deviceops.kernels.gemm import GemmOverride, gemm_cuda, gemm_reference
from deviceops.kernels.runtime import overrides

BF16 = np.dtype(ml_dtypes.bfloat16)


def main() -> None:
    import cupy as cp

    rng = np.random.default_rng(7)
    stream = cp.cuda.Stream(non_blocking=True)
    cases = []
    for m, n, k in [(1, 8, 8), (1, 768, 768), (67, 136, 200), (130, 264, 72), (257, 520, 136), (5, 3, 7), (33, 17, 129)]:
        for dt, kind in [(np.dtype(np.float16), "f16"), (BF16, "bf16")]:
            forces = [GemmOverride(path="sm80"), GemmOverride(path="sm80", splits=3), None]
            if n % 8 == 0 and k % 8 == 0:
                forces += [GemmOverride(path="sm90", sm90_tile="128x256"), GemmOverride(path="sm90", sm90_tile="128x128"), GemmOverride(path="sm90", sm90_tile="64x128"), GemmOverride(path="sm90", sm90_tile="64x128", splits=3), GemmOverride(path="sm90", sm90_tile="128x256", splits=2)]
            cases += [(m, n, k, dt, kind, f, (), False) for f in forces]
        cases += [(m, n, k, np.dtype(np.float32), "f32", f, (), False) for f in (None, GemmOverride(path="simt", splits=3))]
        cases += [(m, n, k, np.dtype(np.float32), "tf32", f, (), False) for f in (None, GemmOverride(path="sm80", splits=2))]
    cases += [(3, 136, 72, BF16, "bf16", None, (3,), True), (2, 64, 40, np.dtype(np.float16), "f16", None, (2,), False),
              (65, 136, 72, BF16, "bf16", GemmOverride(path="sm90", sm90_tile="128x128"), (3,), True), (65, 136, 72, BF16, "bf16", None, (2, 2), False),
              (31, 24, 40, np.dtype(np.float32), "f32", None, (3,), True)]  # fmt: skip
    trans_forces = (None, GemmOverride(path="sm80"), GemmOverride(path="sm80", splits=3), GemmOverride(path="sm90", sm90_tile="128x256"), GemmOverride(path="sm90", sm90_tile="64x128", splits=3), GemmOverride(path="simt", splits=3), GemmOverride(path="sm80", splits=2))
    cases = [(*c, False) for c in cases] + [(*c, True) for c in cases if c[5] in trans_forces]
    f16 = np.dtype(np.float16)
    for m, n, k in [(1, 8, 8), (3, 33, 584), (9, 130, 1000), (32, 72, 1536), (64, 24, 40), (17, 200, 72)]:
        for dt in (f16, BF16):
            cases += [(m, n, k, dt, "16", f, (), False, True) for f in (GemmOverride(path="skinny"), GemmOverride(path="skinny", skinny_k_warps=1), GemmOverride(path="skinny", skinny_k_warps=3))]
            cases += [(m, n, k, dt, "16", f, (), False, True) for f in (GemmOverride(path="tma"), GemmOverride(path="tma", tma_k_slices=1), GemmOverride(path="tma", tma_k_slices=3), GemmOverride(path="tma", tma_k_slices=1, tma_stages=6), GemmOverride(path="tma", tma_k_slices=2, tma_stages=8, tma_warpgroups=1), GemmOverride(path="tma", tma_warpgroups=1, tma_persistent=True), GemmOverride(path="tma", tma_stages=4, tma_warpgroups=2, tma_persistent=True), GemmOverride(path="tma", tma_k_slices=1, tma_stages=10, tma_warpgroups=2, tma_persistent=False, tma_multicast=4), GemmOverride(path="tma", tma_k_slices=1, tma_stages=4, tma_warpgroups=1, tma_persistent=False, tma_multicast=2))]
    for f in (GemmOverride(path="tma", tma_warpgroups=1, tma_persistent=True), GemmOverride(path="tma", tma_stages=4, tma_warpgroups=2, tma_persistent=True), None, GemmOverride(path="tma", tma_k_slices=1, tma_stages=10, tma_warpgroups=2, tma_persistent=False, tma_multicast=4), GemmOverride(path="tma", tma_k_slices=1, tma_stages=4, tma_warpgroups=1, tma_persistent=False, tma_multicast=2)):  # persistent (several
        # tiles a block; planned: None) and activation multicast over many clusters
        cases += [(33, 26008, 136, BF16, "bf16", f, (), False, True), (5, 49160, 72, f16, "f16", f, (), False, True)]
    cases += [(5, 72, 200, BF16, "bf16", GemmOverride(path="skinny"), (3,), True, True), (5, 72, 200, f16, "f16", GemmOverride(path="skinny"), (2, 3), False, True),
              (5, 72, 200, BF16, "bf16", GemmOverride(path="tma", tma_k_slices=2), (3,), True, True), (3, 72, 200, f16, "f16", GemmOverride(path="tma"), (2, 3), False, True)]
    only = os.environ.get("GEMM_SANITIZE_ONLY", "")  # e.g. GemmOverride(path="skinny"): forced-path substring
    cases = [c for c in cases if only in str(c[5])]
    worst = 0.0
    for idx, (m, n, k, dt, kind, force, batch, bb, tb) in enumerate(cases):
        beta = 1.0 if idx % 2 else 0.0  # beta == 0: the sm_90 TMA-store epilogue
        a = rng.standard_normal((*batch, m, k)).astype(dt)
        b = rng.standard_normal((*batch, k, n) if bb else (k, n)).astype(dt)
        if tb:
            b = np.ascontiguousarray(np.swapaxes(b, -1, -2))
        bias = rng.standard_normal((n,)).astype(dt)
        c = rng.standard_normal((*batch, m, n)).astype(dt)
        tf32 = kind == "tf32"
        ref = gemm_reference(a, b, bias=bias, activation="gelu", alpha=0.5, beta=beta, c=c, tf32=tf32,
                                   trans_b=tb)
        out = cp.asarray(c)
        ws = cp.empty(4 * c.size + 64, dtype=np.float32)
        with overrides(*(() if force is None else (force,))):
            gemm_cuda(cp.asarray(a), cp.asarray(b), out, bias=cp.asarray(bias), activation="gelu", alpha=0.5,
                            beta=beta, tf32=tf32, trans_b=tb, workspace=ws, stream=stream)  # fmt: skip
        stream.synchronize()
        o = cp.asnumpy(out).astype(np.float64)
        r = ref.astype(np.float64)
        err = float(np.linalg.norm(o - r) / np.linalg.norm(r))
        worst = max(worst, err)
        assert err < 2e-2, (m, n, k, kind, force, tb, err)
    print(f"gemm_sanitize: {len(cases)} cases ok, worst rel err vs reference {worst:.2e}")


if __name__ == "__main__":
    main()
