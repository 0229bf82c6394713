"""Gemma 3: :class:`Gemma3Config` and the :class:`Gemma3` architecture (registered as
``"gemma3"``, GGUF ``gemma3``, Hugging Face ``Gemma3ForCausalLM`` / ``gemma3_text``).

Gemma 3 (text) is a Llama-family decoder with these differences, all in this module:

* q/k RMSNorm: each query and key head is RMS-normed over its ``head_dim`` (weights
  ``self_attn.q_norm`` / ``k_norm``) before RoPE (:func:`deviceops.kernels.qk_rms_norm`,
  in place on the fused QKV rows);
* four norms a layer: ``input_layernorm`` before attention, ``post_attention_layernorm``
  on its output before the residual add, ``pre_feedforward_layernorm`` before the MLP and
  ``post_feedforward_layernorm`` on its output;
* every RMSNorm scales by ``1 + w`` (Hugging Face stores ``w``; llama.cpp stores ``1 + w``,
  so :meth:`Gemma3.from_gguf` subtracts 1 as transformers does and :meth:`Gemma3.bind`
  uploads ``1 + w``);
* the MLP is GELU-tanh gated (``down(gelu_tanh(gate) * up)``, :func:`deviceops.kernels.geglu`);
* the embedding output is scaled by ``sqrt(hidden_size)`` (the LM head, tied, is not);
* sliding-window layers: every ``sliding_window_pattern``-th layer (6: layers 5, 11, 17 of
  18) is global (full causal attention, RoPE base ``rope_theta``, 1e6); the others attend to
  the last ``sliding_window`` (512) positions only, with RoPE base ``rope_local_theta``
  (10 000): :func:`deviceops.kernels.flash_attention` ``window=``;
* the attention scale is ``query_pre_attn_scalar ** -0.5`` (256 for the 270M: ``1/16``,
  which is ``head_dim ** -0.5``);
* llama.cpp keeps the q/k rows in Hugging Face's order (NeoX-style RoPE): no permutation.

Gemma 3 270M (base)::

    Gemma3Config(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_layers=18,
                 num_heads=4, num_kv_heads=1, head_dim=256, rms_norm_eps=1e-6,
                 rope_theta=1e6, rope_local_theta=1e4, sliding_window=512,
                 sliding_window_pattern=6, query_pre_attn_scalar=256.0,
                 max_position_embeddings=32768, tie_word_embeddings=True, bos_token_id=2,
                 eos_token_id=1, add_bos_token=True)

The tokenizer (GGUF ``tokenizer.ggml.model`` ``llama``: SentencePiece) is built by
:func:`deviceops.nn.tokenizer.sentencepiece_from_gguf`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

import deviceops.kernels as kernels
from deviceops import Tensor

from ..layers import (
    Embedding,
    GeGLU,
    Linear,
    QuantEmbedding,
    QuantLinear,
    QuantPart,
    RMSNorm,
    RotaryAttention,
)
from .base import LayerIO, Thunk, Upload, Weights
from .llama import Llama, LlamaConfig
from .quantized import QuantArray

__all__ = ["Gemma3", "Gemma3Config", "Gemma3Layer"]


@dataclass(frozen=True)
class Gemma3Config(LlamaConfig):
    """:class:`~.llama.LlamaConfig` with Gemma 3's fields (module docstring).

    Attributes:
        rope_local_theta: RoPE base of the sliding-window layers.
        sliding_window: keys a sliding-window layer's query sees (itself included);
            ``None``: every layer is global.
        sliding_window_pattern: layer ``i`` is global when ``(i + 1) % pattern == 0``
            (used when ``layer_types`` is empty).
        layer_types: per layer, ``True`` for sliding-window attention (empty: from the
            pattern).
        query_pre_attn_scalar: the attention scale is its inverse square root.
    """

    rope_local_theta: float = 10000.0
    sliding_window: int | None = 512
    sliding_window_pattern: int = 6
    layer_types: tuple[bool, ...] = ()
    query_pre_attn_scalar: float = 256.0
    architecture: str = "gemma3"
    name: str = "gemma3"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"Gemma3Config: sliding_window={self.sliding_window} must be >= 1 "
                             "or None")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"Gemma3Config: layer_types has {len(self.layer_types)} entries for "
                             f"num_layers={self.num_layers}")
        if self.sliding_window_pattern < 1:
            raise ValueError(f"Gemma3Config: sliding_window_pattern={self.sliding_window_pattern} "
                             "must be >= 1")
        if not self.query_pre_attn_scalar > 0:
            raise ValueError(f"Gemma3Config: query_pre_attn_scalar={self.query_pre_attn_scalar} "
                             "must be > 0")

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends through the sliding window."""
        if self.sliding_window is None:
            return False
        if self.layer_types:
            return self.layer_types[layer]
        return (layer + 1) % self.sliding_window_pattern != 0

    def window(self, layer: int) -> int | None:
        """The attention window of ``layer`` (``None``: global)."""
        return self.sliding_window if self.is_sliding(layer) else None

    def theta(self, layer: int) -> float:
        """The RoPE base of ``layer``."""
        return self.rope_local_theta if self.is_sliding(layer) else self.rope_theta

    @property
    def attn_scale(self) -> float:
        """The softmax scale: ``query_pre_attn_scalar ** -0.5``."""
        return 1.0 / math.sqrt(self.query_pre_attn_scalar)

    @property
    def embed_scale(self) -> float:
        """What the embedding output is multiplied by: ``sqrt(hidden_size)``."""
        return math.sqrt(self.hidden_size)

    @property
    def num_parameters(self) -> int:
        h, d = self.hidden_size, self.head_dim
        return super().num_parameters + self.num_layers * (2 * h + 2 * d)


