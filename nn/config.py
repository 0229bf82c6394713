"""LlamaConfig: the hyper-parameters of a Llama-architecture causal language model.

Read from a GGUF file's metadata (:meth:`LlamaConfig.from_gguf_fields`) or a Hugging
Face ``config.json`` (:meth:`LlamaConfig.from_hf`). SmolLM2-135M::

    LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LlamaConfig"]


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
        architecture: ``"llama"``.
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
    def from_gguf_fields(cls, meta: Mapping[str, Any], *, vocab_size: int | None = None) -> LlamaConfig:
        """From GGUF metadata (``general.architecture``, ``llama.*``, ``tokenizer.ggml.*``).

        Raises:
            ValueError: not a Llama model, or a required key is missing.
        """
        arch = str(meta.get("general.architecture", ""))
        if arch != "llama":
            raise ValueError(f"load_gguf: unsupported architecture {arch!r}: deviceops.nn runs "
                             "Llama-architecture models ('llama', e.g. SmolLM2, Llama 2/3, TinyLlama)")

        def need(key: str) -> Any:
            k = f"{arch}.{key}"
            if k not in meta:
                raise ValueError(f"load_gguf: the file's metadata has no {k!r}")
            return meta[k]

        heads = int(need("attention.head_count"))
        hidden = int(need("embedding_length"))
        vocab = meta.get(f"{arch}.vocab_size", vocab_size)
        if vocab is None:
            raise ValueError("load_gguf: the vocabulary size is unknown (no llama.vocab_size, no tokens)")
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
            tie_word_embeddings=True,  # decided by the loader (no output.weight => tied)
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=None if eos is None else int(eos),
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            architecture=arch,
            name=str(meta.get("general.name", arch)),
        )

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> LlamaConfig:
        """From a Hugging Face ``config.json`` dict (``model_type`` ``"llama"``).

        Raises:
            ValueError: not a Llama model or a required key is missing.
        """
        mt = str(cfg.get("model_type", ""))
        if mt != "llama":
            raise ValueError(f"load_safetensors: unsupported model_type {mt!r}; deviceops.nn runs "
                             "'llama' models")
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
            architecture="llama",
            name=str(cfg.get("_name_or_path", "llama")),
            extra_eos_ids=extra,
        )
