"""GEMV kernel variants (b as (K, N), M <= 8) beside cuBLAS and forced sm_90 tiles (diagnostics).

Each variant of ``kernels/src/gemm_gemv.cu`` (``GV_LPR`` lanes per row segment, ``GV_PF``
prefetch, ``GV_CL`` cluster slices) is checked against a float64 reference (outputs poisoned
with NaN first; a repeat loop on an odd shape counts unwritten outputs), then timed with the
host hidden (``benchmarks/gemm.py``'s timer: a spin first, events around the calls, input sets
larger than L2), interleaved with cuBLAS (``torch.matmul``) in the same run.

Usage (GPU machine): ``python3 tools/gemv_gpu.py [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from gemm import L2_BYTES, _Timer

from deviceops.kernels import _gemm, _gemm_cuda
from deviceops.kernels._experiment import overrides

VARIANTS = [(16, 0, 8), (16, 1, 8), (8, 0, 8), (8, 1, 8), (8, 1, 4), (16, 1, 4)]
SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (576, 3072), (1536, 576), (576, 49152)]  # (K, N)


def launcher(bf16: int, lpr: int, pf: int, cl: int, mr: int) -> object:
    defs = (f"GEMM_BF16={bf16}", f"GV_CL={cl}", f"GV_MR={mr}", f"GV_LPR={lpr}", f"GV_PF={pf}")
    return _gemm_cuda._launcher(0, "gemm_gemv.cu", "gemm_gemv", defs, "ppppiiiqffiiii")


def run(ln: object, var: tuple[int, int, int], a: object, b: object, o: object, m: int, n: int, k: int,
        sp: int) -> None:
    lpr, _, cl = var
    a_vec = int(k % 8 == 0)
    ln((math.ceil(n / (8 * lpr)), cl, 1), (256, 1, 1),  # type: ignore[operator]
       (a.data.ptr, b.data.ptr, o.data.ptr, o.data.ptr, m, n, k, 0, 1.0, 0.0, 0, 0, 0, a_vec), sp)


def time_shape(timer: _Timer, cs: object, m: int, k: int, n: int) -> dict[str, object]:
    import cupy as cp
    import torch

    tdt = torch.bfloat16
    per = (m * k + k * n + m * n) * 2
    ns = max(1, min(64, math.ceil(2 * L2_BYTES / per)))
    xs = [torch.randn((m, k), device="cuda", dtype=tdt) for _ in range(ns)]
    ws = [torch.randn((k, n), device="cuda", dtype=tdt) / math.sqrt(k) for _ in range(ns)]
    os_ = [torch.empty((m, n), device="cuda", dtype=tdt) for _ in range(ns)]
    cx, cw, co = ([cp.from_dlpack(t) for t in ts] for ts in (xs, ws, os_))
    wsp = cp.empty(_gemm.gemm_workspace_nbytes((m, k), (k, n), np.dtype("float16"), False) // 4 + 1,
                   dtype=np.float32)
    torch.cuda.synchronize()
    mr = 1 << max(0, (m - 1).bit_length())
    sp = cs.ptr  # type: ignore[attr-defined]
    fns = {"cublas": lambda i: torch.matmul(xs[i], ws[i], out=os_[i])}
    for var in VARIANTS:
        ln = launcher(1, var[0], var[1], var[2], mr)
        fns[f"gv{var}"] = lambda i, ln=ln, var=var: run(ln, var, cx[i], cw[i], co[i], m, n, k, sp)
    if m > 1:
        for f in ("64x128", "64x128:4", "sm80:4"):
            def forced(i: int, f: str = f) -> None:
                with overrides(gemm_path=f):
                    _gemm.gemm_cuda(cx[i], cw[i], co[i], workspace=wsp, stream=cs)
            fns[f] = forced
    t = timer.compare(fns, ns, reps=5)
    best = min((v, kk) for kk, v in t.items() if kk != "cublas")
    print(f"M={m} K={k} N={n}: cublas {t['cublas']:.2f}  best {best[1]} {best[0]:.2f} "
          f"({t['cublas'] / best[0]:.3f}x)  " + " ".join(f"{kk}={v:.2f}" for kk, v in t.items()), flush=True)
    return {"M": m, "K": k, "N": n, **{kk: round(v, 2) for kk, v in t.items()}}


def main() -> None:
    import cupy as cp
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    timer = _Timer(torch)
    cs = cp.cuda.ExternalStream(timer.ts.cuda_stream)
    rows = []
    # correctness: every variant, odd shapes, NaN-poisoned outputs, repeated
    rng = np.random.default_rng(3)
    bad = []
    for bf16 in (0, 1):
        tdt = torch.bfloat16 if bf16 else torch.float16
        for var in VARIANTS:
            for m, n, k in [(8, 4104, 4103), (1, 4096, 4096), (3, 136, 7), (8, 1000, 1543), (5, 2056, 3001)]:
                mr = 1 << max(0, (m - 1).bit_length())
                ln = launcher(bf16, var[0], var[1], var[2], mr)
                a = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to("cuda", tdt)
                b = torch.from_numpy(rng.standard_normal((k, n)).astype(np.float32)).to("cuda", tdt)
                ref = a.double() @ b.double()
                ca, cb = cp.from_dlpack(a), cp.from_dlpack(b)
                for rep in range(10):
                    o = torch.full((m, n), float("nan"), device="cuda", dtype=tdt)
                    torch.cuda.synchronize()
                    run(ln, var, ca, cb, cp.from_dlpack(o), m, n, k, cs.ptr)
                    cs.synchronize()
                    nan = int(torch.isnan(o).sum())
                    err = float((o.double() - ref).norm() / ref.norm())
                    if nan or not err < 2e-2:
                        rows_nan = sorted(set(torch.nonzero(torch.isnan(o))[:, 0].tolist()))[:8]
                        cols_nan = torch.nonzero(torch.isnan(o))[:, 1]
                        bad.append((bf16, var, (m, n, k), rep, nan, err, rows_nan,
                                    cols_nan.min().item() if nan else None, cols_nan.max().item() if nan else None))
                        break
    print("correctness failures:", len(bad))
    for x in bad[:20]:
        print("  ", x)
    for (k, n) in SHAPES:
        for m in (1, 2, 4, 8):
            rows.append(time_shape(timer, cs, m, k, n))
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"bad": [repr(x) for x in bad], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
