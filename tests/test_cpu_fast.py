"""The cpu backend's float32 kernel paths (issue 35, item 1: ``kernels/*/_cpu.py``).

Every fast path is compared with the float64 reference that stays the tests' oracle, on odd
shapes, within about one output ulp of each dtype (float32 paths accumulate in float32, as
the CUDA kernels do; the GEMM's BLAS over K terms gets ``sqrt(K)`` ulps). Also: the
reference mode runs the references bit for bit, the float32 weight copies are reused until
the weight is written, the BLAS thread choice follows measurements, a decode step on the cpu
backend is one graph replay (one hand-off to the stream's worker), and a failing task of a
replayed graph keeps the one-task-at-a-time error semantics.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import deviceops
from deviceops import api, kernels
from deviceops.kernels.attention._cpu import attention_cpu
from deviceops.kernels.attention._reference import attention_reference
from deviceops.kernels.elementwise._cpu import activation_cpu, swiglu_cpu
from deviceops.kernels.elementwise._reference import (
    gelu_reference,
    silu_reference,
    softmax_reference,
    swiglu_reference,
)
from deviceops.kernels.gemm import _cpu as _gemm_cpu
from deviceops.kernels.gemm._cpu import gemm_cpu
from deviceops.kernels.gemm._reference import gemm_reference
from deviceops.kernels.norms._cpu import add_rms_norm_cpu, layer_norm_cpu, rms_norm_cpu
from deviceops.kernels.norms._reference import (
    add_rms_norm_reference,
    layer_norm_reference,
    rms_norm_reference,
)
from deviceops.kernels.runtime._cpu import WeightCache, use_reference, weight_cache
from deviceops.kernels.runtime._cpu_blas import BlasThreads
from deviceops.kernels.transformer._cpu import rope_cpu, rope_kv_write_cpu
from deviceops.kernels.transformer._reference import rope_kv_write_reference, rope_reference

FLOATS = ["float32", "float16", "bfloat16"]
TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def npdt(name: str) -> np.dtype[Any]:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def rand(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(npdt(dtype))


def f64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def close(got: np.ndarray, ref: np.ndarray, dtype: str, scale: float = 1.0) -> None:
    np.testing.assert_allclose(f64(got), f64(ref), rtol=TOL[dtype] * scale,
                               atol=TOL[dtype] * scale)


@pytest.fixture
def stream() -> deviceops.Stream:
    return deviceops.device("cpu").new_stream()


# ----------------------------------------------------------------------------- gemm


@pytest.mark.parametrize("dtype", FLOATS)
def test_gemm_fast_path_matches_float64(dtype: str) -> None:
    rng = np.random.default_rng(1)
    cases = [((1, 576), (1536, 576), True), ((7, 13), (13, 5), False), ((2, 3, 33), (33, 17), False),
             ((2, 5, 9), (2, 11, 9), True), ((1, 1), (1, 1), False), ((65, 130), (70, 130), True),
             ((2, 40), (24, 40), True), ((2, 3, 33), (17, 33), True), ((64, 20), (9, 20), True)]
    for ashape, bshape, tb in cases:
        a, b = rand(rng, ashape, dtype), rand(rng, bshape, dtype)
        n = bshape[-2] if tb else bshape[-1]
        bias = rand(rng, (n,), dtype)
        for kw in ({}, {"bias": bias, "activation": "gelu", "alpha": 0.5},
                   {"bias": bias, "activation": "silu"}, {"activation": "relu", "beta": 0.25}):
            oshape = (*ashape[:-1], n) if len(bshape) == 2 else (*bshape[:-2], ashape[-2], n)
            c = rand(rng, oshape, dtype)
            out = c.copy()
            gemm_cpu(a, b, out, bias=kw.get("bias"), activation=kw.get("activation"),
                        alpha=kw.get("alpha", 1.0), beta=kw.get("beta", 0.0), tf32=False,
                        trans_b=tb)
            ref = gemm_reference(a, b, bias=kw.get("bias"), activation=kw.get("activation"),
                                 alpha=kw.get("alpha", 1.0), beta=kw.get("beta", 0.0),
                                 c=c if kw.get("beta") else None, trans_b=tb)
            k = ashape[-1]
            close(out, ref, dtype, scale=max(1.0, math.sqrt(max(k, 1)) / 4))


def test_gemm_op_runs_the_fast_path_and_the_reference_on_request(stream: deviceops.Stream,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(2)
    a, w = rand(rng, (3, 40), "float32"), rand(rng, (24, 40), "float32")
    at, wt = api.from_host(a).sync_on(stream), api.from_host(w).sync_on(stream)
    ref = gemm_reference(a, w, trans_b=True)
    with use_reference():
        got = api.to_host(kernels.gemm(at, wt, trans_b=True)).sync_on(stream)
    assert np.array_equal(got, ref)  # the reference itself, bit for bit
    calls = []
    monkeypatch.setattr(_gemm_cpu, "gemm_reference", lambda *x, **k: calls.append(1))
    with use_reference(False):
        got = api.to_host(kernels.gemm(at, wt, trans_b=True)).sync_on(stream)
    close(got, ref, "float32")
    assert not calls  # float32 without tf32 never converts to float64


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_weights_are_widened_once_until_written(dtype: str, stream: deviceops.Stream) -> None:
    rng = np.random.default_rng(3)
    a, w = rand(rng, (2, 64), dtype), rand(rng, (48, 64), dtype)
    at, wt = api.from_host(a).sync_on(stream), api.from_host(w).sync_on(stream)
    cache = weight_cache
    cache.clear()
    h0, m0 = cache.hits, cache.misses
    for _ in range(3):
        got = api.to_host(kernels.gemm(at, wt, trans_b=True)).sync_on(stream)
    close(got, gemm_reference(a, w, trans_b=True), dtype, 2)
    assert (cache.misses - m0, cache.hits - h0) == (1, 2)
    # a write into the weight (through an op) makes the next GEMM widen it afresh
    w2 = rand(rng, (48, 64), dtype)
    api.memcpy(wt, api.from_host(w2)).sync_on(stream)
    got = api.to_host(kernels.gemm(at, wt, trans_b=True)).sync_on(stream)
    close(got, gemm_reference(a, w2, trans_b=True), dtype, 2)
    assert cache.misses - m0 == 2
    # the copy goes with the weight
    n = len(cache)
    del wt
    import gc

    gc.collect()
    assert len(cache) == n - 1


def test_weight_cache_holds_in_graph_replays(stream: deviceops.Stream) -> None:
    """A decode step is a replay: the copy made by the first replay serves the next ones,
    and a write into the weight between replays (ordered on the stream) is seen."""
    rng = np.random.default_rng(7)
    a, w = rand(rng, (1, 32), "float16"), rand(rng, (16, 32), "float16")
    at, wt = api.from_host(a).sync_on(stream), api.from_host(w).sync_on(stream)
    out = api.zeros((1, 16), "float16").sync_on(stream)
    kernels.gemm(at, wt, out=out, trans_b=True).sync_on(stream)  # warm-up (workspace)
    g = kernels.gemm(at, wt, out=out, trans_b=True).graph_on(stream)
    cache = weight_cache
    cache.clear()
    m0, h0 = cache.misses, cache.hits
    for _ in range(3):
        g.launch()
    g.synchronize()
    assert (cache.misses - m0, cache.hits - h0) == (1, 2)
    w2 = rand(rng, (16, 32), "float16")
    api.memcpy(wt, api.from_host(w2)).sync_on(stream)
    g.launch()
    g.synchronize()
    assert cache.misses - m0 == 2
    close(api.to_host(out).sync_on(stream), gemm_reference(a, w2, trans_b=True), "float16", 2)


def test_weight_cache_is_bounded() -> None:
    class St:  # a weak-referenceable stand-in for a storage
        pass

    cache = WeightCache(3 * 4 * 100)
    keep = [St() for _ in range(4)]
    arrays = [np.full((100,), i, np.float16) for i in range(4)]
    for st, arr in zip(keep, arrays, strict=True):
        assert cache.get(st, (1, 1), arr).dtype == np.float32
    assert len(cache) == 3 and cache.bytes <= cache.limit  # least recently used dropped
    before = len(cache)
    assert cache.get(keep[0], False, arrays[0])[0] == 0  # False: never cached
    assert cache.get(None, (1, 1), arrays[0])[0] == 0  # the storage is gone
    assert len(cache) == before


def test_blas_thread_choice_follows_measurements(monkeypatch: pytest.MonkeyPatch) -> None:
    """The windowed, process-wide choice: one thread first, every thread tried and kept
    when faster, tries backed off when they confirm, dropped at once when the kept choice
    gets slower, and never while other processes load the cores."""
    b = BlasThreads("auto")
    b.max = 2  # (as on a 2-core machine, whatever this one has)
    spare = [True]
    monkeypatch.setattr(b, "_spare_cores", lambda: spare[0])
    w, e = b.WINDOW, b.EXPLORE

    def windows(n: int, fast_many: bool, slow: float = 0.003) -> list[int]:
        """Run ``n`` windows (the faster count: 1 ms a GEMM, the other ``slow``); per
        window the thread count used."""
        used = []
        for _ in range(n):
            t = b.threads()
            used.append(t)
            for _ in range(w):
                b.record(1 << 20, 0.001 if (t > 1) == fast_many else slow)
        return used

    assert windows(3, True)[:2] == [1, 2]  # one thread first, then a try of every thread
    assert b.many  # ... which was faster: kept
    used = windows(e + 1, True)
    assert used.count(1) == 1  # one try of one thread in EXPLORE windows
    used = windows(2 * e + 1, True)
    assert used.count(1) == 1 and used.index(1) >= 2 * e - 1  # confirmed: tried later
    assert windows(2, False, 0.010)[1] == 1  # every thread got 10x slower: dropped at once
    spare[0] = False  # other processes took the cores: one thread, no tries
    b.many = True
    assert windows(4 * e, True).count(2) <= 1 and not b.many
    with pytest.raises(ValueError, match="DEVICEOPS_CPU_BLAS_THREADS"):
        BlasThreads("lots")
    assert not BlasThreads("1").adaptive and not BlasThreads("0").adaptive


def test_blas_threads_fixed_once_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without DEVICEOPS_CPU_BLAS_ADAPT=1 the count is chosen once (never changed while a
    stream thread may be inside a BLAS call: OpenBLAS is not safe for that)."""
    monkeypatch.delenv("DEVICEOPS_CPU_BLAS_ADAPT", raising=False)
    b = BlasThreads("auto")
    assert not b.adaptive
    assert b.ctl is None or b.fixed in (1, b.max)


