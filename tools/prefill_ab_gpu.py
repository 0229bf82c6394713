"""Prefill device time with the sm_90 split-K row limit on and off (diagnostics).

Usage (GPU machine, GGUF at $1): ``python3 tools/prefill_ab_gpu.py /tmp/wts/model.gguf``.
"""

from __future__ import annotations

import sys

import numpy as np
from decode import bench_prefill

from deviceops import nn
from deviceops.kernels import _gemm_cuda, _gemm_plan

for limit in (_gemm_plan._SPLIT_MAX_ROWS, 1 << 30):
    _gemm_plan._SPLIT_MAX_ROWS = limit
    _gemm_cuda._plans.clear()
    m = nn.load_gguf(sys.argv[1], dtype="float16", device=0, max_batch=32, max_seq=2304,
                     prefill_chunk=2048, progress=False)
    print(f"split-K row limit {limit}:", flush=True)
    bench_prefill(m, [128, 512, 2048], 10, np.random.default_rng(0))
    del m
