"""Qwen2: the :class:`Qwen2` architecture (registered as ``"qwen2"``, GGUF ``qwen2``,
Hugging Face ``Qwen2ForCausalLM``).

Qwen2 (and Qwen2.5, Qwen2.5-Coder) is the Llama-family decoder with three differences,
all in this module:

* the q/k/v projections have biases (``model.layers.{i}.self_attn.q_proj.bias`` ...;
  GGUF ``blk.{i}.attn_q.bias``), listed by :meth:`Qwen2.weight_shapes` and bound by
  :meth:`~.llama.Llama.bind` (fused into the QKV bias);
* llama.cpp stores Qwen2's q/k rows as Hugging Face does (it runs them with NeoX-style
  RoPE, which is the rotate-half order the runner uses), so :meth:`Qwen2.from_gguf` undoes
  no permutation;
* ``<|endoftext|>`` (the GGUF's padding id, the config's ``bos_token_id``) ends generation
  as well as EOS (``<|im_end|>`` for the instruct models), as the models'
  ``generation_config.json`` says.

The config is Llama's (:class:`~.llama.LlamaConfig`) read from the ``qwen2.*`` GGUF keys or
a ``Qwen2ForCausalLM`` ``config.json``. Qwen2.5-Coder-0.5B-Instruct::

    LlamaConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                num_heads=14, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6,
                rope_theta=1e6, max_position_embeddings=32768, tie_word_embeddings=False,
                bos_token_id=151643, eos_token_id=151645, extra_eos_ids=(151643,))

The tokenizer (GGUF ``tokenizer.ggml.pre`` ``qwen2``) is built by
:func:`deviceops.nn.tokenizer.tokenizer_from_gguf`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from .llama import Llama, LlamaConfig

__all__ = ["Qwen2"]

_GGUF_BIAS = re.compile(r"^blk\.(\d+)\.attn_([qkv])\.bias$")


def _with_endoftext(cfg: LlamaConfig, endoftext: Any) -> LlamaConfig:
    """``cfg`` with ``endoftext`` (an id or ``None``) among the ids that end generation."""
    if endoftext is None or int(endoftext) == cfg.eos_token_id:
        return cfg
    extra = tuple(dict.fromkeys([*cfg.extra_eos_ids, int(endoftext)]))
    return dataclasses.replace(cfg, extra_eos_ids=extra)


class Qwen2(Llama):
    """The Qwen2 architecture (module docstring): Llama with q/k/v biases."""

    name = "qwen2"
    gguf_names = ("qwen2",)
    hf_names = ("Qwen2ForCausalLM",)

    # -- checkpoints ------------------------------------------------------------------------
    def config_from_gguf(self, meta: Mapping[str, Any], *, vocab_size: int | None,
                         tensors: set[str]) -> LlamaConfig:
        cfg = super().config_from_gguf(meta, vocab_size=vocab_size, tensors=tensors)
        pad = meta.get("tokenizer.ggml.padding_token_id", meta.get("tokenizer.ggml.bos_token_id"))
        return _with_endoftext(cfg, pad)

    def config_from_hf(self, cfg: Mapping[str, Any]) -> LlamaConfig:
        """From a ``Qwen2ForCausalLM`` ``config.json`` (Llama's keys).

        Raises:
            ValueError: a required key is missing, or the config asks for sliding-window
                attention or RoPE scaling, which this module does not implement.
        """
        if cfg.get("use_sliding_window"):
            raise ValueError("load_safetensors: qwen2: use_sliding_window=true is not supported "
                             "(deviceops.nn runs full causal attention)")
        if cfg.get("rope_scaling"):
            raise ValueError(f"load_safetensors: qwen2: rope_scaling={cfg['rope_scaling']!r} is "
                             "not supported (deviceops.nn computes plain RoPE)")
        out = super().config_from_hf(cfg)
        return _with_endoftext(out, cfg.get("bos_token_id"))

    def weight_shapes(self, cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
        shapes = super().weight_shapes(cfg)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}.self_attn."
            shapes |= {p + "q_proj.bias": (cfg.q_size,), p + "k_proj.bias": (cfg.kv_size,),
                       p + "v_proj.bias": (cfg.kv_size,)}
        return shapes

    def hf_name(self, gguf_name: str) -> str | None:
        m = _GGUF_BIAS.match(gguf_name)
        if m:
            return f"model.layers.{m.group(1)}.self_attn.{m.group(2)}_proj.bias"
        return super().hf_name(gguf_name)

    def from_gguf(self, hf_name: str, array: Any, cfg: LlamaConfig) -> Any:
        """As stored: llama.cpp keeps Qwen2's q/k rows in Hugging Face's order."""
        return array
