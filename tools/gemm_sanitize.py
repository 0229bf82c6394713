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

from deviceops.kernels import _gemm
from deviceops.kernels._experiment import overrides

BF16 = np.dtype(ml_dtypes.bfloat16)


def main() -> None:
    import cupy as cp

    rng = np.random.default_rng(7)
    stream = cp.cuda.Stream(non_blocking=True)
    cases = []
    for m, n, k in [(1, 8, 8), (1, 768, 768), (67, 136, 200), (130, 264, 72), (257, 520, 136), (5, 3, 7), (33, 17, 129)]:
        for dt, kind in [(np.dtype(np.float16), "f16"), (BF16, "bf16")]:
            forces = ["sm80", "sm80:3", None]
            if n % 8 == 0 and k % 8 == 0:
                forces += ["128x256", "128x128", "64x128", "64x128:3", "128x256:2", "128x256c2", "128x128c2",
                           "128x256c2:2"]
            cases += [(m, n, k, dt, kind, f, (), False) for f in forces]
        cases += [(m, n, k, np.dtype(np.float32), "f32", f, (), False) for f in (None, "simt:3")]
        cases += [(m, n, k, np.dtype(np.float32), "tf32", f, (), False) for f in (None, "sm80:2")]
    cases += [(3, 136, 72, BF16, "bf16", None, (3,), True), (2, 64, 40, np.dtype(np.float16), "f16", None, (2,), False),
              (65, 136, 72, BF16, "bf16", "128x128", (3,), True), (65, 136, 72, BF16, "bf16", None, (2, 2), False),
              (31, 24, 40, np.dtype(np.float32), "f32", None, (3,), True)]  # fmt: skip
    trans_forces = (None, "sm80", "sm80:3", "128x256", "64x128:3", "simt:3", "sm80:2", "128x256c2", "128x128c2:2")
    cases = [(*c, False) for c in cases] + [(*c, True) for c in cases if c[5] in trans_forces]
    f16 = np.dtype(np.float16)
    for m, n, k in [(1, 8, 8), (3, 33, 584), (9, 130, 1000), (32, 72, 1536), (64, 24, 40), (17, 200, 72)]:
        for dt in (f16, BF16):
            cases += [(m, n, k, dt, "16", f, (), False, True) for f in ("skinny", "skinny:1", "skinny:3")]
            cases += [(m, n, k, dt, "16", f, (), False, True) for f in ("tma", "tma:1", "tma:3", "tma:1:6", "tma:2:8:1", "tma:0:0:1:1", "tma:0:4:2:1", "tma:1:10:2:2:4", "tma:1:4:1:2:2")]
    for f in ("tma:0:0:1:1", "tma:0:4:2:1", None, "tma:1:10:2:2:4", "tma:1:4:1:2:2"):  # persistent (several
        # tiles a block; planned: None) and activation multicast over many clusters
        cases += [(33, 26008, 136, BF16, "bf16", f, (), False, True), (5, 49160, 72, f16, "f16", f, (), False, True)]
    cases += [(5, 72, 200, BF16, "bf16", "skinny", (3,), True, True), (5, 72, 200, f16, "f16", "skinny", (2, 3), False, True),
              (5, 72, 200, BF16, "bf16", "tma:2", (3,), True, True), (3, 72, 200, f16, "f16", "tma", (2, 3), False, True)]
    only = os.environ.get("GEMM_SANITIZE_ONLY", "")  # e.g. "skinny": forced-path substring
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
        ref = _gemm.gemm_reference(a, b, bias=bias, activation="gelu", alpha=0.5, beta=beta, c=c, tf32=tf32,
                                   trans_b=tb)
        out = cp.asarray(c)
        ws = cp.empty(4 * c.size + 64, dtype=np.float32)
        with overrides(gemm_path=force):
            _gemm.gemm_cuda(cp.asarray(a), cp.asarray(b), out, bias=cp.asarray(bias), activation="gelu", alpha=0.5,
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
