"""The ``--check`` cases of ``benchmarks/attention.py`` (the compute-sanitizer driver):
kv_len, float32, paged-cache and head-dim cases, and the forced bulk-copy K/V ring, each run
through ``flash_attention_cuda`` and compared with the float64 reference."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
from _attention_overrides import current, set_overrides

from deviceops.kernels import attention as attn


def check_cases() -> int:
    """kv_len / float32 / paged / head-dim cases vs the float64 reference (sanitizer driver)."""
    import cupy as cp

    rng = np.random.default_rng()
    stream = cp.cuda.Stream(non_blocking=True)
    bad = 0
    cases = [
        # (b, hq, hkv, lq, lk, d, causal, dtype, ws, paged_bs)
        (3, 9, 3, 1, 300, 64, True, "f16", True, 0),
        (3, 9, 3, 1, 300, 64, True, "f16", False, 0),
        (32, 9, 3, 1, 1024, 64, False, "f16", True, 0),  # SmolLM2 B32: 16 warps, 3 heads a block
        (2, 10, 2, 2, 300, 64, True, "bf16", True, 0),  # g = 5
        (1, 24, 2, 1, 2000, 128, False, "f16", True, 0),  # g = 12: two head chunks of 6
        (3, 32, 8, 4, 700, 128, True, "bf16", True, 0),
        (2, 8, 2, 1, 200, 32, False, "f32", True, 0),
        (2, 4, 2, 40, 130, 128, True, "f16", False, 0),  # prefill (sm90) with kv_len
        (2, 4, 2, 40, 130, 32, True, "bf16", False, 0),
        (2, 4, 2, 20, 90, 64, True, "f32", False, 0),  # float32 prefill (split-KV kernel)
        (3, 8, 2, 1, 100, 64, True, "f16", True, 16),  # paged
        (2, 8, 2, 3, 100, 128, True, "f32", True, 7),
        (2, 8, 2, 12, 60, 64, True, "bf16", False, 16),
    ]
    # The bulk-copy K/V ring, forced (the planner takes it on high-bandwidth GPUs only).
    bulk_cases = [
        ((4, 32, 8, 1, 1500, 128, False, "f16", True, 0), 2, 16, None),
        ((3, 9, 3, 3, 1111, 64, True, "bf16", True, 0), 2, 8, 4),
        ((2, 32, 8, 1, 777, 128, True, "bf16", False, 0), 3, 4, None),
    ]
    base = current()
    for case, bulk, warps, cluster in [(c, None, None, None) for c in cases] + bulk_cases:
        set_overrides(replace(base, bulk_stages=bulk if bulk is not None else base.bulk_stages,
                              split_warps=warps or base.split_warps,
                              cluster=cluster if cluster is not None else base.cluster))
        bad += _check_case(cp, rng, stream, *case)
    set_overrides(base)
    return bad


def _check_case(cp: Any, rng: Any, stream: Any, b: int, hq: int, hkv: int, lq: int, lk: int,
                d: int, causal: bool, dn: str, use_ws: bool, bs: int) -> int:
    """One check case: 1 if it fails (printed either way)."""
    import ml_dtypes

    dt = {"f16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16),
          "f32": np.dtype(np.float32)}[dn]  # fmt: skip
    lo = 1 if lq <= attn.DECODE_MAX_LQ else lq
    kv_len = np.array([lo] + [int(x) for x in rng.integers(lo, lk + 1, b - 1)], np.int32)
    q = rng.standard_normal((b, hq, lq, d)).astype(dt)
    k = rng.standard_normal((b, hkv, lk, d)).astype(dt)
    v = rng.standard_normal((b, hkv, lk, d)).astype(dt)
    for bi, n in enumerate(kv_len):
        k[bi, :, n:] = np.nan
        v[bi, :, n:] = np.nan
    table = None
    kk, vv = k, v
    if bs:
        mb = -(-lk // bs)
        perm = rng.permutation(b * mb).astype(np.int32)
        table = perm.reshape(b, mb)
        pad = mb * bs - lk
        kpad = np.concatenate([k, np.full((b, hkv, pad, d), np.nan, dt)], axis=2)
        vpad = np.concatenate([v, np.full((b, hkv, pad, d), np.nan, dt)], axis=2)
        kk = np.empty((b * mb, hkv, bs, d), dt)
        vv = np.empty((b * mb, hkv, bs, d), dt)
        for bi in range(b):
            for n in range(mb):
                kk[table[bi, n]] = kpad[bi, :, n * bs : (n + 1) * bs]
                vv[table[bi, n]] = vpad[bi, :, n * bs : (n + 1) * bs]
    dq, dk, dv = cp.asarray(q), cp.asarray(kk), cp.asarray(vv)
    dl = cp.asarray(kv_len)
    dbt = None if table is None else cp.asarray(table)
    out = cp.empty(q.shape, dtype=dt)
    if dn == "f32":
        out.fill(cp.nan)
    else:
        out.view(cp.uint16).fill(0x7E00 if dn == "f16" else 0x7FC0)
    ws = None
    if use_ws:
        nb = attn.attention_workspace_nbytes(
            q.shape, kk.shape, dt, block_table_shape=None if table is None else table.shape
        )
        ws = cp.empty(max(nb, 1), dtype=cp.uint8)
    cp.cuda.Device().synchronize()
    attn.flash_attention_cuda(dq, dk, dv, out, causal=causal, kv_len=dl, block_table=dbt,
                              workspace=ws, stream=stream)  # fmt: skip
    stream.synchronize()
    o = cp.asnumpy(out).astype(np.float64)
    f = np.float64
    ref = attn.attention_reference(q.astype(f), k.astype(f), v.astype(f), causal=causal,
                                   kv_len=kv_len)  # fmt: skip
    err = float(np.linalg.norm(o - ref) / max(float(np.linalg.norm(ref)), 1e-30))
    n_nan = int(np.isnan(o).sum())
    tol = {"f16": 2e-3, "bf16": 1e-2, "f32": 1e-5}[dn]
    ok = n_nan == 0 and err < tol
    print(f"check {(b, hq, hkv, lq, lk, d, causal, dn, use_ws, bs)} kv_len={kv_len.tolist()} "
          f"{current()}: "
          f"err={err:.2e} nan={n_nan} {'ok' if ok else 'FAIL'}", flush=True)  # fmt: skip
    return int(not ok)
