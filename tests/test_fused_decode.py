"""The fused decode step (``deviceops.kernels.FusedDecodeModel``, ``DEVICEOPS_FUSED_DECODE``).

cpu: the packing (fragment order, RoPE and SwiGLU pairs), the phase plan, the support
checks, argument errors, and the NumPy step over the packed buffer against the unfused ops
(teacher-forced decode logits, float16 and bfloat16). gpu: the kernel against the unfused
ops on a SmolLM2-shaped random model (buckets 1, 8 and 32; a row past 2,048 keys, so its
attention is split and combined), graph replay equal to the eager launch, and greedy tokens
of ``generate`` equal to the unfused path's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import deviceops
from deviceops import api, nn
from deviceops.kernels.fused import MAX_ROWS, fused_decode_support, phase_plan
from deviceops.kernels.fused._plan import gate_up_order, pack_strips, qkv_order, unpack_strips

# -- packing -----------------------------------------------------------------------------


def test_pack_fragment_layout_and_round_trip() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 80)).astype(np.float32)
    p = pack_strips(w)
    assert p.shape == (3, 5, 32, 8)
    # lane (g, c) = (lane // 4, lane % 4): W[g, 2c:2c+2], W[g+8, 2c:2c+2], W[g, 2c+8:2c+10],
    # W[g+8, 2c+8:2c+10] of k-step k of strip s
    for s, k, lane in ((0, 0, 0), (1, 3, 5), (2, 4, 31)):
        g, c = divmod(lane, 4)
        r, col = 16 * s + g, 16 * k + 2 * c
        want = [w[r, col], w[r, col + 1], w[r + 8, col], w[r + 8, col + 1],
                w[r, col + 8], w[r, col + 9], w[r + 8, col + 8], w[r + 8, col + 9]]
        np.testing.assert_array_equal(p[s, k, lane], want)
    np.testing.assert_array_equal(unpack_strips(p), w)
    order = rng.permutation(48)
    np.testing.assert_array_equal(unpack_strips(pack_strips(w, order), order), w)
    with pytest.raises(ValueError, match="multiples of 16"):
        pack_strips(w[:40])
    with pytest.raises(ValueError, match="multiples of 16"):
        pack_strips(w[:, :40])


def test_qkv_and_gate_up_orders_pair_rows_g_and_g_plus_8() -> None:
    hq, hkv, d = 3, 1, 64
    o = qkv_order(hq, hkv, d)
    assert sorted(o.tolist()) == list(range((hq + 2 * hkv) * d))
    strips = o.reshape(-1, 16)
    for st in strips:
        head = st[0] // d
        assert (st // d == head).all()
        np.testing.assert_array_equal(st[8:] - st[:8], np.full(8, d // 2))  # RoPE pairs
    g = gate_up_order(24)
    assert sorted(g.tolist()) == list(range(48))
    for st in g.reshape(-1, 16):
        np.testing.assert_array_equal(st[8:] - st[:8], np.full(8, 24))  # gate j with up j
    with pytest.raises(ValueError, match="head_dim"):
        qkv_order(2, 1, 24)
    with pytest.raises(ValueError, match="intermediate_size"):
        gate_up_order(12)


def test_phase_plan_gives_every_projection_work_and_bounds() -> None:
    plan = phase_plan(blocks=132, hidden=576, ffn=1536, vocab=49152, n_heads=9, n_kv_heads=3,
                      head_dim=64)
    assert 1 <= plan["ks_o"] <= 4 and 1 <= plan["ks_d"] <= 4
    for k in ("wps_qkv", "wps_o", "wps_gu", "wps_d", "wps_head"):
        assert plan[k] in (1, 2, 4, 8)
    assert plan["wps_head"] == 1  # 3,072 strips: a warp each
    assert plan["wps_qkv"] == 8  # 60 strips over 1,056 warps
    small = phase_plan(blocks=8, hidden=128, ffn=96, vocab=256, n_heads=2, n_kv_heads=1,
                       head_dim=64)
    assert all(v >= 1 for v in small.values())


def test_support_reasons() -> None:
    ok = {"hidden": 576, "ffn": 1536, "vocab": 49152, "n_heads": 9, "n_kv_heads": 3,
          "head_dim": 64, "dtype": "float16"}
    assert fused_decode_support(**ok) is None
    assert fused_decode_support(**{**ok, "dtype": "bfloat16"}) is None
    assert "float16 or bfloat16" in str(fused_decode_support(**{**ok, "dtype": "float32"}))
    assert "head_dim" in str(fused_decode_support(**{**ok, "head_dim": 32}))
    assert "vocab_size" in str(fused_decode_support(**{**ok, "vocab": 49153}))
    assert "per kv head" in str(fused_decode_support(**{**ok, "n_heads": 18, "n_kv_heads": 1}))


# -- the step on the cpu backend ----------------------------------------------------------------

CPU_CFG = dict(vocab_size=256, hidden_size=128, intermediate_size=96, num_layers=2, num_heads=4,
               num_kv_heads=2, head_dim=64, rope_theta=1e4)


def _model(monkeypatch: pytest.MonkeyPatch, flag: str, dtype: str, device: Any = "cpu",
           cfg: dict[str, Any] | None = None, **kw: Any) -> Any:
    monkeypatch.setenv("DEVICEOPS_FUSED_DECODE", flag)
    c = nn.LlamaConfig(**(cfg or CPU_CFG))
    args = {"max_batch": 4, "max_seq": 200, "kv_block_size": 16, "kv_blocks": 60} | kw
    w = nn.random_weights(c, seed=2)
    rng = np.random.default_rng(3)
    for k in w:  # norm scales away from 1, so a norm that divides by them is caught
        if k.endswith("norm.weight"):
            w[k] = (1 + 0.3 * rng.standard_normal(w[k].shape)).astype(np.float32)
    return nn.CausalLM(c, w, tokenizer=None, dtype=dtype, device=device, **args)


def _decode_logits(m: Any, prompts: list[list[int]], toks: list[list[int]], graph: bool) -> np.ndarray:
    n = len(prompts)
    for i, p in enumerate(prompts):
        m.prefill(i, p, sample=False)
    out = []
    for s, t in enumerate(toks):
        m.decode_step(list(range(n)), t, [len(p) + s for p in prompts], graph=graph)
        lg = np.asarray(api.to_host(m.runner.logits).sync_on(m.device_stream))
        out.append(lg[:n].astype(np.float32))
    for i in range(n):
        m.release(i)
    return np.stack(out)


def _ulp(x: np.ndarray, dtype: str) -> np.ndarray:
    """A unit in the last place of each row's largest magnitude (logits differ by the
    rounding of intermediates of that size, not of their own)."""
    mant = 10 if dtype == "float16" else 7
    top = np.abs(x).max(-1, keepdims=True)
    return np.exp2(np.floor(np.log2(np.maximum(top, 1e-3))) - mant)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cpu_fused_step_matches_unfused(monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 40, 70)]
    toks = [rng.integers(0, 256, 3).tolist() for _ in range(4)]
    ref = _decode_logits(_model(monkeypatch, "0", dtype), prompts, toks, graph=False)
    fm = _model(monkeypatch, "1", dtype)
    assert fm.runner.fused is not None
    got = _decode_logits(fm, prompts, toks, graph=False)
    assert np.isfinite(got).all() and np.abs(got).max() > 1.0
    # the same rounding points: at most a few units in the last place apart
    assert (np.abs(got - ref) <= 2 * _ulp(ref, dtype)).all()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_knob_values_and_unsupported_model(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _model(monkeypatch, "0", "float16")
    assert m.runner.fused is None
    m = _model(monkeypatch, "auto", "float16")  # auto: never on the cpu backend
    assert m.runner.fused is None
    tiny = dict(CPU_CFG, head_dim=16, hidden_size=64)
    with pytest.raises(ValueError, match=r"DEVICEOPS_FUSED_DECODE=1.*head_dim=16"):
        _model(monkeypatch, "1", "float16", cfg=tiny)
    with pytest.raises(ValueError, match=r"DEVICEOPS_FUSED_DECODE=.*expected auto, 0 or 1"):
        _model(monkeypatch, "yes", "float16")
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        _model(monkeypatch, "1", "float32")


def test_architecture_with_its_own_forward_is_not_fused() -> None:
    from types import SimpleNamespace

    from deviceops.nn.models.llama import Llama
    from deviceops.nn.runner.fused import fused_reason

    class Own(Llama):
        name = "own"

        def layer_ops(self, layer: Any, io: Any) -> Any:
            return super().layer_ops(layer, io)

    cfg = nn.LlamaConfig(**CPU_CFG)
    r = SimpleNamespace(arch=Own(), config=cfg, dtype="float16",
                        weights=SimpleNamespace(quantized=False))
    assert "own forward" in str(fused_reason(r))  # type: ignore[arg-type]
    r.arch = Llama()
    assert fused_reason(r) is None  # type: ignore[arg-type]
    r.weights.quantized = True
    assert "kept quantized" in str(fused_reason(r))  # type: ignore[arg-type]
    r.weights.quantized = False
    r.arch = SimpleNamespace(name="other")
    assert "own forward" in str(fused_reason(r))  # type: ignore[arg-type]


def test_step_argument_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _model(monkeypatch, "1", "float16")
    r, f = m.runner, m.runner.fused
    kw = dict(state=r.rows.state, table=r.kv.table, k_cache=r.cache.k, v_cache=r.cache.v)
    with pytest.raises(ValueError, match="b=0 rows"):
        f.step(0, logits=r.logits[:1], **kw)
    with pytest.raises(ValueError, match="b=5 rows"):
        f.step(5, logits=r.logits[:4], **kw)
    with pytest.raises(deviceops.ShapeError, match="logits"):
        f.step(2, logits=r.logits[:3], **kw)
    with pytest.raises(ValueError, match="caches"):
        f.step(2, logits=r.logits[:2], **dict(kw, k_cache=r.cache.k[:1]))
    assert MAX_ROWS == 32


# -- the kernel on the GPU -----------------------------------------------------------------------

SMOL = dict(vocab_size=4096, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
            num_kv_heads=3, head_dim=64, rope_theta=1e5)


def _cuda() -> None:
    if not deviceops.cuda_available():
        pytest.skip("needs a CUDA GPU")


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_fused_kernel_matches_unfused(monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    _cuda()
    rng = np.random.default_rng(7)
    for b, lens, mseq in ((1, [37], 512), (8, None, 512), (32, None, 512), (3, [2100, 5, 900], 2400)):
        lens = lens or rng.integers(1, 300, b).tolist()
        prompts = [rng.integers(0, 4096, n).tolist() for n in lens]
        toks = [rng.integers(0, 4096, len(prompts)).tolist() for _ in range(3)]
        kw = {"max_batch": max(b, 4), "max_seq": mseq, "kv_blocks": max(b, 4) * mseq // 16 + 8}
        ref = _decode_logits(_model(monkeypatch, "0", dtype, 0, SMOL, **kw), prompts, toks, graph=True)
        fm = _model(monkeypatch, "1", dtype, 0, SMOL, **kw)
        got = _decode_logits(fm, prompts, toks, graph=True)
        eager = _decode_logits(fm, prompts, toks, graph=False)
        np.testing.assert_array_equal(got, eager)  # one kernel, replayed or launched
        err = np.abs(got - ref)
        assert (err <= 8 * _ulp(ref, dtype)).mean() >= 0.999, (b, float(err.max()))
        assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.95, b


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_fused_generate_greedy_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    _cuda()
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 4096, n).tolist() for n in (12, 90, 200, 31)]
    kw = {"max_batch": 4, "max_seq": 512, "kv_blocks": 140}
    ref = _model(monkeypatch, "0", "float16", 0, SMOL, **kw).generate(prompts, 48)
    got = _model(monkeypatch, "1", "float16", 0, SMOL, **kw).generate(prompts, 48)
    same = [list(a) == list(g) for a, g in zip(ref, got, strict=True)]
    # (a near-tie can flip one greedy choice and everything after it: at least 3 of 4 equal)
    assert sum(same) >= 3, same
