"""BERT, the encoder architecture (all-MiniLM-L6-v2 and the other sentence-transformers BERTs).

The Hugging Face ``BertModel`` forward, post-norm, for ``B`` rows of ``L`` tokens (right
padded; row ``b`` has ``lens[b]`` real tokens):

| step | computes | kernels |
|---|---|---|
| embeddings | ``LN(word[ids] + (position + token_type[0])[pos])`` | ``embedding`` x2, ``add``, ``layer_norm`` |
| attention | ``x = LN(x + O(attn(split(QKV x))))``, each query over the first ``lens[b]`` keys of its row (the key-padding mask), no causal mask | ``gemm``, ``split_qkv``, ``flash_attention(causal=False, kv_len=lens)``, ``merge_heads``, ``gemm(beta=1)``, ``layer_norm`` |
| MLP | ``x = LN(x + down(gelu(up x)))``, GELU as the config's ``hidden_act`` (``"gelu"``: exact, erf) | ``gemm(activation=...)``, ``gemm(beta=1)``, ``layer_norm`` |

The residual adds are the GEMM epilogue's ``beta=1`` (the output is the residual stream).
Every sentence is one segment: ``token_type_ids`` are 0, so the token-type row 0 is folded
into the position table when the weights are bound. Q, K and V are fused into one
projection (``(3 H, H)``, q rows first). The pooler (``pooler.dense``) is not used:
sentence embeddings pool the last hidden states (:mod:`deviceops.nn.encoder`).

Weights are read by their Hugging Face names (``embeddings.word_embeddings.weight``,
``encoder.layer.0.attention.self.query.weight`` ...; a ``bert.`` prefix is accepted).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import deviceops.kernels as kernels
from deviceops import DeviceOp, Tensor

from ..layers import Embedding, LayerNorm, Linear

__all__ = ["BertBuffers", "BertConfig", "BertLayer", "BertWeights", "bind", "config_from_hf",
           "encoder_ops", "hf_weights", "weight_shapes"]

Thunk = Callable[[], DeviceOp[Any]]
#: Uploads a float32 host array to the model's device in its dtype (synchronizing).
Upload = Callable[[np.ndarray], Tensor]

#: Hugging Face ``hidden_act`` -> the GEMM epilogue's activation
_ACTIVATIONS = {"gelu": "gelu_erf", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu",
                "relu": "relu"}


@dataclass(frozen=True)
class BertConfig:
    """A BERT encoder's hyper-parameters (Hugging Face ``BertConfig`` names, shortened).

    Attributes:
        vocab_size, hidden_size, num_layers, num_heads, intermediate_size: the shapes.
        max_position_embeddings: positions the model has (the longest input).
        type_vocab_size: token-type rows (only row 0 is used).
        layer_norm_eps: every LayerNorm's epsilon.
        activation: the MLP's activation as the GEMM epilogue names it (``"gelu_erf"`` for
            Hugging Face's ``"gelu"``).
        pad_token_id: the id padding positions hold (masked out; any id would do).
        name: a label for messages.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    activation: str = "gelu_erf"
    pad_token_id: int = 0
    name: str = "bert"

    def __post_init__(self) -> None:
        for k in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                  "max_position_embeddings", "type_vocab_size"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"BertConfig: {k}={v!r} must be a positive int")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"BertConfig: hidden_size {self.hidden_size} is not a multiple of "
                             f"num_heads {self.num_heads}")
        if self.head_dim % 8 or self.head_dim > 256:
            raise ValueError(f"BertConfig: head_dim {self.head_dim} (hidden_size / num_heads) must "
                             "be a multiple of 8 up to 256 (flash_attention's head sizes)")
        if self.activation not in _ACTIVATIONS.values():
            raise ValueError(f"BertConfig: activation {self.activation!r} is not one of "
                             f"{sorted(set(_ACTIVATIONS.values()))}")

    @property
    def head_dim(self) -> int:
        """``hidden_size // num_heads``."""
        return self.hidden_size // self.num_heads


