"""Bound launches (kernels/runtime/_replay.py) on a GPU: a replay equals a fresh execution, bit for bit.

For every replayable launcher, at decode and prefill sizes and on each code path (GEMM
skinny/GEMV/sm_90/split-K, attention split-KV/prefill/paged): the op runs once (recorded),
then twice more from the same state with new random inputs, once replayed and once with
replays off; every tensor the op touches must come out identical. Outputs are poisoned
before each run.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import deviceops
from deviceops import api, kernels
from deviceops.kernels.runtime import _replay

pytestmark = pytest.mark.gpu

F16, BF16, F32, I32, I64 = "float16", "bfloat16", "float32", "int32", "int64"

# a case: name -> (tensors {name: (shape, dtype, kind)}, make(ts) -> op); kind: "in" random
# input, "out" poisoned output, "ids:<hi>" int ids in [0, hi), "pos:<hi>" int32 positions
Spec = tuple[dict[str, tuple[tuple[int, ...], str, str]], Callable[[dict[str, Any]], Any]]


def _cases() -> dict[str, Spec]:
    k = kernels
    c: dict[str, Spec] = {
        "rms_norm": ({"x": ((3, 576), F16, "in"), "w": ((576,), F16, "in"), "o": ((3, 576), F16, "out")},
                     lambda t: k.rms_norm(t["x"], t["w"], eps=1e-5, out=t["o"])),
        "add_rms_norm": ({"x": ((2, 576), BF16, "in"), "r": ((2, 576), BF16, "in"),
                          "w": ((576,), BF16, "in"), "o": ((2, 576), BF16, "out")},
                         lambda t: k.add_rms_norm(t["x"], t["r"], t["w"], out=t["o"])),
        "layer_norm": ({"x": ((5, 768), BF16, "in"), "w": ((768,), BF16, "in"),
                        "b": ((768,), BF16, "in"), "o": ((5, 768), BF16, "out")},
                       lambda t: k.layer_norm(t["x"], t["w"], t["b"], out=t["o"])),
        "softmax": ({"x": ((4, 1000), F32, "in"), "o": ((4, 1000), F32, "out")},
                    lambda t: k.softmax(t["x"], out=t["o"])),
        "gelu": ({"x": ((7, 300), F16, "in"), "o": ((7, 300), F16, "out")},
                 lambda t: k.gelu(t["x"], out=t["o"])),
        "silu": ({"x": ((7, 300), F16, "in"), "o": ((7, 300), F16, "out")},
                 lambda t: k.silu(t["x"], out=t["o"])),
        "embedding": ({"i": ((3,), I32, "ids:1000"), "tab": ((1000, 64), F16, "in"),
                       "o": ((3, 64), F16, "out")},
                      lambda t: k.embedding(t["i"], t["tab"], out=t["o"])),
        "argmax": ({"x": ((2, 5000), F16, "in"), "o": ((2,), I32, "out")},
                   lambda t: k.argmax(t["x"], out=t["o"])),
        "rope": ({"x": ((2, 3, 4, 64), F16, "in"), "s": ((2,), I32, "pos:100"),
                  "o": ((2, 3, 4, 64), F16, "out")},
                 lambda t: k.rope(t["x"], t["s"], out=t["o"])),
        "rope_kv_write": ({"qkv": ((2, 1, 15 * 64), F16, "in"), "s": ((2,), I32, "pos:128"),
                           "kc": ((2, 3, 128, 64), F16, "in"), "vc": ((2, 3, 128, 64), F16, "in"),
                           "q": ((2, 9, 1, 64), F16, "out")},
                          lambda t: k.rope_kv_write(t["qkv"], t["s"], t["kc"], t["vc"], n_heads=9,
                                                    n_kv_heads=3, q_out=t["q"])),
        "merge_heads": ({"x": ((2, 9, 1, 64), F16, "in"), "o": ((2, 1, 576), F16, "out")},
                        lambda t: k.merge_heads(t["x"], out=t["o"])),
        "swiglu": ({"x": ((3, 3072), F16, "in"), "o": ((3, 1536), F16, "out")},
                   lambda t: k.swiglu(t["x"], out=t["o"])),
        "sample": ({"l": ((4, 1000), F16, "in"), "temp": ((4,), F32, "in"), "tk": ((4,), I32, "ids:50"),
                    "tp": ((4,), F32, "in"), "seed": ((4,), I64, "ids:1000000"),
                    "ctr": ((4,), I64, "ids:1000"), "o": ((4,), I32, "out")},
                   lambda t: k.sample(t["l"], t["temp"], t["tk"], t["tp"], t["seed"], t["ctr"], out=t["o"])),
    }
    for m, n, kk, dt, tb in ((1, 1728, 576, F16, True), (1, 4096, 4096, F16, False),
                             (8, 4096, 4096, F16, True), (32, 4096, 4096, BF16, False),
                             (128, 768, 768, BF16, False), (512, 3072, 768, F16, True),
                             (2048, 2048, 2048, F16, False)):
        bshape = (n, kk) if tb else (kk, n)
        c[f"gemm {m}x{n}x{kk} {dt}{' trans_b' if tb else ''}"] = (
            {"a": ((m, kk), dt, "in"), "b": (bshape, dt, "in"), "o": ((m, n), dt, "out")},
            lambda t, tb=tb: k.gemm(t["a"], t["b"], t["o"], trans_b=tb))
    c["gemm bias gelu"] = ({"a": ((64, 256), F16, "in"), "b": ((256, 512), F16, "in"),
                            "bias": ((512,), F16, "in"), "o": ((64, 512), F16, "out")},
                           lambda t: k.gemm(t["a"], t["b"], t["o"], bias=t["bias"], activation="gelu"))
    c["attention decode gqa split-kv"] = (
        {"q": ((1, 32, 1, 128), F16, "in"), "k": ((1, 8, 4096, 128), F16, "in"),
         "v": ((1, 8, 4096, 128), F16, "in"), "o": ((1, 32, 1, 128), F16, "out")},
        lambda t: k.flash_attention(t["q"], t["k"], t["v"], out=t["o"]))
    c["attention decode kv_len"] = (
        {"q": ((4, 9, 1, 64), BF16, "in"), "k": ((4, 3, 1024, 64), BF16, "in"),
         "v": ((4, 3, 1024, 64), BF16, "in"), "len": ((4,), I32, "pos:1024"),
         "o": ((4, 9, 1, 64), BF16, "out")},
        lambda t: k.flash_attention(t["q"], t["k"], t["v"], out=t["o"], kv_len=t["len"]))
    c["attention prefill causal"] = (
        {"q": ((1, 8, 384, 128), F16, "in"), "k": ((1, 8, 384, 128), F16, "in"),
         "v": ((1, 8, 384, 128), F16, "in"), "o": ((1, 8, 384, 128), F16, "out")},
        lambda t: k.flash_attention(t["q"], t["k"], t["v"], causal=True, out=t["o"]))
    c["attention paged decode"] = (
        {"q": ((2, 9, 1, 64), F16, "in"), "k": ((40, 3, 16, 64), F16, "in"),
         "v": ((40, 3, 16, 64), F16, "in"), "len": ((2,), I32, "pos:320"),
         "bt": ((2, 20), I32, "ids:40"), "o": ((2, 9, 1, 64), F16, "out")},
        lambda t: k.flash_attention(t["q"], t["k"], t["v"], out=t["o"], kv_len=t["len"],
                                    block_table=t["bt"]))
    return c


CASES = _cases()


def _host(shape: tuple[int, ...], dtype: str, kind: str, rng: np.random.Generator) -> np.ndarray:
    if kind.startswith(("ids:", "pos:")):
        hi = int(kind.split(":")[1])
        return rng.integers(1 if kind.startswith("pos") else 0, hi, shape).astype(dtype)
    return rng.standard_normal(shape).astype(np.float32)


def _set(s: deviceops.Stream, t: deviceops.Tensor, h: np.ndarray) -> None:
    src = api.from_host(h).sync_on(s)
    if src.dtype != t.dtype:
        src = api.convert(src, t.dtype).sync_on(s)
    api.memcpy(t, src).sync_on(s)


def _poison(s: deviceops.Stream, t: deviceops.Tensor) -> None:
    fill = np.nan if t.dtype.kind == "f" or t.dtype == deviceops.bfloat16 else -7
    _set(s, t, np.full(t.shape, fill, np.float32 if fill != -7 else t.dtype))


def _snapshot(s: deviceops.Stream, ts: dict[str, deviceops.Tensor]) -> dict[str, np.ndarray]:
    return {n: api.to_host(t).sync_on(s).view(np.uint8) for n, t in ts.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_replay_equals_fresh_execution(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec, make = CASES[case]
    s = deviceops.device(0).new_stream()
    ts = {n: api.empty(shape, dt).sync_on(s) for n, (shape, dt, _) in spec.items()}
    rng = np.random.default_rng(11)

    def run(seed: int) -> dict[str, np.ndarray]:
        r = np.random.default_rng(seed)
        for n, (shape, dt, kind) in spec.items():
            if kind == "out":
                _poison(s, ts[n])
            else:
                _set(s, ts[n], _host(shape, dt, kind, r))
        make(ts).sync_on(s)
        return _snapshot(s, ts)

    run(int(rng.integers(1 << 30)))  # recorded
    before = _replay.stats()["replayed"]
    seed = int(rng.integers(1 << 30))
    replayed = run(seed)
    assert _replay.stats()["replayed"] > before, f"{case}: the second execution was not replayed"
    monkeypatch.setattr(_replay, "enabled", False)
    fresh = run(seed)
    for n in spec:
        assert np.array_equal(replayed[n], fresh[n]), f"{case}: {n} differs between replay and fresh"
    for n, (_, dt, kind) in spec.items():  # the poison was overwritten
        if kind == "out" and dt != I32:
            got = api.to_host(ts[n]).sync_on(s).astype(np.float32)
            assert not np.isnan(got).any(), f"{case}: {n} not fully written"


def test_replay_holds_no_user_tensor() -> None:
    s = deviceops.device(0).new_stream()
    x = api.ones((2, 576), F16).sync_on(s)
    w = api.ones((576,), F16).sync_on(s)
    o = api.empty((2, 576), F16).sync_on(s)
    for _ in range(3):
        kernels.rms_norm(x, w, out=o).sync_on(s)
    ref = weakref.ref(o._storage)
    del o
    gc.collect()
    assert ref() is None, "a plan or record keeps the output's storage alive"


def _attn_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    from deviceops.kernels.attention._reference import attention_reference

    return attention_reference(q, k, v).astype(np.float64)


def _close_to(got: deviceops.Tensor, want: np.ndarray, s: deviceops.Stream, what: str) -> None:
    g = api.to_host(got).sync_on(s).astype(np.float64)
    err = float(np.max(np.abs(g - want)) / np.max(np.abs(want)))
    assert np.isfinite(g).all() and err < 1e-2, f"{what}: relative error {err:.3g}"


def test_replay_is_per_stream_and_follows_workspace_growth() -> None:
    """Split-KV attention uses each stream's workspace: a record made on one stream is not
    replayed on another, and a grown workspace (the old one freed) is recorded afresh.

    Random, distinct inputs per stream (keys that differ, values that differ per key), each
    output against the float64 reference: a replay with another stream's pointers, stale
    workspace partials or a skipped key block changes the result."""
    dev = deviceops.device(0)
    s1, s2 = dev.new_stream(), dev.new_stream()
    rng = np.random.default_rng(7)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float16)

    qh = [rand(1, 32, 1, 128), rand(1, 32, 1, 128)]
    kh, vh = rand(1, 8, 2048, 128), rand(1, 8, 2048, 128)
    q = [api.from_host(x).sync_on(s1) for x in qh]
    k, v = api.from_host(kh).sync_on(s1), api.from_host(vh).sync_on(s1)
    refs = [_attn_ref(x, kh, vh) for x in qh]
    o1 = api.empty((1, 32, 1, 128), F16).sync_on(s1)
    o2 = api.empty((1, 32, 1, 128), F16).sync_on(s1)
    for s, qi, o in ((s1, q[0], o1), (s2, q[1], o2), (s1, q[0], o1), (s2, q[1], o2)):
        _poison(s, o)
        kernels.flash_attention(qi, k, v, out=o).sync_on(s)
    for o, ref, what in ((o1, refs[0], "stream 1"), (o2, refs[1], "stream 2")):
        _close_to(o, ref, s1, what)
    kbh, vbh, qbh = rand(4, 8, 8192, 128), rand(4, 8, 8192, 128), rand(4, 32, 1, 128)
    big_k, big_v = api.from_host(kbh).sync_on(s1), api.from_host(vbh).sync_on(s1)
    qb, ob = api.from_host(qbh).sync_on(s1), api.empty((4, 32, 1, 128), F16).sync_on(s1)
    kernels.flash_attention(qb, big_k, big_v, out=ob).sync_on(s1)  # a larger workspace on s1
    _close_to(ob, _attn_ref(qbh, kbh, vbh), s1, "the large split")
    gc.collect()
    _poison(s1, o1)
    kernels.flash_attention(q[0], k, v, out=o1).sync_on(s1)
    _close_to(o1, refs[0], s1, "stream 1 after the workspace grew")


def test_no_replay_under_experiment_overrides() -> None:
    """A record reflects the planners' choice: under kernels.runtime.overrides the op
    takes the full path (the forced configuration runs), and replays resume after."""
    from deviceops.kernels.gemm import GemmOverride
    from deviceops.kernels.runtime import overrides

    s = deviceops.device(0).new_stream()
    a, b = api.ones((128, 256), F16).sync_on(s), api.ones((256, 512), F16).sync_on(s)
    o = api.empty((128, 512), F16).sync_on(s)
    kernels.gemm(a, b, o).sync_on(s)
    n0 = _replay.stats()["replayed"]
    with overrides(GemmOverride(path="sm80", splits=1)):
        kernels.gemm(a, b, o).sync_on(s)
    assert _replay.stats()["replayed"] == n0
    kernels.gemm(a, b, o).sync_on(s)
    assert _replay.stats()["replayed"] == n0 + 1
    np.testing.assert_allclose(api.to_host(o).sync_on(s).astype(np.float32), 256.0)


def test_a_full_plan_records_a_new_key_at_its_second_execution(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past _REPLAYS_PER_PLAN records a plan runs a new pointer key plainly once (ever-new
    pointers pay no recording), records it the second time and replays it the third; every
    result is right. (The output comes from a DeviceOp, so one plan serves every pointer.)"""
    from deviceops.kernels.runtime import _spec

    monkeypatch.setattr(_spec, "_REPLAYS_PER_PLAN", 3)
    s = deviceops.device(0).new_stream()
    rng = np.random.default_rng()
    xh = rng.standard_normal((3, 200), dtype=np.float32).astype(np.float16)
    x, w = api.from_host(xh).sync_on(s), api.ones((200,), F16).sync_on(s)
    want = xh.astype(np.float64) / np.sqrt((xh.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5)
    outs = [api.empty((3, 200), F16).sync_on(s) for _ in range(4)]

    def run(o: Any) -> dict[str, int]:
        given = api.zeros((1,)).map(lambda _: o)  # a DeviceOp whose value is o
        kernels.rms_norm(x, w, eps=1e-5, out=given).sync_on(s)
        np.testing.assert_allclose(api.to_host(o).sync_on(s).astype(np.float64), want, rtol=1e-2, atol=1e-2)
        return _replay.stats()

    for o in outs[:-1]:
        run(o)  # fills the plan's records
    last = outs[-1]
    n0 = _replay.stats()
    n1 = run(last)
    assert n1["recorded"] == n0["recorded"] and n1["replayed"] == n0["replayed"]  # plain
    n2 = run(last)
    assert n2["recorded"] == n1["recorded"] + 1  # recorded now
    n3 = run(last)
    assert n3["replayed"] == n2["replayed"] + 1 and n3["recorded"] == n2["recorded"]


def test_single_launch_replay_falls_back_on_a_driver_error() -> None:
    """A one-launch record calls the driver directly; if that call raises, the general replay
    runs instead (its retry on a context error, else DriverError): the launch still happens
    once and the hazard record is counted once."""
    s = deviceops.device(0).new_stream()
    x = api.ones((3, 576), F16).sync_on(s)
    w = api.ones((576,), F16).sync_on(s)
    o = api.empty((3, 576), F16).sync_on(s)
    kernels.rms_norm(x, w, eps=1e-5, out=o).sync_on(s)  # recorded
    plan_recs = [r for r in gc.get_objects() if type(r) is _replay.Record and r.one is not None]
    assert plan_recs, "the rms_norm record should be a single plain launch"
    real = plan_recs[0].one[0]
    failed: list[int] = []

    def flaky(*args: Any) -> None:
        failed.append(1)
        raise RuntimeError("simulated driver failure")

    for r in plan_recs:
        r.one = (flaky, *r.one[1:])
    try:
        _poison(s, o)
        n0, seq0 = _replay.stats()["replayed"], s.seq
        kernels.rms_norm(x, w, eps=1e-5, out=o).sync_on(s)
        assert failed and _replay.stats()["replayed"] == n0 + 1 and s.seq == seq0 + 1
        got = api.to_host(o).sync_on(s).astype(np.float32)
        np.testing.assert_allclose(got, 1.0, rtol=2e-3)
    finally:
        for r in plan_recs:
            r.one = (real, *r.one[1:])
