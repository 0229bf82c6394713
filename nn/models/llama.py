"""Llama: :class:`LlamaConfig` and the :class:`Llama` architecture (registered as
``"llama"``, GGUF ``llama``, Hugging Face ``LlamaForCausalLM``).

The config is read from a GGUF file's metadata (:meth:`LlamaConfig.from_gguf_fields`) or a
Hugging Face ``config.json`` (:meth:`LlamaConfig.from_hf`). SmolLM2-135M::

    LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True)

:class:`Llama` is the reference Llama-family architecture (see :mod:`.base`): weights under
Hugging Face names (``model.layers.{i}.self_attn.q_proj.weight`` ...), llama.cpp's GGUF
names and q/k row order, QKV and gate/up fused on the device, and the forward::

    embedding -> per layer: add_rms_norm, QKV gemm, rope_kv_write (RoPE + cache write),
    flash_attention(causal, kv_len), merge_heads, O gemm, add_rms_norm, gate/up gemm,
    swiglu, down gemm -> final add_rms_norm -> LM head

A variant subclasses :class:`Llama`: a bias listed by :meth:`Llama.weight_shapes`
(``...q_proj.bias``, ``...o_proj.bias``, ``...gate_proj.bias`` ...) is bound by
:meth:`Llama.bind` without more code.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from deviceops import Tensor

from ..layers import (
    Embedding,
    Linear,
    QuantEmbedding,
    QuantLinear,
    QuantPart,
    RMSNorm,
    RotaryAttention,
    SwiGLU,
)
from .base import Architecture, LayerIO, Thunk, Upload, Weights
from .quantized import QuantArray

__all__ = ["Llama", "LlamaConfig", "LlamaLayer", "unpermute_qk"]


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama-architecture model (names as in Hugging Face's).

    Attributes:
        vocab_size: rows of the token embedding (and of the LM head).
        hidden_size: model width.
        intermediate_size: SwiGLU hidden width ``F`` (gate and up are ``F x hidden``).
        num_layers: decoder blocks.
        num_heads: query heads ``Hq``.
        num_kv_heads: key/value heads ``Hkv`` (``Hq % Hkv == 0``: grouped-query attention).
        head_dim: ``D`` (``hidden_size // num_heads`` unless the checkpoint says otherwise).
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: RoPE base.
        max_position_embeddings: the context the model was trained for.
        tie_word_embeddings: the LM head is the token embedding.
        bos_token_id, eos_token_id: special ids (``None`` if unknown).
        add_bos_token: whether ``encode`` prepends BOS (SmolLM2: no).
        architecture: the registered architecture's name (``"llama"``; a variant's own).
        name: a human-readable model name.
        extra_eos_ids: further ids that end generation (e.g. ``<|endoftext|>``).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    add_bos_token: bool = False
    architecture: str = "llama"
    name: str = "llama"
    extra_eos_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim"):
            v = getattr(self, k)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"LlamaConfig: {k}={v!r} must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"LlamaConfig: num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim={self.head_dim} must be even (RoPE rotates halves)")

    @property
    def q_size(self) -> int:
        """Rows of the query projection: ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Rows of the key (or value) projection: ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        """Rows of the fused QKV projection: ``(Hq + 2 Hkv) * D``."""
        return self.q_size + 2 * self.kv_size

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end generation: EOS and the extra ones."""
        ids = [] if self.eos_token_id is None else [self.eos_token_id]
        return tuple(dict.fromkeys([*ids, *self.extra_eos_ids]))

    @property
    def num_parameters(self) -> int:
        """Parameter count (the tied LM head counted once)."""
        h, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = h * self.qkv_size + self.q_size * h + 3 * h * f + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + head


    @classmethod
    def from_gguf_fields(cls, meta: Mapping[str, Any], *, vocab_size: int | None = None,
                         architecture: str = "llama") -> LlamaConfig:
        """From GGUF metadata (``{arch}.*`` keys, ``arch`` the file's ``general.architecture``;
        ``tokenizer.ggml.*``). ``tie_word_embeddings`` is ``True``: the loader unties it when
        the file has ``output.weight``.

        Raises:
            ValueError: a required key is missing.
        """
        arch = str(meta.get("general.architecture", architecture))

        def need(key: str) -> Any:
            k = f"{arch}.{key}"
            if k not in meta:
                raise ValueError(f"load_gguf: the file's metadata has no {k!r}")
            return meta[k]

        heads = int(need("attention.head_count"))
        hidden = int(need("embedding_length"))
        vocab = meta.get(f"{arch}.vocab_size", vocab_size)
        if vocab is None:
            raise ValueError(f"load_gguf: the vocabulary size is unknown (no {arch}.vocab_size, "
                             "no tokens)")
        head_dim = int(meta.get(f"{arch}.rope.dimension_count", hidden // heads))
        eos = meta.get("tokenizer.ggml.eos_token_id")
        bos = meta.get("tokenizer.ggml.bos_token_id")
        return cls(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_layers=int(need("block_count")),
            num_heads=heads,
            num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
            tie_word_embeddings=True,
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=None if eos is None else int(eos),
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            architecture=architecture,
            name=str(meta.get("general.name", arch)),
        )

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], *, architecture: str = "llama") -> LlamaConfig:
        """From a Hugging Face ``config.json`` dict (Llama's keys).

        Raises:
            ValueError: a required key is missing.
        """
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads"):
            if k not in cfg:
                raise ValueError(f"load_safetensors: config.json has no {k!r}")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos_v: Any = cfg.get("eos_token_id")
        extra: tuple[int, ...] = ()
        if isinstance(eos_v, list):
            eos_l: list[Any] = eos_v
            eos_v, extra = (eos_l[0] if eos_l else None), tuple(int(e) for e in eos_l[1:])
        eos = eos_v
        bos = cfg.get("bos_token_id")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=None if eos is None else int(eos),
            add_bos_token=False,
            architecture=architecture,
            name=str(cfg.get("_name_or_path", architecture)),
            extra_eos_ids=extra,
        )


def unpermute_qk(w: Any, n_head: int) -> Any:
    """Undo llama.cpp's q/k row permutation: back to Hugging Face's rotate-half order (a
    float array, or a :class:`~deviceops.nn.models.quantized.QuantArray`: its rows of blocks moved)."""
    rows, cols = w.shape
    if rows % (2 * n_head):
        raise ValueError(f"load_gguf: q/k weight of {rows} rows cannot hold {n_head} heads of "
                         "an even head_dim")
    if isinstance(w, QuantArray):
        perm = np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(rows)
        return w.rows(perm)
    return np.ascontiguousarray(w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2)
                                .reshape(rows, cols))


@dataclass
class LlamaLayer:
    """One decoder layer's device modules (QKV and gate/up fused)."""

    norm1: RMSNorm
    attn: RotaryAttention
    norm2: RMSNorm
    mlp: SwiGLU


_GGUF_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")


class Llama(Architecture):
    """The Llama architecture (module docstring)."""

    name = "llama"
    gguf_names = ("llama",)
    hf_names: ClassVar[tuple[str, ...]] = ("LlamaForCausalLM",)
    #: The config dataclass (a variant with more hyper-parameters subclasses LlamaConfig).
    config_class: ClassVar[type[LlamaConfig]] = LlamaConfig
    #: llama.cpp block tensor -> Hugging Face module (``blk.{i}.attn_q`` -> ``...q_proj``).
    gguf_blocks: ClassVar[Mapping[str, str]] = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }

    # -- checkpoints ------------------------------------------------------------------------
    def config_from_gguf(self, meta: Mapping[str, Any], *, vocab_size: int | None,
                         tensors: set[str]) -> LlamaConfig:
        cfg = self.config_class.from_gguf_fields(meta, vocab_size=vocab_size,
                                                 architecture=self.name)
        if "output.weight" in tensors:  # no output.weight: the LM head is token_embd
            cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
        return cfg

    def config_from_hf(self, cfg: Mapping[str, Any]) -> LlamaConfig:
        return self.config_class.from_hf(cfg, architecture=self.name)

    def weight_shapes(self, cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
        h, f = cfg.hidden_size, cfg.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (cfg.vocab_size, h),
            "model.norm.weight": (h,),
        }
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            shapes |= {
                p + "self_attn.q_proj.weight": (cfg.q_size, h),
                p + "self_attn.k_proj.weight": (cfg.kv_size, h),
                p + "self_attn.v_proj.weight": (cfg.kv_size, h),
                p + "self_attn.o_proj.weight": (h, cfg.q_size),
                p + "mlp.gate_proj.weight": (f, h),
                p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        if not cfg.tie_word_embeddings:
            shapes["lm_head.weight"] = (cfg.vocab_size, h)
        return shapes

    def hf_name(self, gguf_name: str) -> str | None:
        if gguf_name == "token_embd.weight":
            return "model.embed_tokens.weight"
        if gguf_name == "output_norm.weight":
            return "model.norm.weight"
        if gguf_name == "output.weight":
            return "lm_head.weight"
        m = _GGUF_BLOCK.match(gguf_name)
        if m and m.group(2) in self.gguf_blocks:
            return f"model.layers.{m.group(1)}.{self.gguf_blocks[m.group(2)]}.weight"
        return None  # e.g. rope_freqs: not needed (RoPE is computed)

    def from_gguf(self, hf_name: str, array: Any, cfg: LlamaConfig) -> Any:
        # llama.cpp stores q/k rows permuted for its RoPE kernel (pairs interleaved per head)
        if hf_name.endswith("self_attn.q_proj.weight"):
            return unpermute_qk(array, cfg.num_heads)
        if hf_name.endswith("self_attn.k_proj.weight"):
            return unpermute_qk(array, cfg.num_kv_heads)
        return array

    # -- device -----------------------------------------------------------------------------
    def bind(self, cfg: LlamaConfig, weights: Mapping[str, Any], upload: Upload) -> Weights:
        """Upload the weights: QKV and gate/up fused (``(N, K)``, used through ``gemm(...,
        trans_b=True)``), each with its bias when :meth:`weight_shapes` lists one; the LM
        head shares the embedding table with ``tie_word_embeddings``.

        Quantized matrices (:class:`~deviceops.nn.models.quantized.QuantArray`, ``weights="native"``)
        become :class:`~deviceops.nn.layers.QuantLinear` s (a fused group whose parts differ
        in format keeps one part per format run: Qwen2.5's Q5_0 q/k and Q8_0 v) and a
        :class:`~deviceops.nn.layers.QuantEmbedding` (the tied LM head reads the same packed
        table); a fused group mixing quantized and float parts is dequantized."""
        shapes = self.weight_shapes(cfg)
        tensors: list[Tensor] = []
        quantized: list[QuantLinear] = []

        def up(a: np.ndarray) -> Tensor:
            t = upload(a)
            tensors.append(t)
            return t

        def dense(a: Any) -> np.ndarray:
            return a.dequantize() if isinstance(a, QuantArray) else a

        def linear(*modules: str) -> Linear | QuantLinear:
            ws = [weights[m + ".weight"] for m in modules]
            biased = [m + ".bias" in shapes for m in modules]
            if any(biased) and not all(biased):
                raise ValueError(f"{self.name}: fused {modules} have biases on some parts only")
            bs = [weights[m + ".bias"] for m in modules] if all(biased) else None
            if all(isinstance(w, QuantArray) for w in ws):
                return quant_linear(ws, bs)
            w = np.concatenate([dense(w) for w in ws], axis=0)
            b = None if bs is None else np.concatenate(bs)
            return Linear(up(w), None if b is None else up(b))

        def quant_linear(ws: list[Any], bs: list[np.ndarray] | None) -> QuantLinear:
            # consecutive parts of one format are stacked into one packed weight
            groups: list[list[int]] = []
            for i, w in enumerate(ws):
                if groups and ws[groups[-1][0]].fmt == w.fmt:
                    groups[-1].append(i)
                else:
                    groups.append([i])
            parts, row0 = [], 0
            for g in groups:
                qa = QuantArray.concat([ws[i] for i in g])
                pb = None if bs is None else up(np.concatenate([bs[i] for i in g]))
                parts.append(QuantPart(up(qa.packed()), qa.fmt, pb, row0))
                row0 += qa.shape[0]
            fused_b = None
            if bs is not None:
                fused_b = parts[0].bias if len(parts) == 1 else up(np.concatenate(bs))
            ql = QuantLinear(parts, ws[0].shape[1], fused_b)
            quantized.append(ql)
            return ql

        eps = cfg.rms_norm_eps
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
            if isinstance(lm_head, QuantLinear):  # (no prefill scratch for the LM head: see QuantLinear)
                quantized.remove(lm_head)
        norm = RMSNorm(up(weights["model.norm.weight"]), eps)
        layers: list[Any] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            attn = RotaryAttention(
                linear(p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"),
                linear(p + "self_attn.o_proj"), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                cfg.rope_theta)
            mlp = SwiGLU(linear(p + "mlp.gate_proj", p + "mlp.up_proj"), linear(p + "mlp.down_proj"))
            layers.append(LlamaLayer(RMSNorm(up(weights[p + "input_layernorm.weight"]), eps), attn,
                                     RMSNorm(up(weights[p + "post_attention_layernorm.weight"]), eps),
                                     mlp))
        scratch = None
        if quantized:  # prefill's dequantized matrix (the LM head's excepted: see QuantLinear)
            size = max(ql.out_features * ql.in_features for ql in quantized)
            scratch = upload(np.zeros(size, np.float32))
            for ql in quantized:
                ql.scratch = scratch
        return Weights(embed, lm_head, norm, layers, tensors, scratch=scratch,
                       quantized=isinstance(embed, QuantEmbedding) or bool(quantized))

    # -- forward ----------------------------------------------------------------------------
    def layer_ops(self, layer: LlamaLayer, io: LayerIO) -> list[Thunk]:
        """Pre-norm residual block. The residual add of the previous layer's MLP output
        (``down``) is fused into this layer's first norm (layer 0 norms the embedding);
        the last layer's is fused into :meth:`final_norm_ops`."""
        vw = io.views
        resid, normed, o, down = vw["resid"], vw["normed"], vw["o"], vw["down"]
        th: list[Thunk] = []
        if io.index == 0:
            th.append(lambda: layer.norm1(resid, normed))
        else:
            th.append(lambda: layer.norm1.add_norm(down, resid, normed))
        th += layer.attn.ops(normed, io.k_cache, io.v_cache, io.start, io.kv_len, vw["attn"], o,
                             block_table=io.table, fresh_kv=io.fresh_kv)
        th.append(lambda: layer.norm2.add_norm(o, resid, normed))
        th += layer.mlp.ops(normed, vw["gu"], vw["act"], down)
        return th

    def final_norm_ops(self, w: Weights, down: Tensor, resid: Tensor, normed: Tensor) -> list[Thunk]:
        return [lambda: w.norm.add_norm(down, resid, normed)]