@dataclass
class Gemma3Layer:
    """One Gemma 3 decoder layer's device modules (QKV and gate/up fused; norms hold
    ``1 + w``)."""

    norm1: RMSNorm
    attn: RotaryAttention
    post_attn_norm: RMSNorm
    pre_ff_norm: RMSNorm
    mlp: GeGLU
    post_ff_norm: RMSNorm


_GGUF_QK_NORM = re.compile(r"^blk\.(\d+)\.attn_([qk])_norm\.weight$")


def _layer_types(cfg: Mapping[str, Any], n: int) -> tuple[bool, ...]:
    types = cfg.get("layer_types")
    if not isinstance(types, list) or not types:
        return ()
    bad = [t for t in types if t not in ("sliding_attention", "full_attention")]
    if bad or len(types) != n:
        raise ValueError(f"load_safetensors: gemma3: layer_types {types!r} must list "
                         f"{n} of 'sliding_attention' / 'full_attention'")
    return tuple(t == "sliding_attention" for t in types)


def _rope_bases(cfg: Mapping[str, Any]) -> tuple[float, float]:
    """(global, local) RoPE bases of a config.json: ``rope_theta`` and
    ``rope_local_base_freq``, or newer transformers' ``rope_parameters`` per layer type.

    Raises:
        ValueError: RoPE scaling other than the default.
    """
    glob = float(cfg.get("rope_theta") or 1_000_000.0)
    local = float(cfg.get("rope_local_base_freq") or 10_000.0)
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, Mapping) and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    if scaling:
        raise ValueError(f"load_safetensors: gemma3: rope_scaling={scaling!r} is not supported "
                         "(deviceops.nn computes plain RoPE)")
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping):
        for kind, value in params.items():
            if not isinstance(value, Mapping):
                continue
            if value.get("rope_type", "default") != "default":
                raise ValueError(f"load_safetensors: gemma3: {kind} RoPE {dict(value)!r} is not "
                                 "supported (deviceops.nn computes plain RoPE)")
            if "rope_theta" in value and kind == "full_attention":
                glob = float(value["rope_theta"])
            elif "rope_theta" in value and kind == "sliding_attention":
                local = float(value["rope_theta"])
    return glob, local


