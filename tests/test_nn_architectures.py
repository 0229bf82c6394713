"""The architecture registry (``deviceops.nn.models``): a new architecture is one module and
one registry line.

``BiasedLlama`` below, defined only here, is Llama with q/k/v biases (as Qwen2 has) and an
untied LM head: it lists its extra weights and the rest (config, GGUF names, binding the
biases, the forward) is Llama's. Registered, it runs ``generate`` through the same runner as
Llama, checked against the float64 NumPy forward of ``nn_tiny`` (which adds the biases;
cpu backend). The registry's
keys come from the checkpoint (``config.json``'s ``architectures``, GGUF's
``general.architecture``); an unknown one is refused naming the registered ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from deviceops import api, nn
from deviceops.nn import models
from deviceops.nn.models import Llama, LlamaConfig

from . import nn_tiny


class BiasedLlama(Llama):
    """Llama with q/k/v projection biases (the whole difference: its weight list)."""

    name = "biased-llama"
    gguf_names = ("biased-llama",)
    hf_names = ("BiasedLlamaForCausalLM",)

    def weight_shapes(self, cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
        shapes = super().weight_shapes(cfg)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}.self_attn."
            shapes |= {p + "q_proj.bias": (cfg.q_size,), p + "k_proj.bias": (cfg.kv_size,),
                       p + "v_proj.bias": (cfg.kv_size,)}
        return shapes


CFG = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, rope_theta=10000.0, max_position_embeddings=128,
                  tie_word_embeddings=False, architecture="biased-llama", name="biased-tiny")


@pytest.fixture
def biased() -> Iterator[BiasedLlama]:
    arch = models.register(BiasedLlama())
    try:
        yield arch
    finally:
        models.unregister(arch)


# the float64 reference: nn_tiny's Llama forward, which adds q/k/v biases when given
DIMS = {"heads": CFG.num_heads, "kv_heads": CFG.num_kv_heads, "eps": CFG.rms_norm_eps,
        "theta": CFG.rope_theta, "layers": CFG.num_layers}


def reference_logits(w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    return nn_tiny.reference_logits(w, ids, DIMS)


def reference_greedy(w: dict[str, np.ndarray], ids: list[int], n: int) -> list[int]:
    return nn_tiny.reference_greedy(w, ids, n, DIMS)


# -- tests --------------------------------------------------------------------------------
def test_registered_architecture_generates_as_the_reference(biased: BiasedLlama) -> None:
    w = nn.random_weights(CFG, seed=5)
    assert "model.layers.1.self_attn.k_proj.bias" in w and "lm_head.weight" in w
    assert np.abs(w["model.layers.0.self_attn.q_proj.bias"]).max() > 0.05  # biases matter
    m = nn.CausalLM(CFG, w, tokenizer=None, device="cpu", dtype="float32", max_batch=2,
                    max_seq=64, prefill_chunk=16)
    assert m.arch is biased and m.layers[0].attn.qkv.bias is not None
    assert m.lm_head.weight is not m.embed.table  # untied
    ids = [3, 17, 42, 8, 61, 5, 90, 11, 29, 33, 2, 7, 70, 4, 19, 25, 50, 1]  # two chunks
    got = np.asarray(api.to_host(m.logits(ids).sync_on(m.device_stream)).sync_on(m.device_stream))
    ref = reference_logits(w, ids)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5
    m.release(0)
    want = reference_greedy(w, ids, 6)
    assert m.generate(ids, 6) == want
    assert m.generate([ids, ids[:5]], 6, graph=False) == [want, reference_greedy(w, ids[:5], 6)]
    # the same weights as plain Llama (biases ignored) give other logits: the biases are used
    plain = nn.CausalLM(dataclasses.replace(CFG, architecture="llama"), w, tokenizer=None,
                        device="cpu", dtype="float32", max_batch=1, max_seq=64)
    other = np.asarray(api.to_host(plain.logits(ids).sync_on(plain.device_stream))
                       .sync_on(plain.device_stream))
    assert np.abs(other - ref).max() / np.abs(ref).max() > 1e-3


def test_the_checkpoint_names_the_architecture(biased: BiasedLlama) -> None:
    from deviceops.nn.checkpoint import expected_shapes, hf_config

    hf: dict[str, Any] = {"architectures": ["BiasedLlamaForCausalLM"], "model_type": "x",
                          "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
                          "num_hidden_layers": 2, "num_attention_heads": 4,
                          "num_key_value_heads": 2}
    cfg = hf_config(hf)
    assert cfg.architecture == "biased-llama" and models.get("biased-llama") is biased
    assert "model.layers.0.self_attn.v_proj.bias" in expected_shapes(cfg)
    assert hf_config({**hf, "architectures": ["LlamaForCausalLM"]}).architecture == "llama"
    del hf["architectures"]
    assert hf_config({**hf, "model_type": "llama"}).architecture == "llama"
    gguf_cfg = biased.config_from_gguf(
        {"general.architecture": "biased-llama", "biased-llama.attention.head_count": 4,
         "biased-llama.embedding_length": 32, "biased-llama.feed_forward_length": 48,
         "biased-llama.block_count": 2}, vocab_size=96, tensors={"output.weight"})
    assert gguf_cfg.architecture == "biased-llama" and not gguf_cfg.tie_word_embeddings


def test_unknown_architecture_lists_the_registered_ones() -> None:
    from deviceops.nn.checkpoint import hf_config

    assert {"llama", "LlamaForCausalLM", "qwen2", "Qwen2ForCausalLM"} <= set(models.registered())
    with pytest.raises(ValueError, match=r"unsupported architecture 'MambaForCausalLM'.*"
                                         r"LlamaForCausalLM, .*llama"):
        hf_config({"architectures": ["MambaForCausalLM"]})
    with pytest.raises(ValueError, match=r"random_model|deviceops.nn: unsupported architecture "
                                         r"'gpt9'.*llama"):
        nn.random_model(dataclasses.replace(CFG, architecture="gpt9"), device="cpu")
    with pytest.raises(ValueError, match="already name"):
        models.register(type("Clash", (Llama,), {"name": "clash", "gguf_names": ("llama",)})())
    assert "clash" not in models.registered()
