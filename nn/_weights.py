"""Weight binding: Hugging Face-named float32 host arrays to the device modules of a
:class:`~.model.CausalLM` (QKV and gate/up fused, every matrix stored ``(N, K)`` and used
through ``gemm(..., trans_b=True)``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import deviceops
from deviceops import Tensor, api

from ._forward import Layer
from .config import LlamaConfig
from .layers import Embedding, Linear, RMSNorm, RotaryAttention, SwiGLU

__all__ = ["Weights", "bind_weights"]


@dataclass
class Weights:
    """A model's device modules."""

    embed: Embedding
    lm_head: Linear
    norm: RMSNorm
    layers: list[Layer]

    @property
    def nbytes(self) -> int:
        """Bytes of the device weights (a decode step reads each once)."""
        ts = [self.embed.table, self.norm.weight]
        for ly in self.layers:
            ts += [ly.norm1.weight, ly.attn.qkv.weight, ly.attn.o.weight, ly.norm2.weight,
                   ly.mlp.gate_up.weight, ly.mlp.down.weight]
        if self.lm_head.weight is not self.embed.table:
            ts.append(self.lm_head.weight)
        return sum(t.nbytes for t in ts)


def bind_weights(cfg: LlamaConfig, w: dict[str, np.ndarray], stream: deviceops.Stream,
                 dtype: str) -> Weights:
    """Upload ``w`` (float32 host arrays by Hugging Face name) in ``dtype`` on ``stream``.

    Returns:
        The modules; the LM head shares the embedding table with ``tie_word_embeddings``.
    """

    def up(a: np.ndarray) -> Tensor:
        return api.from_host(np.ascontiguousarray(a, dtype=np.float32), dtype).sync_on(stream)

    eps = cfg.rms_norm_eps
    embed = Embedding(up(w["model.embed_tokens.weight"]))
    lm_head = Linear(embed.table if cfg.tie_word_embeddings else up(w["lm_head.weight"]))
    norm = RMSNorm(up(w["model.norm.weight"]), eps)
    layers: list[Layer] = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv = np.concatenate([w[p + "self_attn.q_proj.weight"], w[p + "self_attn.k_proj.weight"],
                              w[p + "self_attn.v_proj.weight"]], axis=0)
        gu = np.concatenate([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]], axis=0)
        attn = RotaryAttention(Linear(up(qkv)), Linear(up(w[p + "self_attn.o_proj.weight"])),
                               cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta)
        mlp = SwiGLU(Linear(up(gu)), Linear(up(w[p + "mlp.down_proj.weight"])))
        layers.append(Layer(RMSNorm(up(w[p + "input_layernorm.weight"]), eps), attn,
                            RMSNorm(up(w[p + "post_attention_layernorm.weight"]), eps), mlp))
    return Weights(embed, lm_head, norm, layers)