# ----------------------------------------------------------------------------- attention


@pytest.mark.parametrize("dtype", FLOATS)
def test_attention_fast_path_matches_float64(dtype: str) -> None:
    rng = np.random.default_rng(4)
    for b, hq, hkv, lq, lk, d, causal in [(1, 9, 3, 1, 41, 64, True), (2, 4, 2, 5, 5, 32, True),
                                          (2, 4, 4, 3, 9, 16, False), (1, 2, 1, 7, 3, 8, True)]:
        q, k, v = rand(rng, (b, hq, lq, d), dtype), rand(rng, (b, hkv, lk, d), dtype), rand(
            rng, (b, hkv, lk, d), dtype)
        kv_len = np.array([lk - i for i in range(b)], np.int32)
        for kl in (None, kv_len, np.zeros(b, np.int32)):
            out = np.full((b, hq, lq, d), np.nan, npdt(dtype))
            attention_cpu(q, k, v, out, causal=causal, scale=None, kv_len=kl, block_table=None)
            close(out, attention_reference(q, k, v, causal=causal, kv_len=kl), dtype, 2)
    # paged: a pool of blocks, a table, rows of different lengths; a bad block id is refused
    bs, nb = 4, 9
    kp, vp = rand(rng, (nb, 2, bs, 16), dtype), rand(rng, (nb, 2, bs, 16), dtype)
    table = np.array([[3, 1, 7, -1], [0, 8, 2, 5]], np.int32)
    q = rand(rng, (2, 6, 2, 16), dtype)
    kl = np.array([9, 15], np.int32)
    out = np.empty((2, 6, 2, 16), npdt(dtype))
    attention_cpu(q, kp, vp, out, causal=True, scale=0.3, kv_len=kl, block_table=table)
    close(out, attention_reference(q, kp, vp, causal=True, scale=0.3, kv_len=kl,
                                   block_table=table), dtype, 2)
    with pytest.raises(IndexError, match="block_table"):
        attention_cpu(q, kp, vp, out, causal=True, scale=None, kv_len=np.array([16, 1]),
                         block_table=table)


