"""Shape sweep for compute-sanitizer (memcheck / racecheck) over every attention kernel path.

Usage (GPU): ``compute-sanitizer --tool memcheck python3 tools/attention_sanitize.py``.
Prints one line per case with the relative error against the NumPy reference and exits
non-zero on a wrong or non-finite result.
"""

from __future__ import annotations

import sys

import cupy as cp
import ml_dtypes
import numpy as np

from deviceops.kernels import attention as attn
from deviceops.kernels.attention import AttentionOverride
from deviceops.kernels.runtime import overrides

CASES = [
    # (b, hq, hkv, lq, lk, d, causal, dtype, mode)   mode: sm90 | split | nosplit | fallback
    (1, 2, 1, 65, 130, 64, True, "f16", "sm90"),
    (1, 2, 2, 130, 65, 128, True, "bf16", "sm90"),
    (1, 2, 2, 70, 70, 128, False, "f16", "sm90"),
    (1, 1, 1, 33, 90, 256, True, "f16", "sm90"),
    (1, 2, 1, 20, 40, 96, False, "bf16", "sm90"),
    (8, 32, 8, 1, 4096, 128, False, "f16", "nosplit"),
    (2, 32, 8, 1, 4096, 128, False, "f16", "nosplit"),
    (8, 32, 8, 1, 300, 128, False, "f16", "nosplit"),
    (2, 8, 2, 1, 300, 128, False, "f16", "split"),
    (1, 24, 2, 3, 129, 96, True, "bf16", "split"),
    (1, 4, 2, 33, 17, 40, True, "f16", "fallback"),
]


def main() -> int:
    rng = np.random.default_rng()
    bad = 0
    stream = cp.cuda.Stream(non_blocking=True)
    for b, hq, hkv, lq, lk, d, causal, dn, mode in CASES:
        dt = np.dtype(np.float16) if dn == "f16" else np.dtype(ml_dtypes.bfloat16)
        q = rng.standard_normal((b, hq, lq, d)).astype(dt)
        k = rng.standard_normal((b, hkv, lk, d)).astype(dt)
        v = rng.standard_normal((b, hkv, lk, d)).astype(dt)
        dq, dk, dv = cp.asarray(q), cp.asarray(k), cp.asarray(v)
        out = cp.empty(q.shape, dtype=dt)
        out.view(cp.uint16).fill(0x7E00 if dn == "f16" else 0x7FC0)
        ws = None
        if mode == "split":
            ws = cp.empty(attn.attention_workspace_nbytes(q.shape, k.shape, dt), dtype=cp.uint8)
        cp.cuda.Device().synchronize()  # poison fill ran on the null stream
        with overrides(AttentionOverride(path="splitkv" if mode == "fallback" else None)):
            attn.flash_attention_cuda(dq, dk, dv, out, causal=causal, workspace=ws, stream=stream)
        stream.synchronize()
        o = cp.asnumpy(out).astype(np.float64)
        ref = attn.attention_reference(q, k, v, causal=causal).astype(np.float64)
        err = float(np.linalg.norm(o - ref) / max(float(np.linalg.norm(ref)), 1e-30))
        n_nan = int(np.isnan(o).sum())
        ok = n_nan == 0 and err < (2e-3 if dn == "f16" else 1e-2)
        bad += not ok
        print(f"{mode:8} {(b, hq, hkv, lq, lk, d, causal, dn)}: err={err:.2e} nan={n_nan} {'ok' if ok else 'FAIL'}",
              flush=True)  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
