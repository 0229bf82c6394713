"""Flash-attention benchmark: deviceops kernels beside torch SDPA (FA2 and cuDNN) in one run.

Usage::

    python benchmarks/attention.py [--json PATH] [--quick] [--variants]   # on a GPU
    python benchmarks/attention.py --smoke                                # anywhere, seconds

Forward points: B*L = 16k tokens, Hq*D = 2048 (Hq = Hkv), L in {1024, 4096, 8192},
D in {64, 128}, causal and not, float16 and bfloat16. FLOPs = 4*B*H*Lq*Lk*D, halved when
causal. Each implementation runs on the same inputs (torch tensors shared with CuPy through
DLPack), timed with CUDA events around each call after warm-up; the median is reported.
The q/k/v set (3 x 64 MiB) exceeds the 50 MiB L2, so no rotation is needed.

Decode point: Lq = 1, Lk = 4096, B = 8, Hq = 32, Hkv = 8, D = 128; 20 calls rotating over
4 input sets (4 x 67 MB, larger than L2) captured in one CUDA graph; bandwidth counts q, k, v
read once and o written once, and is compared with a 1 GiB device-to-device copy timed in the
same run (bytes read + written).

Decode tables (``--decode-tables``, issue 13): GQA 32/8 heads of 128 at B 1/8/32 and
Lk 1k/4k/32k, SmolLM2's 9/3 heads of 64 at B 1/8/32 and Lk 128..2048, Lq = 1, float16.
Device time with the host hidden: a ``torch.cuda._sleep`` spin is queued first on the same
stream, then CUDA events around ONE call; median of ``--reps`` calls rotating over input
sets. Ours and every reference are interleaved call by call in a fresh random order each
rep, and before every call L2 is flushed (a read of 1.5x its size): a call never finds the
K/V that the previous call read in L2 (with one 134 MB set, the call after another reading
the same K/V ran up to 15% faster). Beside it, in the same run and on the same
inputs: torch SDPA (``enable_gqa=True``) with its default backend choice and with each of
the FLASH / EFFICIENT / CUDNN backends that accept the call; "ratio" = best SDPA time /
ours (>= 1.0 means ours is faster). "ours kv_len" is the same call with an int32 kv_len
tensor (= Lk) as a captured decode graph uses; "floor" = KV bytes / copy bandwidth measured
in the same run. ``--decode-sweep`` times split-KV variants (:class:`AttentionOverride` knobs) and
split targets at a few of these points. ``--check`` runs kv_len / float32 / paged cases
against the float64 reference (the compute-sanitizer driver: ``compute-sanitizer --tool
memcheck python3 benchmarks/attention.py --check``).

``--smoke`` runs the NumPy reference on tiny shapes through the same code (no timings).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deviceops.kernels import attention as attn
from deviceops.kernels.attention import AttentionOverride
from deviceops.kernels.runtime import _override


def current() -> AttentionOverride:
    """The attention override this benchmark has installed (the planner's choices when none)."""
    return _override.active(AttentionOverride) or AttentionOverride()


def set_overrides(ov: AttentionOverride) -> AttentionOverride:
    """Install ``ov`` process-wide (this script times one configuration at a time); return the
    previous one."""
    prev = current()
    _override.installed[AttentionOverride] = ov
    return prev

POINTS = [(L, D, causal) for L in (1024, 4096, 8192) for D in (64, 128) for causal in (False, True)]


def flops(b: int, h: int, lq: int, lk: int, d: int, causal: bool) -> float:
    f = 4.0 * b * h * lq * lk * d
    return f / 2 if causal else f


def smoke() -> dict[str, Any]:
    """Run the reference on tiny shapes (no GPU, no timing claims)."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    rows = []
    for dt in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)):
        for lq, lk, d, causal in ((8, 8, 64, False), (5, 9, 128, True), (1, 33, 128, False)):
            q = rng.standard_normal((1, 4, lq, d)).astype(dt)
            k = rng.standard_normal((1, 2, lk, d)).astype(dt)
            v = rng.standard_normal((1, 2, lk, d)).astype(dt)
            attn.attention_check(q.shape, q.dtype, k.shape, k.dtype, v.shape, v.dtype)
            o = attn.attention_reference(q, k, v, causal=causal)
            ok = bool(np.isfinite(o.astype(np.float32)).all())
            rows.append(
                {"dtype": str(dt), "lq": lq, "lk": lk, "d": d, "causal": causal, "finite": ok}
            )
            print(f"smoke {dt!s:9} Lq={lq:3} Lk={lk:3} D={d:3} causal={causal!s:5} finite={ok}")
            assert ok
    # kv_len, float32 and a paged cache through the reference, as the decode tables use them
    q = rng.standard_normal((2, 9, 1, 64)).astype(np.float32)
    k = rng.standard_normal((2, 3, 40, 64)).astype(np.float32)
    v = rng.standard_normal((2, 3, 40, 64)).astype(np.float32)
    kv_len = np.array([7, 40], np.int32)
    o = attn.attention_reference(q, k, v, causal=True, kv_len=kv_len)
    o7 = attn.attention_reference(q[:1], k[:1, :, :7], v[:1, :, :7], causal=True)
    assert np.allclose(o[:1], o7, rtol=1e-6, atol=1e-7)
    table = np.arange(10, dtype=np.int32).reshape(2, 5)  # 2 rows x 5 blocks of 8 keys
    pool_k = k.reshape(2, 3, 5, 8, 64).transpose(0, 2, 1, 3, 4).reshape(10, 3, 8, 64)
    pool_v = v.reshape(2, 3, 5, 8, 64).transpose(0, 2, 1, 3, 4).reshape(10, 3, 8, 64)
    op = attn.attention_reference(q, pool_k, pool_v, causal=True, kv_len=kv_len, block_table=table)
    assert np.allclose(op, o, rtol=1e-6, atol=1e-7)
    print("smoke float32 kv_len and paged KV: reference consistent")
    rows.append({"dtype": "float32", "kv_len": [7, 40], "paged": True, "finite": True})
    return {"mode": "smoke", "rows": rows}


def _to_cupy(t: Any) -> Any:
    import cupy
    import torch

    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return cupy.from_dlpack(t.view(torch.int16)).view(np.dtype(ml_dtypes.bfloat16))
    return cupy.from_dlpack(t)


def _time_torch(fn: Any, iters: int, warmup: int = 3) -> float:
    import torch

    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def _time_cupy(fn: Any, stream: Any, iters: int, warmup: int = 3) -> float:
    import cupy

    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record(stream)
        fn()
        b.record(stream)
        b.synchronize()
        ts.append(cupy.cuda.get_elapsed_time(a, b))
    return statistics.median(ts)


def bench_forward(
    dtypes: list[str],
    points: list[tuple[int, int, bool]],
    iters: int,
    variants: list[tuple[int, int, int]] | None,
    refs: bool = True,
) -> list[dict[str, Any]]:
    """Time every (dtype, L, D, causal) point: ours (and variants), FA2, cuDNN."""
    import torch

    rows = []
    for dname in dtypes:
        for L, D, causal in points:
            row = _bench_point(dname, L, D, causal, iters, variants, refs)
            print(json.dumps(row), flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
    return rows


def _bench_point(
    dname: str,
    L: int,
    D: int,
    causal: bool,
    iters: int,
    variants: list[tuple[int, int, int]] | None,
    refs: bool,
) -> dict[str, Any]:
    import cupy
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    stream = cupy.cuda.Stream(non_blocking=True)
    tdt = torch.float16 if dname == "float16" else torch.bfloat16
    B, H = 16384 // L, 2048 // D
    torch.manual_seed(L * 1000 + D + int(causal))
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=tdt) for _ in range(3))
    o = torch.empty_like(q)
    cq, ck, cv, co = (_to_cupy(t) for t in (q, k, v, o))
    torch.cuda.synchronize()
    f = flops(B, H, L, L, D, causal)
    row: dict[str, Any] = {"dtype": dname, "L": L, "D": D, "causal": causal, "B": B, "H": H}
    for cfg in [None, *(variants or [])]:

        def ours() -> None:
            attn.flash_attention_cuda(cq, ck, cv, co, causal=causal, stream=stream)

        prev = set_overrides(replace(current(), sm90_config=cfg))
        try:
            ms = _time_cupy(ours, stream, iters)
        except Exception as exc:  # a variant may not fit (shared memory)
            print(f"  variant {cfg} failed: {exc}")
            continue
        finally:
            set_overrides(prev)
        key = "ours" if cfg is None else f"ours_{cfg[0]}_{cfg[1]}_{cfg[2]}"
        row[key + "_tflops"] = round(f / ms / 1e9, 1)
    # correctness against FA2's output on the same inputs (default config)
    attn.flash_attention_cuda(cq, ck, cv, co, causal=causal, stream=stream)
    stream.synchronize()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref = sdpa(q, k, v, is_causal=causal)
    num = torch.linalg.vector_norm(o.float() - ref.float())
    err = (num / torch.linalg.vector_norm(ref.float())).item()
    row["rel_err_vs_fa2"] = float(f"{err:.2e}")
    row["finite"] = bool(torch.isfinite(o).all().item())
    backends = (("fa2", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION))
    for name, be in backends if refs else ():

        def theirs() -> None:
            sdpa(q, k, v, is_causal=causal)

        try:
            with sdpa_kernel(be):
                ms = _time_torch(theirs, iters)
            row[name + "_tflops"] = round(f / ms / 1e9, 1)
        except Exception as exc:
            print(f"  {name} failed: {exc}")
    ours_tf = row.get("ours_tflops", float("nan"))
    row["ratio_fa2"] = round(ours_tf / row.get("fa2_tflops", float("nan")), 3)
    row["ratio_cudnn"] = round(ours_tf / row.get("cudnn_tflops", float("nan")), 3)
    return row


def _copy_gbs(stream: Any) -> float:
    """Device-to-device copy bandwidth of a 1 GiB buffer (bytes read + written)."""
    import cupy

    n = 1 << 30
    src = cupy.empty(n, dtype=cupy.uint8)
    src.view(cupy.float32)[:] = 1.0
    dst = cupy.empty_like(src)

    def copy() -> None:
        dst.data.copy_from_device_async(src.data, n, stream=stream)

    ms = _time_cupy(copy, stream, 20)
    return 2 * n / ms / 1e6


def bench_decode(dtypes: list[str]) -> list[dict[str, Any]]:
    import cupy
    import torch

    rows = []
    stream = cupy.cuda.Stream(non_blocking=True)
    copy_gbs = _copy_gbs(stream)
    B, Hq, Hkv, Lk, D = 8, 32, 8, 4096, 128
    for dname in dtypes:
        tdt = torch.float16 if dname == "float16" else torch.bfloat16
        sets = []
        for _ in range(4):
            q = torch.randn(B, Hq, 1, D, device="cuda", dtype=tdt)
            k = torch.randn(B, Hkv, Lk, D, device="cuda", dtype=tdt)
            v = torch.randn(B, Hkv, Lk, D, device="cuda", dtype=tdt)
            o = torch.empty_like(q)
            sets.append((q, k, v, o, *(_to_cupy(t) for t in (q, k, v, o))))
        ws = cupy.empty(
            attn.attention_workspace_nbytes((B, Hq, 1, D), (B, Hkv, Lk, D), None), dtype=cupy.uint8
        )
        torch.cuda.synchronize()
        for s in sets:  # warm-up / compile
            attn.flash_attention_cuda(*s[4:], workspace=ws, stream=stream)
        stream.synchronize()
        reps = 20
        stream.begin_capture()
        for r in range(reps):
            s = sets[r % 4]
            attn.flash_attention_cuda(*s[4:], workspace=ws, stream=stream)
        graph = stream.end_capture()
        graph.launch(stream=stream)
        stream.synchronize()
        ms = _time_cupy(functools.partial(graph.launch, stream=stream), stream, 30) / reps
        nbytes = 2 * (B * Hq * D * 2) + 2 * (B * Hkv * Lk * D * 2)
        gbs = nbytes / ms / 1e6
        q, k, v, o = sets[0][:4]
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.float(),
            k.float().repeat_interleave(Hq // Hkv, 1),
            v.float().repeat_interleave(Hq // Hkv, 1),
        )
        attn.flash_attention_cuda(*sets[0][4:], workspace=ws, stream=stream)
        stream.synchronize()
        err = (torch.linalg.vector_norm(o.float() - ref) / torch.linalg.vector_norm(ref)).item()
        row = {
            "dtype": dname, "B": B, "Hq": Hq, "Hkv": Hkv, "Lq": 1, "Lk": Lk, "D": D,
            "us": round(ms * 1e3, 2), "gbs": round(gbs, 1), "copy_gbs": round(copy_gbs, 1),
            "ratio_copy": round(gbs / copy_gbs, 3), "rel_err_vs_fp32": float(f"{err:.2e}"),
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


# -- decode tables (issue 13) -----------------------------------------------------------------

#: (label, Hq, Hkv, D, batches, key lengths)
DECODE_TABLES = [
    ("GQA 32/8 D128", 32, 8, 128, (1, 8, 32), (1024, 4096, 32768)),
    ("SmolLM2 9/3 D64", 9, 3, 64, (1, 8, 32), (128, 256, 512, 1024, 2048)),
]
L2_BYTES = 50 << 20
#: The torch SDPA backends the decode tables time beside ours ("sdpa": its own choice).
SDPA_NAMES = ("sdpa", "flash", "efficient", "cudnn")


def decode_table_points() -> list[tuple[str, int, int, int, int, int]]:
    """Every point of :data:`DECODE_TABLES` as a :data:`SWEEP_POINTS` entry
    ``(label, Hq, Hkv, D, B, Lk)`` (label: the table's first word, e.g. ``"GQA"``)."""
    return [(label.split()[0], hq, hkv, d, b, lk)
            for label, hq, hkv, d, batches, lks in DECODE_TABLES for b in batches for lk in lks]


def report_sweep(rows: list[dict[str, Any]], json_path: str) -> None:
    """The end of a decode sweep tool: the points with a wrong result, and the JSON."""
    bad = [(r["point"], k) for r in rows for k in r if k.endswith("BAD_ERR")]
    print("wrong results:", bad or "none")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)


class _Timer:
    """Device time of one call with the host hidden behind a spin queued first."""

    def __init__(self) -> None:
        import cupy
        import torch

        self.torch = torch
        self.ts = torch.cuda.current_stream()
        self.stream = cupy.cuda.ExternalStream(self.ts.cuda_stream)
        self.clock_hz = cupy.cuda.Device().attributes["ClockRate"] * 1e3

    def median_us(self, calls: list[Any], reps: int, spin_us: float = 250.0) -> float:
        torch = self.torch
        for fn in calls[:3]:  # warm-up (compiles)
            fn()
        torch.cuda.synchronize()
        ts = []
        for r in range(reps):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(int(spin_us * 1e-6 * self.clock_hz))
            a.record(self.ts)
            calls[r % len(calls)]()
            b.record(self.ts)
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3)
        return statistics.median(ts)

    def flush_l2(self) -> None:
        """Read a buffer of 1.5x the L2 size, so the next call finds none of its data in L2
        (the buffer's lines are clean: evicting them costs the timed call no write-back)."""
        torch = self.torch
        if getattr(self, "_flush_buf", None) is None:
            self._flush_buf = torch.ones(3 * L2_BYTES // 8, dtype=torch.float32, device="cuda")
        self._flush_buf.sum()

    def compare_samples(self, named: dict[str, list[Any]], reps: int, spin_us: float = 250.0,
                        seed: int = 0) -> dict[str, list[float]]:
        """Every timed sample (device µs) of each named call list, the names interleaved rep
        by rep in a fresh random order each rep (seeded), so clock or thermal drift and
        whatever one call leaves behind hit all names alike. Before each call, L2 is flushed
        (:meth:`flush_l2`) and a spin kernel is queued; consecutive calls take consecutive
        data sets (the lists index the same sets)."""
        torch = self.torch
        for calls in named.values():  # warm-up (compiles)
            for fn in calls[:3]:
                fn()
        torch.cuda.synchronize()
        rng = random.Random(seed)
        names = list(named)
        ts: dict[str, list[float]] = {n: [] for n in names}
        k = 0
        for _ in range(reps):
            order = names[:]
            rng.shuffle(order)
            for name in order:
                calls = named[name]
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                self.flush_l2()
                torch.cuda._sleep(int(spin_us * 1e-6 * self.clock_hz))
                a.record(self.ts)
                calls[k % len(calls)]()
                k += 1
                b.record(self.ts)
                b.synchronize()
                ts[name].append(a.elapsed_time(b) * 1e3)
        return ts

    def compare_us(self, named: dict[str, list[Any]], reps: int, spin_us: float = 250.0) -> dict[str, float]:
        """Median device µs of each named call list (:meth:`compare_samples`: interleaved in
        random order, L2 flushed before every call)."""
        return {n: statistics.median(v) for n, v in self.compare_samples(named, reps, spin_us).items()}


def _decode_sets(b: int, hq: int, hkv: int, lk: int, d: int, tdt: Any) -> list[tuple[Any, ...]]:
    import torch

    kv_bytes = 2 * b * hkv * lk * d * 2
    n = max(1, min(64, -(-2 * L2_BYTES // kv_bytes)))
    sets = []
    for _ in range(n):
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=tdt)
        k = torch.randn(b, hkv, lk, d, device="cuda", dtype=tdt)
        v = torch.randn(b, hkv, lk, d, device="cuda", dtype=tdt)
        sets.append((q, k, v, torch.empty_like(q)))
    return sets


def _sdpa_calls(sets: list[tuple[Any, ...]]) -> dict[str, list[Any]]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    out: dict[str, list[Any]] = {}
    backends = [
        ("sdpa", None),
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
    ]
    for name, be in backends:

        def mk(s: tuple[Any, ...], be: Any = be) -> Any:
            q, k, v, _ = s
            if be is None:
                return lambda: sdpa(q, k, v, enable_gqa=True)

            def call() -> Any:
                with sdpa_kernel(be):
                    return sdpa(q, k, v, enable_gqa=True)

            return call

        calls = [mk(s) for s in sets]
        try:
            ref = calls[0]()
            torch.cuda.synchronize()
            del ref
        except Exception as exc:  # backend refuses the shape / GQA
            print(f"    {name}: not available ({str(exc).splitlines()[0][:80]})")
            continue
        out[name] = calls
    return out


def _ours_calls(sets: list[tuple[Any, ...]], stream: Any, ws: Any, kv_len: Any = None) -> list[Any]:
    calls = []
    for q, k, v, o in sets:
        cq, ck, cv, co = (_to_cupy(t) for t in (q, k, v, o))

        def call(cq: Any = cq, ck: Any = ck, cv: Any = cv, co: Any = co) -> None:
            attn.flash_attention_cuda(cq, ck, cv, co, kv_len=kv_len, workspace=ws, stream=stream)

        calls.append(call)
    return calls


def bench_decode_tables(reps: int, only: str = "") -> list[dict[str, Any]]:
    """The issue-13 decode tables: ours beside torch SDPA (every backend that runs the point),
    float16, Lq = 1, timed interleaved (:meth:`_Timer.compare_us`)."""
    import cupy
    import torch

    timer = _Timer()
    copy_gbs = _copy_gbs(timer.stream)
    rows = []
    for label, hq, hkv, d, batches, lks in DECODE_TABLES:
        if only and only not in label:
            continue
        for b in batches:
            for lk in lks:
                torch.manual_seed(b * 100000 + lk)
                sets = _decode_sets(b, hq, hkv, lk, d, torch.float16)
                nbytes = attn.attention_workspace_nbytes((b, hq, 1, d), (b, hkv, lk, d), None)
                ws = cupy.empty(max(nbytes, 1), dtype=cupy.uint8)
                lens = cupy.full((b,), lk, dtype=cupy.int32)
                row: dict[str, Any] = {"table": label, "B": b, "Lk": lk, "sets": len(sets)}
                named = {"ours": _ours_calls(sets, timer.stream, ws),
                         "ours_kvlen": _ours_calls(sets, timer.stream, ws, lens), **_sdpa_calls(sets)}
                for name, us in timer.compare_us(named, reps).items():  # interleaved
                    row[name + "_us"] = us
                best = min(row.get(n + "_us", float("inf")) for n in SDPA_NAMES)
                row["best_sdpa_us"] = best
                row["ratio"] = round(best / row["ours_us"], 3)
                row["ratio_kvlen"] = round(best / row["ours_kvlen_us"], 3)
                kv_bytes = 2 * b * hkv * lk * d * 2
                row["floor_us"] = round(kv_bytes / (copy_gbs * 1e3), 2)
                # correctness of ours on set 0 against fp32 torch
                q, k, v, o = sets[0]
                _ours_calls(sets[:1], timer.stream, ws, lens)[0]()
                torch.cuda.synchronize()
                g = hq // hkv
                ref = torch.nn.functional.scaled_dot_product_attention(
                    q.float(), k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
                )
                err = torch.linalg.vector_norm(o.float() - ref) / torch.linalg.vector_norm(ref)
                row["rel_err_vs_fp32"] = float(f"{err.item():.2e}")
                for key in list(row):
                    if key.endswith("_us") and isinstance(row[key], float):
                        row[key] = round(row[key], 2)
                print(json.dumps(row), flush=True)
                rows.append(row)
                del sets
                torch.cuda.empty_cache()
    # a long cache holding few valid keys costs what a short one costs
    for s_len, n_valid in ((8192, 10), (32768, 1000)):
        b, hq, hkv, d = 8, 32, 8, 128
        sets = _decode_sets(b, hq, hkv, s_len, d, torch.float16)[:2]
        short = [(q, k[:, :, :n_valid].contiguous(), v[:, :, :n_valid].contiguous(), o)
                 for q, k, v, o in sets]  # fmt: skip
        nbytes = attn.attention_workspace_nbytes((b, hq, 1, d), (b, hkv, s_len, d), None)
        ws = cupy.empty(max(nbytes, 1), dtype=cupy.uint8)
        lens = cupy.full((b,), n_valid, dtype=cupy.int32)
        row = {
            "table": "kv_len bound", "B": b, "S": s_len, "kv_len": n_valid,
            "cache_S_kvlen_us": round(timer.median_us(
                _ours_calls(sets, timer.stream, ws, lens), reps), 2),
            "Lk_eq_kvlen_us": round(timer.median_us(
                _ours_calls(short, timer.stream, ws), reps), 2),
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
        del sets, short
        torch.cuda.empty_cache()
    for r in rows:
        r["copy_gbs"] = round(copy_gbs, 1)
    return rows


#: (label, Hq, Hkv, D, B, Lk) points of the variant sweep
SWEEP_POINTS = [
    ("GQA", 32, 8, 128, 1, 1024),
    ("GQA", 32, 8, 128, 8, 32768),
    ("SmolLM2", 9, 3, 64, 1, 128),
    ("SmolLM2", 9, 3, 64, 32, 512),
    ("GQA", 32, 8, 128, 1, 4096),
    ("GQA", 32, 8, 128, 8, 4096),
    ("GQA", 32, 8, 128, 32, 1024),
    ("GQA", 32, 8, 128, 1, 32768),
    ("SmolLM2", 9, 3, 64, 1, 512),
    ("SmolLM2", 9, 3, 64, 8, 1024),
    ("SmolLM2", 9, 3, 64, 32, 2048),
]


def sweep_decode(reps: int, variants: list[str], targets: list[int]) -> list[dict[str, Any]]:
    """Time split-KV build variants x split targets (blocks per SM) at SWEEP_POINTS."""
    import cupy
    import torch

    timer = _Timer()
    rows = []
    saved = current()
    try:
        for label, hq, hkv, d, b, lk in SWEEP_POINTS:
            sets = _decode_sets(b, hq, hkv, lk, d, torch.float16)
            nbytes = attn.attention_workspace_nbytes((b, hq, 1, d), (b, hkv, lk, d), None)
            ws = cupy.empty(max(nbytes, 1), dtype=cupy.uint8)
            q, k, v, o = sets[0]
            g = hq // hkv
            ref = torch.nn.functional.scaled_dot_product_attention(
                q.float(), k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
            )
            row: dict[str, Any] = {"point": f"{label} B{b} Lk{lk}"}
            for var in variants:
                for tgt in targets:
                    apply_variant(var)
                    set_overrides(replace(current(), split_blocks_per_sm=tgt))
                    calls = _ours_calls(sets, timer.stream, ws)
                    us = timer.median_us(calls, reps)
                    o.fill_(float("nan"))
                    calls[0]()
                    torch.cuda.synchronize()
                    err = torch.linalg.vector_norm(o.float() - ref) / torch.linalg.vector_norm(ref)
                    key = f"{var or 'default'}|{tgt}"
                    row[key] = round(us, 2)
                    if not err.item() < 2e-3:
                        row[key + "|BAD_ERR"] = err.item()
            print(json.dumps(row), flush=True)
            rows.append(row)
            del sets
            torch.cuda.empty_cache()
    finally:
        set_overrides(saved)
    return rows


def apply_variant(var: str) -> None:
    """Set a split-KV variant: ``min_steps=N`` / ``target=N`` / ``warps=N`` / ``cluster=N`` /
    ``bulk=N`` knobs (the :class:`AttentionOverride` fields)."""
    knobs = {"min_steps": "split_min_steps", "target": "split_blocks_per_sm", "warps": "split_warps",
             "cluster": "cluster", "bulk": "bulk_stages"}
    # SPLIT_MIN_STEPS, the planner's warps, cluster and ring unless given
    fields: dict[str, Any] = {"split_min_steps": None, "split_warps": None, "cluster": None,
                              "bulk_stages": None}
    for tok in var.split():
        k, _, v = tok.partition("=")
        if k not in knobs:
            raise SystemExit(f"unknown variant knob {tok!r}; use {sorted(knobs)}")
        fields[knobs[k]] = int(v)
    set_overrides(replace(current(), **fields))


def best_variant(sweep: list[dict[str, Any]]) -> str:
    """The sweep's variant|target with the lowest geometric-mean time (correct everywhere)."""
    keys = [k for k in sweep[0] if k != "point" and "|BAD_ERR" not in k]
    bad = {k.rsplit("|", 1)[0] for r in sweep for k in r if k.endswith("|BAD_ERR")}
    scores = {}
    for k in keys:
        if k in bad or any(k not in r for r in sweep):
            continue
        scores[k] = statistics.geometric_mean([r[k] for r in sweep])
    best = min(scores, key=scores.__getitem__)
    print(
        "sweep geomean us: "
        + ", ".join(f"{k}={v:.2f}" for k, v in sorted(scores.items(), key=lambda x: x[1]))
    )
    var, tgt = best.rsplit("|", 1)
    return ("" if var == "default" else var) + f" target={tgt}"


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--quick", action="store_true", help="L >= 4096 points only, bf16 subset")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--points", default="", help="e.g. 4096:128:0,8192:64:1")
    ap.add_argument("--variants", default="", help="sm90 configs BN:NWG:MINB,...")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--no-ref", action="store_true", help="skip the torch SDPA timings")
    ap.add_argument(
        "--decode-defines",
        default="",
        help="split-KV variant: knobs, e.g. 'min_steps=0 target=4 bulk=2'; "
        "'auto' = the --decode-sweep's best",
    )
    ap.add_argument("--decode-tables", action="store_true", help="issue-13 decode tables only")
    ap.add_argument("--only", default="", help="decode table label filter, e.g. SmolLM2")
    ap.add_argument("--reps", type=int, default=50, help="timed calls per decode point")
    ap.add_argument("--decode-sweep", default="", help="split-KV variants 'DEFS;DEFS;...'")
    ap.add_argument("--sweep-targets", default="8", help="split targets (blocks/SM), e.g. 4,8")
    ap.add_argument("--check", action="store_true", help="kv_len/f32/paged correctness cases")
    ap.add_argument("--variant-out", type=Path, default=None, help="write the auto choice here")
    args = ap.parse_args()
    t0 = time.time()
    if args.smoke:
        result = smoke()
    elif args.check:
        if args.decode_defines != "auto":
            apply_variant(args.decode_defines)
        sys.exit(1 if check_cases() else 0)
    elif args.decode_tables or args.decode_sweep:
        import cupy
        import torch

        if args.decode_defines != "auto":
            apply_variant(args.decode_defines)
        result: dict[str, Any] = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "cupy": cupy.__version__,
            "date": time.strftime("%Y-%m-%d"),
        }
        if args.decode_sweep:
            variants = [v.strip() for v in args.decode_sweep.split(";")]
            targets = [int(t) for t in args.sweep_targets.split(",")]
            result["sweep"] = sweep_decode(args.reps, variants, targets)
            if args.decode_defines == "auto":
                chosen = best_variant(result["sweep"])
                print(f"decode tables with the sweep's best variant: {chosen!r}", flush=True)
                if args.variant_out:
                    args.variant_out.write_text(chosen)
                apply_variant(chosen)
                result["variant"] = chosen
        if args.decode_tables:
            result["decode_tables"] = bench_decode_tables(args.reps, args.only)
            print_decode_tables(result["decode_tables"])
    else:
        import cupy
        import torch

        dtypes = args.dtypes.split(",")
        if args.decode_defines not in ("", "auto"):
            apply_variant(args.decode_defines)
        points = POINTS
        if args.points:
            points = [
                (int(a), int(b), bool(int(c)))
                for a, b, c in (p.split(":") for p in args.points.split(","))
            ]
        variants = [
            tuple(int(x) for x in v.split(":")) for v in args.variants.split(",") if v
        ] or None
        result = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "cupy": cupy.__version__,
            "date": time.strftime("%Y-%m-%d"),
            "forward": bench_forward(dtypes, points, args.iters, variants, not args.no_ref),  # type: ignore[arg-type]
            "decode": [] if args.no_decode else bench_decode(dtypes),
        }
        print_table(result)
    result["seconds"] = round(time.time() - t0, 1)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


def print_table(result: dict[str, Any]) -> None:
    """Print the forward and decode tables (markdown)."""
    print(f"\n{result['device']}  torch {result['torch']}  cupy {result['cupy']}  {result['date']}")
    print(
        "| dtype | L | D | causal | ours TFLOP/s | FA2 | cuDNN | ours/FA2 | ours/cuDNN | rel err vs FA2 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in result["forward"]:
        print(f"| {r['dtype']} | {r['L']} | {r['D']} | {r['causal']} | {r.get('ours_tflops')} | "
              f"{r.get('fa2_tflops')} | {r.get('cudnn_tflops')} | {r['ratio_fa2']} | {r['ratio_cudnn']} | "
              f"{r['rel_err_vs_fa2']} |")  # fmt: skip
    if result["decode"]:
        print("\n| dtype | decode shape | us | GB/s | copy GB/s | ratio | rel err |")
        print("|---|---|---|---|---|---|---|")
        for r in result["decode"]:
            print(f"| {r['dtype']} | B{r['B']} Hq{r['Hq']} Hkv{r['Hkv']} Lk{r['Lk']} D{r['D']} | {r['us']} | "
                  f"{r['gbs']} | {r['copy_gbs']} | {r['ratio_copy']} | {r['rel_err_vs_fp32']} |")  # fmt: skip


def print_decode_tables(rows: list[dict[str, Any]]) -> None:
    """Markdown of the issue-13 decode tables."""
    print("\n| shape | B | Lk | ours us | ours kv_len us | SDPA default | flash | efficient | "
          "cuDNN | best SDPA / ours | floor us | rel err |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["table"] == "kv_len bound":
            continue
        print(f"| {r['table']} | {r['B']} | {r['Lk']} | {r['ours_us']} | {r['ours_kvlen_us']} | "
              f"{r.get('sdpa_us')} | {r.get('flash_us')} | {r.get('efficient_us')} | "
              f"{r.get('cudnn_us')} | {r['ratio']} | {r['floor_us']} | {r['rel_err_vs_fp32']} |")  # fmt: skip
    for r in rows:
        if r["table"] == "kv_len bound":
            print(
                f"kv_len bound: B{r['B']} cache S={r['S']} kv_len={r['kv_len']}: "
                f"{r['cache_S_kvlen_us']} us; Lk={r['kv_len']} cache: {r['Lk_eq_kvlen_us']} us"
            )


if __name__ == "__main__":
    main()
