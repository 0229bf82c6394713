"""Gemma 3 on the GPU: the sliding-window attention kernels, q/k RMSNorm and GEGLU against
their float64 references, and a tiny random-weight Gemma 3 (built from a transformers
``Gemma3TextConfig``) in fp16/bf16 against transformers in float64; graph decode equals eager.

Tolerances:

* kernels: fp16 outputs within 2e-3 absolute of the float64 reference (values ~1), bf16
  within 1.6e-2; the window path equals the dense reference given the same window as an
  explicit mask (the reference's own dense path, masked);
* tiny model (random weights, 6 layers, head dim 256, window 16, a 40-token prompt so the
  window masks keys): prefill logits within ``REL[dtype]`` of the largest float64 logit,
  greedy tokens equal to transformers' float64 greedy up to the first step whose top-2
  margin is below ``TIE[dtype]``;
* graph replay vs eager decode fed the same tokens: every step's logits within 0.05 (fp16)
  / 0.25 (bf16).

They skip without a GPU; the tiny-model tests also without ``transformers`` and ``torch``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import deviceops
import deviceops.kernels as kernels
from deviceops import api
from deviceops.kernels.attention._reference import attention_reference

pytestmark = pytest.mark.gpu

ATOL = {"float16": 2e-3, "bfloat16": 1.6e-2}
REL = {"float16": 1e-2, "bfloat16": 4e-2}
TIE = {"float16": 0.05, "bfloat16": 0.2}
GRAPH_ATOL = {"float16": 0.05, "bfloat16": 0.25}


def _cuda() -> deviceops.Device:
    if not deviceops.cuda_available():
        pytest.skip("needs a CUDA GPU")
    return deviceops.device(0)


def _np_dtype(dtype: str) -> Any:
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def _dense_masked(q: np.ndarray, k: np.ndarray, v: np.ndarray, lens: np.ndarray,
                  window: int) -> np.ndarray:
    """Float64 attention with an explicit (causal, sliding-window) mask, contiguous k/v."""
    b, hq, lq, d = q.shape
    g = hq // k.shape[1]
    out = np.zeros(q.shape, np.float64)
    for bi in range(b):
        n = int(lens[bi])
        pos = np.arange(lq)[:, None] + n - lq
        j = np.arange(n)[None, :]
        mask = (j <= pos) & (j > pos - window)
        for h in range(hq):
            s = q[bi, h].astype(np.float64) @ k[bi, h // g, :n].astype(np.float64).T / math.sqrt(d)
            s = np.where(mask, s, -np.inf)
            m = s.max(-1, keepdims=True)
            m = np.where(np.isfinite(m), m, 0.0)
            p = np.exp(s - m)
            den = p.sum(-1, keepdims=True)
            out[bi, h] = np.divide(p @ v[bi, h // g, :n].astype(np.float64), den,
                                   out=np.zeros((lq, d)), where=den > 0)
    return out


def _run_attention(dev: deviceops.Device, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                   lens: np.ndarray, window: int, table: np.ndarray | None = None) -> np.ndarray:
    s = dev.new_stream()
    qt, kt, vt = (api.from_host(a).sync_on(s) for a in (q, k, v))
    lt = api.from_host(lens.astype(np.int32)).sync_on(s)
    bt = None if table is None else api.from_host(table.astype(np.int32)).sync_on(s)
    o = kernels.flash_attention(qt, kt, vt, causal=True, kv_len=lt, window=window,
                                block_table=bt).sync_on(s)
    return np.asarray(api.to_host(o).sync_on(s), np.float64)


# (B, Hq, Hkv, Lq, Lk, D, window): prefill (sm_90 wgmma path for Lq > 8), decode, short
# chunks (split-KV path), odd lengths, head dims 256, 128, 72
CASES = [
    (1, 4, 1, 1000, 1000, 256, 512),
    (2, 4, 1, 300, 300, 256, 64),
    (1, 8, 2, 129, 517, 128, 100),
    (2, 4, 1, 1, 2049, 256, 512),
    (3, 4, 4, 5, 777, 72, 33),
    (1, 4, 1, 7, 40, 256, 1),
    (2, 2, 1, 64, 64, 256, 1000),  # window wider than the keys: the dense causal result
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_window_attention_equals_masked_dense(dtype: str, case: tuple[int, ...]) -> None:
    dev = _cuda()
    b, hq, hkv, lq, lk, d, window = case
    rng = np.random.default_rng(sum(case))
    dt = _np_dtype(dtype)
    q = rng.standard_normal((b, hq, lq, d)).astype(dt)
    k = rng.standard_normal((b, hkv, lk, d)).astype(dt)
    v = rng.standard_normal((b, hkv, lk, d)).astype(dt)
    lens = np.array([lk - (3 * i) % max(1, lk - lq) for i in range(b)], np.int64)
    got = _run_attention(dev, q, k, v, lens, window)
    want = _dense_masked(q, k, v, lens, window)
    ref = attention_reference(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                              causal=True, kv_len=lens, window=window)
    np.testing.assert_allclose(ref, want, atol=1e-12)
    err = float(np.max(np.abs(got - want)))
    assert err <= ATOL[dtype], f"{case} {dtype}: window attention off by {err:.3g}"


@pytest.mark.parametrize("lq", [1, 3, 16])
def test_window_attention_paged(lq: int) -> None:
    """The paged decode path the runner uses (block table, kv_len) with a window."""
    dev = _cuda()
    b, hq, hkv, d, bs, window = 2, 4, 1, 256, 16, 40
    lens = np.array([131, 77])
    mb = -(-int(lens.max()) // bs)
    nb = b * mb + 3
    rng = np.random.default_rng(lq)
    pool_k = rng.standard_normal((nb, hkv, bs, d)).astype(np.float16)
    pool_v = rng.standard_normal((nb, hkv, bs, d)).astype(np.float16)
    table = rng.permutation(nb)[: b * mb].reshape(b, mb)
    q = rng.standard_normal((b, hq, lq, d)).astype(np.float16)
    got = _run_attention(dev, q, pool_k, pool_v, lens, window, table)
    # the same keys laid out contiguously
    k = pool_k[table].transpose(0, 2, 1, 3, 4).reshape(b, hkv, mb * bs, d)
    v = pool_v[table].transpose(0, 2, 1, 3, 4).reshape(b, hkv, mb * bs, d)
    want = _dense_masked(q, k, v, lens, window)
    err = float(np.max(np.abs(got - want)))
    assert err <= ATOL["float16"], f"paged window attention (Lq={lq}) off by {err:.3g}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_qk_rms_norm_and_geglu_match_reference(dtype: str) -> None:
    from deviceops.kernels.elementwise._reference import geglu_reference
    from deviceops.kernels.transformer._reference import qk_rms_norm_reference

    dev = _cuda()
    s = dev.new_stream()
    dt = _np_dtype(dtype)
    atol = ATOL.get(dtype, 1e-5) * 4
    rng = np.random.default_rng(1)
    hq, hkv, d = 4, 1, 256
    qkv = (rng.standard_normal((3, 7, (hq + 2 * hkv) * d)) * 3).astype(dt)
    wq, wk = (rng.standard_normal(d) * 0.5 + 1).astype(dt), (rng.standard_normal(d) + 1).astype(dt)
    t = api.from_host(qkv).sync_on(s)
    kernels.qk_rms_norm(t, api.from_host(wq).sync_on(s), api.from_host(wk).sync_on(s),
                        n_heads=hq, n_kv_heads=hkv, eps=1e-6).sync_on(s)
    got = np.asarray(api.to_host(t).sync_on(s), np.float64)
    want = qk_rms_norm_reference(qkv.astype(np.float64), wq, wk, hq, hkv, 1e-6)
    assert float(np.max(np.abs(got - want))) <= atol * 4
    assert np.array_equal(got[..., (hq + hkv) * d:], qkv[..., (hq + hkv) * d:].astype(np.float64))
    gu = (rng.standard_normal((5, 2 * 2048)) * 2).astype(dt)
    out = kernels.geglu(api.from_host(gu).sync_on(s)).sync_on(s)
    got = np.asarray(api.to_host(out).sync_on(s), np.float64)
    want = geglu_reference(gu.astype(np.float64))
    assert float(np.max(np.abs(got - want) / (1 + np.abs(want)))) <= atol


def test_greedy_and_top_k_sampling_over_the_262k_vocabulary() -> None:
    """Gemma 3's vocabulary (262,144 logits a row): greedy picks the argmax; top-k 5
    sampling picks one of the 5 largest values."""
    dev = _cuda()
    s = dev.new_stream()
    rng = np.random.default_rng(3)
    b, v = 3, 262_144
    logits = (rng.standard_normal((b, v)) * 4).astype(np.float16)
    lt = api.from_host(logits).sync_on(s)
    temp = api.from_host(np.array([0.0, 1.0, 0.7], np.float32)).sync_on(s)
    top_k = api.from_host(np.array([0, 5, 5], np.int32)).sync_on(s)
    top_p = api.from_host(np.ones(b, np.float32)).sync_on(s)
    seed = api.from_host(np.arange(b, dtype=np.int64)).sync_on(s)
    counter = api.from_host(np.zeros(b, np.int64)).sync_on(s)
    out = kernels.sample(lt, temp, top_k, top_p, seed, counter).sync_on(s)
    got = np.asarray(api.to_host(out).sync_on(s))
    assert got[0] == int(np.argmax(logits[0]))
    for r in (1, 2):
        # (ties at the 5th largest value are kept)
        assert logits[r, got[r]] >= np.sort(logits[r])[-5], (r, got[r])


# -- a tiny random Gemma 3 against transformers -------------------------------------------------

TINY = dict(vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=16,
            max_position_embeddings=512, rms_norm_eps=1e-6, query_pre_attn_scalar=256,
            rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, bos_token_id=2,
            eos_token_id=1, pad_token_id=0, tie_word_embeddings=True)


def _transformers() -> tuple[Any, Any]:
    """``(torch, transformers)`` with Gemma 3 imported, or the test skipped.

    transformers probes for the hub's ``kernels`` package by importing ``kernels``; from the
    repository root (on ``sys.path`` under pytest) that would import this project's
    ``kernels/`` folder instead, so the folder is hidden while transformers loads."""
    import importlib.util
    import sys

    torch = pytest.importorskip("torch")
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.find_spec("kernels") if "kernels" not in sys.modules else None
    ours = spec is not None and spec.origin is not None and Path(spec.origin).resolve().is_relative_to(root)
    if ours:
        sys.modules["kernels"] = None  # type: ignore[assignment]
    try:
        transformers = pytest.importorskip("transformers")
        _ = (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM)
    finally:
        if ours:
            del sys.modules["kernels"]
    return torch, transformers


def _tiny_folder(tmp: Path) -> tuple[Path, Any]:
    """A Hugging Face folder of a random tiny Gemma 3 (and the float64 transformers model)."""
    torch, transformers = _transformers()
    from tokenizers import Tokenizer, models

    cfg = transformers.Gemma3TextConfig(**TINY, attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn_like(p) * 0.3)  # (1 + w) with w != 0
            else:
                p.copy_(torch.randn_like(p) * (0.5 if "embed" in name else 0.08))
    hf.save_pretrained(tmp, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(TINY["vocab_size"])}
    Tokenizer(models.WordLevel(vocab, unk_token="t3")).save(str(tmp / "tokenizer.json"))
    cfg_json = json.loads((tmp / "config.json").read_text())
    assert cfg_json.get("architectures") == ["Gemma3ForCausalLM"], cfg_json.get("architectures")
    return tmp, hf.double()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    _cuda()
    return _tiny_folder(tmp_path_factory.mktemp("gemma3_tiny"))


PROMPT = [2, *[(i * 37 + 11) % 380 + 4 for i in range(39)]]  # 40 tokens: > the window of 16


def _hf_logits(hf: Any, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return np.asarray(hf(torch.tensor([ids])).logits[0].numpy(), np.float64)


def _hf_greedy(hf: Any, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    toks, margins, cur = [], [], list(ids)
    for _ in range(n):
        row = _hf_logits(hf, cur)[-1]
        top2 = np.sort(row)[-2:]
        margins.append(float(top2[1] - top2[0]))
        toks.append(int(np.argmax(row)))
        cur.append(toks[-1])
    return toks, margins


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tiny_gemma3_matches_transformers(dtype: str, tiny: tuple[Path, Any]) -> None:
    from deviceops import nn

    folder, hf = tiny
    m = nn.load_safetensors(folder, dtype=dtype, device="cuda", max_batch=2, max_seq=128)
    assert m.config.architecture == "gemma3" and m.config.sliding_window == 16
    s = m.device_stream
    got = np.asarray(api.to_host(m.logits(PROMPT).sync_on(s)).sync_on(s), np.float64)
    m.release(0)
    want = _hf_logits(hf, PROMPT)
    rel = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    assert rel <= REL[dtype], f"{dtype}: prefill logits off by {rel:.3g} of the largest"
    n = 24
    toks, margins = _hf_greedy(hf, PROMPT, n)
    ours = m.generate(PROMPT, n)
    assert len(ours) == n or ours[-1] == TINY["eos_token_id"], ours  # (EOS ends a row early)
    for i in range(len(ours)):
        if margins[i] < TIE[dtype]:
            break  # a near-tie: the continuations may differ from here
        assert ours[i] == toks[i], f"{dtype}: token {i}: {ours[:i + 1]} vs transformers {toks[:i + 1]}"


def forced_decode_logits(m: Any, ids: list[int], feed: list[int], graph: bool) -> list[np.ndarray]:
    """Row 0's logits after each decode step, feeding ``feed`` (teacher forcing)."""
    s = m.device_stream
    m.set_sampling(0)
    m.read(m.prefill(0, ids)).sync_on(s)
    pos, out = len(ids), []
    try:
        for t in feed:
            m.runner.rows.dirty = True  # upload the fed token
            m.read(m.decode_step([0], [t], [pos], graph=graph)).sync_on(s)
            out.append(np.asarray(api.to_host(m.runner.logits[0]).sync_on(s), np.float64))
            pos += 1
    finally:
        m.release(0)
    return out


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tiny_gemma3_graph_decode_equals_eager(dtype: str, tiny: tuple[Path, Any]) -> None:
    from deviceops import nn

    folder, hf = tiny
    m = nn.load_safetensors(folder, dtype=dtype, device="cuda", max_batch=2, max_seq=128)
    feed = [(i * 53 + 7) % 380 + 4 for i in range(30)]  # decode past the window
    g = forced_decode_logits(m, PROMPT, feed, graph=True)
    e = forced_decode_logits(m, PROMPT, feed, graph=False)
    want = _hf_logits(hf, PROMPT + feed)[len(PROMPT):]
    scale = float(np.max(np.abs(want)))
    for step, (gl, el) in enumerate(zip(g, e, strict=True), start=1):
        assert np.isfinite(gl).all() and np.isfinite(el).all(), f"step {step}: non-finite"
        diff = float(np.max(np.abs(gl - el)))
        assert diff <= GRAPH_ATOL[dtype], f"{dtype} step {step}: graph vs eager differ by {diff:.3g}"
        rel = float(np.max(np.abs(el - want[step - 1]))) / scale
        assert rel <= REL[dtype], f"{dtype} decode step {step}: off transformers by {rel:.3g}"