class Gemma3(Llama):
    """The Gemma 3 text architecture (module docstring)."""

    name = "gemma3"
    gguf_names = ("gemma3",)
    hf_names: ClassVar[tuple[str, ...]] = ("Gemma3ForCausalLM", "gemma3_text")
    config_class = Gemma3Config
    conversion_version = 1
    gguf_blocks: ClassVar[Mapping[str, str]] = {
        **Llama.gguf_blocks,
        "attn_norm": "input_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }

    # -- checkpoints ------------------------------------------------------------------------
    def config_from_gguf(self, meta: Mapping[str, Any], *, vocab_size: int | None,
                         tensors: set[str]) -> LlamaConfig:
        """From the ``gemma3.*`` keys: ``head_dim`` from ``attention.key_length``, the
        window from ``attention.sliding_window``; llama.cpp's fixed pattern (every 6th layer
        global), local RoPE base (10 000) and attention scale (``query_pre_attn_scalar`` =
        ``head_dim``, ``hidden / heads`` for the 27B), as the file does not store them."""
        base = super().config_from_gguf(meta, vocab_size=vocab_size, tensors=tensors)
        arch = str(meta.get("general.architecture", "gemma3"))
        head_dim = int(meta.get(f"{arch}.attention.key_length", base.head_dim))
        value_dim = int(meta.get(f"{arch}.attention.value_length", head_dim))
        if value_dim != head_dim:
            raise ValueError(f"load_gguf: gemma3: key_length {head_dim} != value_length "
                             f"{value_dim} is not supported")
        window = meta.get(f"{arch}.attention.sliding_window")
        scaling = meta.get(f"{arch}.rope.scaling.type")
        if scaling not in (None, "none"):
            raise ValueError(f"load_gguf: gemma3: rope scaling {scaling!r} is not supported "
                             "(deviceops.nn computes plain RoPE)")
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaConfig)}
        fields |= {"head_dim": head_dim, "add_bos_token": bool(
            meta.get("tokenizer.ggml.add_bos_token", True))}
        # llama.cpp's attention scale: 1/sqrt(head_dim), but hidden/heads for the 27B (62 layers)
        scalar = base.hidden_size / base.num_heads if base.num_layers == 62 else float(head_dim)
        return Gemma3Config(
            **fields,
            rope_local_theta=float(meta.get(f"{arch}.rope.freq_base_swa", 10_000.0)),
            sliding_window=None if window is None else int(window),
            query_pre_attn_scalar=float(scalar),
        )

    def config_from_hf(self, cfg: Mapping[str, Any]) -> LlamaConfig:
        """From a ``Gemma3ForCausalLM`` (``gemma3_text``) ``config.json``.

        Raises:
            ValueError: a required key is missing, or the config asks for logit
                soft-capping, RoPE scaling, bidirectional attention or an activation other
                than GELU-tanh, which this module does not implement.
        """
        for k in ("final_logit_softcapping", "attn_logit_softcapping"):
            if cfg.get(k) is not None:
                raise ValueError(f"load_safetensors: gemma3: {k}={cfg[k]!r} is not supported")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("load_safetensors: gemma3: use_bidirectional_attention=true is not "
                             "supported (deviceops.nn runs causal attention)")
        act = cfg.get("hidden_activation", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"load_safetensors: gemma3: hidden_activation={act!r} is not "
                             "supported (GELU-tanh only)")
        base = Llama.config_from_hf(self, {**cfg, "tie_word_embeddings":
                                           cfg.get("tie_word_embeddings", True)})
        glob, local = _rope_bases(cfg)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaConfig)}
        fields |= {"rope_theta": glob, "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
                   "add_bos_token": True}
        window = cfg.get("sliding_window")
        head_dim = int(fields["head_dim"])
        return Gemma3Config(
            **fields,
            rope_local_theta=local,
            sliding_window=None if window is None else int(window),
            sliding_window_pattern=int(cfg.get("sliding_window_pattern") or 6),
            layer_types=_layer_types(cfg, int(fields["num_layers"])),
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or head_dim),
        )

    def weight_shapes(self, cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
        shapes = super().weight_shapes(cfg)
        h, d = cfg.hidden_size, cfg.head_dim
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                       p + "pre_feedforward_layernorm.weight": (h,),
                       p + "post_feedforward_layernorm.weight": (h,)}
        return shapes

    def hf_name(self, gguf_name: str) -> str | None:
        m = _GGUF_QK_NORM.match(gguf_name)
        if m:
            return f"model.layers.{m.group(1)}.self_attn.{m.group(2)}_norm.weight"
        return super().hf_name(gguf_name)

    def from_gguf(self, hf_name: str, array: np.ndarray, cfg: LlamaConfig) -> np.ndarray:
        """llama.cpp stores every norm weight as ``1 + w``: back to Hugging Face's ``w``
        (q/k rows as stored: llama.cpp keeps Gemma's in Hugging Face's order)."""
        if hf_name.endswith("norm.weight"):
            return array - np.asarray(1, array.dtype)
        return array

    # -- device -----------------------------------------------------------------------------
    def bind(self, cfg: LlamaConfig, weights: Mapping[str, Any], upload: Upload) -> Weights:
        """Upload the weights: every norm as ``1 + w``; QKV and gate/up fused; the LM head
        is the embedding table (Gemma 3 ties them).

        Quantized matrices (:class:`~deviceops.nn.models.quantized.QuantArray`,
        ``weights="native"``) become :class:`~deviceops.nn.layers.QuantLinear` s (a fused
        group keeps one part per run of one format: Gemma 3 270M's Q5_0 q/k and Q8_0 v) and
        a :class:`~deviceops.nn.layers.QuantEmbedding` whose packed table the tied LM head
        reads too; a fused group mixing quantized and float parts is dequantized."""
        if not isinstance(cfg, Gemma3Config):
            raise TypeError(f"gemma3: the config is a {type(cfg).__name__}, not a Gemma3Config")
        tensors: list[Tensor] = []
        quantized: list[QuantLinear] = []

        def up(a: np.ndarray) -> Tensor:
            t = upload(a)
            tensors.append(t)
            return t

        def linear(*modules: str) -> Linear | QuantLinear:
            ws = [weights[m + ".weight"] for m in modules]
            if all(isinstance(w, QuantArray) for w in ws):
                groups: list[list[QuantArray]] = []
                for w in ws:  # consecutive parts of one format: one packed weight
                    if groups and groups[-1][0].fmt == w.fmt:
                        groups[-1].append(w)
                    else:
                        groups.append([w])
                parts, row0 = [], 0
                for g in groups:
                    qa = QuantArray.concat(g)
                    parts.append(QuantPart(up(qa.packed()), qa.fmt, None, row0))
                    row0 += qa.shape[0]
                ql = QuantLinear(parts, ws[0].shape[1], None)
                quantized.append(ql)
                return ql
            dense = [w.dequantize() if isinstance(w, QuantArray) else w for w in ws]
            return Linear(up(np.concatenate(dense, axis=0)))

        eps = cfg.rms_norm_eps

        def norm(name: str) -> RMSNorm:
            w = np.asarray(weights[name], np.float32)
            return RMSNorm(up(w + np.float32(1.0)), eps)

        emb_w = weights["model.embed_tokens.weight"]
        embed: Embedding | QuantEmbedding
        lm_head: Linear | QuantLinear
        if isinstance(emb_w, QuantArray):
            table = up(emb_w.packed())
            embed = QuantEmbedding(table, emb_w.fmt, emb_w.shape[1])
            if cfg.tie_word_embeddings:
                lm_head = QuantLinear([QuantPart(table, emb_w.fmt, None, 0)], emb_w.shape[1])
        else:
            embed = Embedding(up(emb_w))
            if cfg.tie_word_embeddings:
                lm_head = Linear(embed.table)
        if not cfg.tie_word_embeddings:
            lm_head = linear("lm_head")
            if isinstance(lm_head, QuantLinear):  # (no prefill scratch for the LM head)
                quantized.remove(lm_head)
        layers: list[Any] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            attn = RotaryAttention(
                linear(a + "q_proj", a + "k_proj", a + "v_proj"), linear(a + "o_proj"),
                cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.theta(i),
                q_norm=norm(a + "q_norm.weight").weight, k_norm=norm(a + "k_norm.weight").weight,
                norm_eps=eps, window=cfg.window(i), scale=cfg.attn_scale)
            mlp = GeGLU(linear(p + "mlp.gate_proj", p + "mlp.up_proj"), linear(p + "mlp.down_proj"))
            layers.append(Gemma3Layer(
                norm(p + "input_layernorm.weight"), attn, norm(p + "post_attention_layernorm.weight"),
                norm(p + "pre_feedforward_layernorm.weight"), mlp,
                norm(p + "post_feedforward_layernorm.weight")))
        final = norm("model.norm.weight")
        scratch = None
        if quantized:  # prefill's dequantized matrix (the LM head's excepted: see QuantLinear)
            scratch = upload(np.zeros(max(q.out_features * q.in_features for q in quantized),
                                      np.float32))
            for ql in quantized:
                ql.scratch = scratch
        return Weights(embed, lm_head, final, layers, tensors, scratch=scratch,
                       quantized=isinstance(embed, QuantEmbedding) or bool(quantized))

    # -- forward ----------------------------------------------------------------------------
    def embed_ops(self, w: Weights, ids: Any, out: Tensor) -> list[Thunk]:
        """The embedding rows times ``sqrt(hidden_size)`` (``out += (s - 1) out``)."""
        s = math.sqrt(int(out.shape[-1]))  # hidden_size (a quantized table is packed: not its width)
        return [lambda: w.embed(ids, out), lambda: kernels.saxpy(out, s - 1.0, out)]

    def layer_ops(self, layer: Any, io: LayerIO) -> list[Thunk]:
        """Sandwich-norm residual block. The previous layer's output (``down``: its
        post-feed-forward-normed MLP output) is added into the stream by this layer's first
        norm (layer 0 norms the embedding), the last layer's by :meth:`final_norm_ops`::

            normed = norm1(resid += down)
            o = attention(normed)            (q/k normed, RoPE, window on local layers)
            normed = post_attn_norm(o)
            o = pre_ff_norm(resid += normed)
            normed = mlp(o); down = post_ff_norm(normed)
        """
        ly: Gemma3Layer = layer
        vw = io.views
        resid, normed, o, down = vw["resid"], vw["normed"], vw["o"], vw["down"]
        th: list[Thunk] = []
        if io.index == 0:
            th.append(lambda: ly.norm1(resid, normed))
        else:
            th.append(lambda: ly.norm1.add_norm(down, resid, normed))
        th += ly.attn.ops(normed, io.k_cache, io.v_cache, io.start, io.kv_len, vw["attn"], o,
                          block_table=io.table, fresh_kv=io.fresh_kv)
        th.append(lambda: ly.post_attn_norm(o, normed))
        th.append(lambda: ly.pre_ff_norm.add_norm(normed, resid, o))
        th += ly.mlp.ops(o, vw["gu"], vw["act"], normed)
        th.append(lambda: ly.post_ff_norm(normed, down))
        return th