# ----------------------------------------------------------------------------- norms, activations


@pytest.mark.parametrize("dtype", FLOATS)
def test_norm_and_activation_fast_paths_match_float64(dtype: str) -> None:
    rng = np.random.default_rng(5)
    for shape in [(1, 1), (3, 5), (2, 3, 576), (4, 1536)]:
        x, r = rand(rng, shape, dtype, 2.0), rand(rng, shape, dtype)
        w, bvec = rand(rng, shape[-1:], dtype), rand(rng, shape[-1:], dtype)
        out = np.empty(shape, npdt(dtype))
        rms_norm_cpu(x, w, 1e-6, out)
        close(out, rms_norm_reference(x, w, 1e-6), dtype, 2)
        layer_norm_cpu(x, w, bvec, 1e-5, out)
        close(out, layer_norm_reference(x, w, bvec, 1e-5), dtype, 2)
        ro = np.empty(shape, npdt(dtype))
        xi, ri = x.copy(), r.copy()
        add_rms_norm_cpu(xi, ri, w, 1e-5, xi, ri)  # in place, as the model runs it
        y, s = add_rms_norm_reference(x, r, w, 1e-5)
        assert np.array_equal(f64(ri), f64(s))  # the stored sum is rounded exactly once
        close(xi, y, dtype, 2)
        add_rms_norm_cpu(x, r, w, 1e-5, out, ro)
        close(out, y, dtype, 2)
        for kind, ref in (("gelu", gelu_reference), ("silu", silu_reference),
                          ("softmax", softmax_reference)):
            activation_cpu(kind, x, out)
            close(out, ref(x), dtype, 2)
        if shape[-1] % 2 == 0:
            half = np.empty((*shape[:-1], shape[-1] // 2), npdt(dtype))
            swiglu_cpu(x, half)
            close(half, swiglu_reference(x), dtype, 2)
    big = np.array([[-1e4, -100.0, 0.0, 100.0]], npdt(dtype))  # no overflow warnings
    with np.errstate(all="raise"):
        activation_cpu("silu", big, np.empty_like(big))
        swiglu_cpu(np.concatenate([big, big], -1), np.empty_like(big))


# ----------------------------------------------------------------------------- rope


@pytest.mark.parametrize("dtype", FLOATS)
def test_rope_fast_paths_match_float64(dtype: str) -> None:
    rng = np.random.default_rng(6)
    x = rand(rng, (2, 5, 3, 64), dtype)
    start = np.array([0, 1000], np.int32)
    out = np.empty_like(x)
    rope_cpu(x, start, 10000.0, out)
    close(out, rope_reference(x, start, 10000.0), dtype, 2)
    hq, hkv, d = 4, 2, 8
    for b, length in ((1, 1), (3, 1), (2, 6), (2, 20)):  # the decode and the prefill forms
        qkv = rand(rng, (b, length, (hq + 2 * hkv) * d), dtype)
        st = np.array([5, -2, 14][:b], np.int32)  # negative and past-the-end positions skip
        for paged in (False, True):
            if paged:
                kc, vc = rand(rng, (6, hkv, 4, d), dtype), rand(rng, (6, hkv, 4, d), dtype)
                table = np.array([[0, 1, 2, 3, 4, -1], [5, 4, 3, 2, 1, 0], [1, 0, 7, 2, 5, 3]],
                                 np.int32)[:b]
            else:
                kc, vc = rand(rng, (b, hkv, 16, d), dtype), rand(rng, (b, hkv, 16, d), dtype)
                table = None
            k1, v1, k2, v2 = kc.copy(), vc.copy(), kc.copy(), vc.copy()
            q1 = np.empty((b, hq, length, d), npdt(dtype))
            q2 = q1.copy()
            rope_kv_write_cpu(qkv, st, k1, v1, q1, hq, hkv, 10000.0, table)
            rope_kv_write_reference(qkv, st, k2, v2, q2, hq, hkv, 10000.0, table)
            close(q1, q2, dtype, 2)
            close(k1, k2, dtype, 2)
            assert np.array_equal(f64(v1), f64(v2))  # v is copied exactly


# ----------------------------------------------------------------------------- the worker


def test_decode_step_is_one_hand_off_per_token(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Any) -> None:
    """On the cpu backend generate replays the bucket's recorded step: one queue item."""
    from deviceops import _cpu_stream as cb
    from deviceops import nn

    from . import nn_tiny

    path = tmp_path / "tiny.gguf"
    nn_tiny.write_gguf(path, nn_tiny.hf_weights(1, tied=False))
    m = nn.load_gguf(path, device="cpu", dtype="float32", max_batch=2, max_seq=64)
    batches: list[int] = []
    real = cb._Worker.run_many

    def run_many(self: Any, tasks: Any) -> None:
        batches.append(len(tasks))
        real(self, tasks)

    monkeypatch.setattr(cb._Worker, "run_many", run_many)
    ids = [5, 9, 40, 7]
    got = m.generate(ids, 6)
    assert len(batches) >= 5 and min(batches) > 10  # steps 2..6: a replay of the whole step
    assert got == m.generate(ids, 6, graph=False)  # the same tokens as op by op


def test_a_failing_task_of_a_replay_keeps_the_error_semantics() -> None:
    from deviceops.graphs import host_task

    s = deviceops.device("cpu").new_stream()
    x = api.zeros((4,)).sync_on(s)
    one = api.ones((4,)).sync_on(s)
    fail = [False]

    def maybe() -> None:
        if fail[0]:
            raise RuntimeError("boom")

    op = host_task(maybe).then(lambda _: kernels.add(x, one, out=x))
    g = op.graph_on(s)  # (a capture records; it runs nothing)
    g.launch()
    s.synchronize()
    fail[0] = True
    g.launch()  # the host task fails at the start of the replay: the add after it still runs
    with pytest.raises(deviceops.DeviceError, match="boom"):
        s.synchronize()
    fail[0] = False
    g.launch()  # the error was reported once; the stream stays usable
    s.synchronize()
    assert api.to_host(x).sync_on(s).tolist() == [3.0] * 4