# -- a tiny random Gemma 3 GGUF against the float64 forward (no transformers needed) ------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tiny_gemma3_gguf_matches_float64_forward(dtype: str, tmp_path: Path) -> None:
    """The GGUF path (norms stored as ``1 + w``, SentencePiece vocabulary) on the GPU, head
    dim 256 and a window of 16: prefill logits and graph-replayed decode steps past the
    window against ``tests/test_nn_gemma3.py``'s float64 forward."""
    import dataclasses

    from deviceops import nn

    from .test_nn_gemma3 import CFG, gemma_weights, reference_logits, write_gemma_gguf

    _cuda()
    cfg = dataclasses.replace(CFG, hidden_size=128, intermediate_size=256, num_heads=4,
                              num_kv_heads=1, head_dim=256, sliding_window=16,
                              query_pre_attn_scalar=256.0)
    w = gemma_weights(cfg, 11)
    path = tmp_path / "tiny-gemma3.gguf"
    write_gemma_gguf(path, cfg, w)
    m = nn.load_gguf(path, device="cuda", dtype=dtype, max_batch=2, max_seq=128, progress=False)
    ids = [2, *[(i * 37 + 11) % 290 + 8 for i in range(39)]]
    feed = [(i * 53 + 7) % 290 + 8 for i in range(24)]
    want = reference_logits(cfg, w, ids + feed)
    scale = float(np.max(np.abs(want)))
    s = m.device_stream
    got = np.asarray(api.to_host(m.logits(ids).sync_on(s)).sync_on(s), np.float64)
    m.release(0)
    rel = float(np.max(np.abs(got - want[: len(ids)]))) / scale
    assert rel <= REL[dtype], f"{dtype}: prefill logits off the float64 forward by {rel:.3g}"
    steps = forced_decode_logits(m, ids, feed, graph=True)
    for k, row in enumerate(steps):
        rel = float(np.max(np.abs(row - want[len(ids) + k]))) / scale
        assert rel <= REL[dtype], f"{dtype}: decode step {k + 1} off the float64 forward by {rel:.3g}"