def config_from_hf(cfg: Mapping[str, Any], *, source: str = "config.json") -> BertConfig:
    """The config of a Hugging Face ``config.json`` dict of ``model_type`` ``"bert"``.

    Raises:
        ValueError: another model type, a missing key, an activation or position embedding
            type this module does not run (the message names it and the supported ones).
    """
    mt = cfg.get("model_type")
    if mt != "bert":
        raise ValueError(f"load_encoder: {source} has model_type {mt!r}; deviceops.nn runs BERT "
                         "encoders (model_type 'bert')")
    act = cfg.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"load_encoder: {source}: hidden_act {act!r} is not supported "
                         f"(supported: {', '.join(sorted(_ACTIVATIONS))})")
    pos = cfg.get("position_embedding_type", "absolute")
    if pos != "absolute":
        raise ValueError(f"load_encoder: {source}: position_embedding_type {pos!r} is not supported "
                         "(only 'absolute')")
    try:
        return BertConfig(
            vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]), num_heads=int(cfg["num_attention_heads"]),
            intermediate_size=int(cfg["intermediate_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 512)),
            type_vocab_size=int(cfg.get("type_vocab_size", 2)),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
            activation=_ACTIVATIONS[act], pad_token_id=int(cfg.get("pad_token_id") or 0),
            name=str(cfg.get("_name_or_path") or "bert"))
    except KeyError as exc:
        raise ValueError(f"load_encoder: {source} lacks {exc.args[0]!r}, which a BERT config "
                         "needs") from None


def weight_shapes(cfg: BertConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the encoder needs, by Hugging Face name, and its shape."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    out: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (cfg.vocab_size, h),
        "embeddings.position_embeddings.weight": (cfg.max_position_embeddings, h),
        "embeddings.token_type_embeddings.weight": (cfg.type_vocab_size, h),
        "embeddings.LayerNorm.weight": (h,),
        "embeddings.LayerNorm.bias": (h,),
    }
    for i in range(cfg.num_layers):
        p = f"encoder.layer.{i}."
        for m in ("query", "key", "value"):
            out[f"{p}attention.self.{m}.weight"] = (h, h)
            out[f"{p}attention.self.{m}.bias"] = (h,)
        out |= {
            f"{p}attention.output.dense.weight": (h, h),
            f"{p}attention.output.dense.bias": (h,),
            f"{p}attention.output.LayerNorm.weight": (h,),
            f"{p}attention.output.LayerNorm.bias": (h,),
            f"{p}intermediate.dense.weight": (f, h),
            f"{p}intermediate.dense.bias": (f,),
            f"{p}output.dense.weight": (h, f),
            f"{p}output.dense.bias": (h,),
            f"{p}output.LayerNorm.weight": (h,),
            f"{p}output.LayerNorm.bias": (h,),
        }
    return out


def hf_weights(cfg: BertConfig, weights: Mapping[str, np.ndarray], source: str
               ) -> dict[str, np.ndarray]:
    """The weights :func:`bind` needs, by their names without a ``bert.`` prefix, checked.

    Raises:
        ValueError: a missing weight or a shape that does not fit ``cfg`` (named).
    """
    named = {(k[5:] if k.startswith("bert.") else k): v for k, v in weights.items()}
    want = weight_shapes(cfg)
    missing = [k for k in want if k not in named]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ValueError(f"load_encoder: {source} lacks weights {missing[:3]}{more} that a "
                         f"{cfg.num_layers}-layer BERT needs")
    for k, shape in want.items():
        if tuple(named[k].shape) != shape:
            raise ValueError(f"load_encoder: {source}: weight {k!r} has shape "
                             f"{tuple(named[k].shape)} but the config (hidden {cfg.hidden_size}, "
                             f"heads {cfg.num_heads}, ffn {cfg.intermediate_size}, vocab "
                             f"{cfg.vocab_size}) needs {shape}")
    return {k: named[k] for k in want}


@dataclass
class BertLayer:
    """One encoder layer's modules: fused QKV, attention output, its norm, the MLP, its norm."""

    qkv: Linear
    o: Linear
    attn_norm: LayerNorm
    up: Linear
    down: Linear
    out_norm: LayerNorm


@dataclass
class BertWeights:
    """The encoder's device modules.

    Attributes:
        word: the token embedding ``(V, H)``.
        position: position embeddings with token-type row 0 added ``(P, H)``.
        embed_norm: the embeddings' LayerNorm.
        layers: one :class:`BertLayer` per layer.
        tensors: every device tensor uploaded, each once.
    """

    word: Embedding
    position: Embedding
    embed_norm: LayerNorm
    layers: list[BertLayer]
    tensors: list[Tensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes of the device weights."""
        return sum(t.nbytes for t in self.tensors)


def bind(cfg: BertConfig, weights: Mapping[str, np.ndarray], upload: Upload) -> BertWeights:
    """The device modules from float32 host arrays by Hugging Face name (as
    :func:`hf_weights` returns them)."""
    tensors: list[Tensor] = []

    def up(a: np.ndarray) -> Tensor:
        t = upload(np.ascontiguousarray(a, dtype=np.float32))
        tensors.append(t)
        return t

    def norm(prefix: str) -> LayerNorm:
        return LayerNorm(up(weights[f"{prefix}.weight"]), up(weights[f"{prefix}.bias"]),
                         cfg.layer_norm_eps)

    def linear(prefix: str) -> Linear:
        return Linear(up(weights[f"{prefix}.weight"]), up(weights[f"{prefix}.bias"]))

    word = Embedding(up(weights["embeddings.word_embeddings.weight"]))
    pos = (np.asarray(weights["embeddings.position_embeddings.weight"], np.float64)
           + np.asarray(weights["embeddings.token_type_embeddings.weight"][0], np.float64))
    position = Embedding(up(pos))
    layers = []
    for i in range(cfg.num_layers):
        p = f"encoder.layer.{i}."
        s = f"{p}attention.self."
        qkv_w = np.concatenate([weights[f"{s}{m}.weight"] for m in ("query", "key", "value")])
        qkv_b = np.concatenate([weights[f"{s}{m}.bias"] for m in ("query", "key", "value")])
        layers.append(BertLayer(
            qkv=Linear(up(qkv_w), up(qkv_b)), o=linear(f"{p}attention.output.dense"),
            attn_norm=norm(f"{p}attention.output.LayerNorm"), up=linear(f"{p}intermediate.dense"),
            down=linear(f"{p}output.dense"), out_norm=norm(f"{p}output.LayerNorm")))
    return BertWeights(word, position, norm("embeddings.LayerNorm"), layers, tensors)


@dataclass
class BertBuffers:
    """The views one forward of ``B`` rows of ``L`` tokens reads and writes (``N = B L``).

    Attributes:
        ids, pos: int32 ``(N,)`` token ids and positions (``0 .. L-1`` per row).
        lens: int32 ``(B,)`` real tokens per row (the keys attention sees).
        x: ``(N, H)`` the residual stream: the output (the last hidden states).
        emb: ``(N, H)`` the position embeddings' gather.
        qkv: ``(N, 3H)``; q, k, v, att: ``(B, heads, L, D)``; merged: ``(N, H)``.
        ffn: ``(N, F)`` the MLP's activation.
    """

    ids: Tensor
    pos: Tensor
    lens: Tensor
    x: Tensor
    emb: Tensor
    qkv: Tensor
    q: Tensor
    k: Tensor
    v: Tensor
    att: Tensor
    merged: Tensor
    ffn: Tensor


def encoder_ops(cfg: BertConfig, w: BertWeights, buf: BertBuffers) -> list[Thunk]:
    """Thunks of the whole encoder (module docstring): ``buf.ids``/``pos``/``lens`` in, the
    last hidden states in ``buf.x``."""
    b, heads, length, _ = buf.q.shape
    n, h = b * length, cfg.hidden_size
    x, qkv3, merged3 = buf.x, buf.qkv.reshape(b, length, 3 * h), buf.merged.reshape(b, length, h)
    th: list[Thunk] = [
        lambda: w.word(buf.ids, x),
        lambda: w.position(buf.pos, buf.emb),
        lambda: kernels.add(x, buf.emb, out=buf.emb),
        lambda: w.embed_norm(buf.emb, x),
    ]
    for layer in w.layers:
        th += _layer_ops(cfg, layer, buf, x, qkv3, merged3, heads)
    assert x.shape == (n, h)
    return th


def _layer_ops(cfg: BertConfig, ly: BertLayer, buf: BertBuffers, x: Tensor, qkv3: Tensor,
               merged3: Tensor, heads: int) -> list[Thunk]:
    return [
        lambda: ly.qkv(x, buf.qkv),
        lambda: kernels.split_qkv(qkv3, n_heads=heads, q_out=buf.q, k_out=buf.k, v_out=buf.v),
        lambda: kernels.flash_attention(buf.q, buf.k, buf.v, causal=False, kv_len=buf.lens,
                                        out=buf.att),
        lambda: kernels.merge_heads(buf.att, out=merged3),
        # x += merged @ O^T + b: the residual add in the GEMM epilogue (beta = 1)
        lambda: kernels.gemm(buf.merged, ly.o.weight, out=x, bias=ly.o.bias, beta=1.0,
                             trans_b=True),
        lambda: ly.attn_norm(x, x),
        lambda: kernels.gemm(x, ly.up.weight, out=buf.ffn, bias=ly.up.bias,
                             activation=cfg.activation, trans_b=True),
        lambda: kernels.gemm(buf.ffn, ly.down.weight, out=x, bias=ly.down.bias, beta=1.0,
                             trans_b=True),
        lambda: ly.out_norm(x, x),
    ]
