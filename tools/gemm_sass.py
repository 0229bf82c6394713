"""Compile every GEMM kernel variant with nvcc (sm_90a) and report registers, spills and
the tensor-core / local-memory instructions in its SASS (needs nvcc and cuobjdump).

Usage: ``python tools/gemm_sass.py [OUTDIR]``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deviceops.kernels import _gemm, _gemm_cuda

VARIANTS = [
    ("gemm_sm90.cu", f"BN={bn} NCW={ncw} STAGES={st} GEMM_BF16=1 SM90_CL={cl}")
    for bn, ncw, st, cl in _gemm.SM90_CONFIGS.values()
] + [
    ("gemm_sm80.cu", "WARPS_M=2 GEMM_BF16=1"),
    ("gemm_sm80.cu", "WARPS_M=1 GEMM_TF32=1"),
    ("gemm_simt.cu", ""),
    ("gemm_reduce.cu", "GEMM_BF16=1"),
    ("gemm_gemv.cu", "GEMM_BF16=1 GV_CL=8 GV_MR=1"),
]


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    tmp = Path(tempfile.mkdtemp())
    for file, defs in VARIANTS:
        src = tmp / file
        src.write_text(_gemm_cuda.expanded_source(file))
        cubin = tmp / "k.cubin"
        flags = [f"-D{d}" for d in defs.split()]
        r = subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-std=c++17", "-o", str(cubin),
                            "--resource-usage", *flags, str(src)], capture_output=True, text=True)  # fmt: skip
        usage = " ".join(re.findall(r"(Used \d+ registers|\d+ bytes spill stores|\d+ bytes stack frame)", r.stderr))
        warn = [ln for ln in r.stderr.splitlines() if "warning" in ln and "pragma once" not in ln]
        sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True).stdout
        counts = {op: len(re.findall(rf"\b{op}\b", sass)) for op in ("HGMMA", "HMMA", "FFMA", "LDL", "STL", "UTMALDG")}
        print(f"{file:16s} {defs:40s} {usage} {counts} {warn[:2]}")
        (out / f"sass_{file.replace('.cu', '')}_{'_'.join(defs.split()).replace('=', '')}.txt").write_text(sass) if len(
            list(out.glob("sass_*"))) < 3 else None  # fmt: skip


if __name__ == "__main__":
    main()
