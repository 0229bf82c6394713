"""What an architecture module provides: the :class:`Architecture` interface.

An architecture is one module of :mod:`deviceops.nn.models` and one line in its registry.
It describes its checkpoints and its forward pass; the loader (:mod:`deviceops.nn.checkpoint`)
and the runner (:mod:`deviceops.nn.runner`) call only the members below, so nothing
outside the module names an architecture.

| member | says |
|---|---|
| ``name``, ``gguf_names``, ``hf_names`` | the registry keys: its own name (``config.architecture``), GGUF ``general.architecture`` values, ``config.json`` ``architectures`` entries (and ``model_type``) |
| ``config_from_gguf(meta, vocab_size=, tensors=)`` / ``config_from_hf(cfg)`` | the hyper-parameters (a :class:`~.llama.LlamaConfig` or a subclass with more fields) |
| ``weight_shapes(cfg)`` | every weight the model needs, by Hugging Face name, and its shape (optional biases and norms are listed here or not) |
| ``hf_name(gguf_name)`` / ``from_gguf(hf_name, array, cfg)`` | a GGUF tensor's Hugging Face name (``None``: not needed) and the fix-up of its layout |
| ``bind(cfg, weights, upload)`` | the device modules (:class:`Weights`) from float32 host arrays |
| ``embed_ops``, ``layer_ops``, ``final_norm_ops``, ``lm_head_ops`` | the forward as lists of thunks over the runner's buffers (:class:`LayerIO`) |

A Llama-family variant subclasses :class:`~.llama.Llama` and overrides what differs
(Qwen2: ``weight_shapes`` with q/k/v biases, which :meth:`~.llama.Llama.bind` then binds;
Gemma 3: ``layer_ops`` with q/k norms and its extra norms, ``embed_ops`` with the
embedding scale, ``bind`` for the (1 + w) norm weights).

The runner's activation buffers are the Llama-family decoder's (hidden, fused QKV, query,
attention output, fused gate/up, MLP activation; sizes from the config's ``hidden_size``,
``q_size``, ``kv_size``, ``qkv_size``, ``intermediate_size``): an architecture's ops write
into those views.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from deviceops import DeviceOp, Tensor

from ..layers import Embedding, Linear, QuantEmbedding, QuantLinear, RMSNorm

if TYPE_CHECKING:
    from .llama import LlamaConfig

__all__ = ["Architecture", "LayerIO", "Thunk", "Upload", "Weights"]

Thunk = Callable[[], DeviceOp[Any]]
#: Uploads a float32 host array to the model's device in its dtype (synchronizing); an int32
#: array (a packed quantized weight) as it is.
Upload = Callable[[np.ndarray], Tensor]


@dataclass
class Weights:
    """A model's device modules.

    Attributes:
        embed: the token embedding.
        lm_head: the output projection (the embedding's table when tied).
        norm: the final norm.
        layers: one architecture-defined record of modules per decoder layer.
        tensors: every device tensor uploaded for these weights, each once.
        scratch: the float buffer quantized layers dequantize into for prefill
            (:class:`~deviceops.nn.layers.QuantLinear`; not a weight: not in ``nbytes``).
        quantized: some matrices are kept in GGUF block formats (``weights="native"``).
    """

    embed: Embedding | QuantEmbedding
    lm_head: Linear | QuantLinear
    norm: RMSNorm
    layers: list[Any]
    tensors: list[Tensor] = field(default_factory=list)
    scratch: Tensor | None = None
    quantized: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of the device weights (a decode step reads each once)."""
        return sum(t.nbytes for t in self.tensors)


@dataclass
class LayerIO:
    """What one decoder layer's ops read and write, for ``B`` rows of ``L`` tokens.

    Attributes:
        index: the layer's index.
        views: the runner's activation views for ``(B, L)`` (``resid``, ``normed``, ``o``,
            ``gu``, ``act``, ``down`` ``(B*L, ...)``, ``attn`` the
            :class:`~deviceops.nn.layers.AttentionBuffers`); the layer's input is the
            residual stream in ``resid`` (see :meth:`Architecture.layer_ops`).
        k_cache, v_cache: the layer's KV block pools ``(num_blocks, Hkv, block_size, D)``.
        table: the rows' block-table rows ``(B, max_blocks)`` int32.
        start: int32 ``(B,)``, the position of each row's first new token.
        kv_len: int32 ``(B,)``, valid keys after the write (``start + L``).
        fresh_kv: for a prompt chunk at position 0, contiguous ``(k, v)`` buffers
            ``(B, Hkv, L, D)`` attention reads instead of the paged cache; else ``None``.
    """

    index: int
    views: dict[str, Any]
    k_cache: Tensor
    v_cache: Tensor
    table: Tensor
    start: Tensor
    kv_len: Tensor
    fresh_kv: tuple[Tensor, Tensor] | None = None


class Architecture:
    """The interface of an architecture module (module docstring). Subclass it (or
    :class:`~.llama.Llama` for a Llama-family variant) and register an instance in
    :mod:`deviceops.nn.models`."""

    #: The name a config carries (``config.architecture``) and error messages use.
    name: ClassVar[str] = ""
    #: GGUF ``general.architecture`` values this module reads.
    gguf_names: ClassVar[tuple[str, ...]] = ()
    #: Hugging Face ``config.json`` ``architectures`` entries (and ``model_type`` values).
    hf_names: ClassVar[tuple[str, ...]] = ()
    #: Bump it when :meth:`hf_name` or :meth:`from_gguf` changes what a GGUF file converts
    #: to: converted weights cached on disk (:mod:`deviceops.nn.weight_cache`) made by
    #: another version are rebuilt.
    conversion_version: ClassVar[int] = 1

    # -- checkpoints ------------------------------------------------------------------------
    def config_from_gguf(self, meta: Mapping[str, Any], *, vocab_size: int | None,
                         tensors: set[str]) -> LlamaConfig:
        """The config from GGUF metadata (``meta``), the token count when the metadata has
        no vocabulary size, and the file's tensor names (e.g. ``output.weight``: untied)."""
        raise NotImplementedError

    def config_from_hf(self, cfg: Mapping[str, Any]) -> LlamaConfig:
        """The config from a Hugging Face ``config.json`` dict."""
        raise NotImplementedError

    def weight_shapes(self, cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
        """Every weight the model needs, by Hugging Face name, and its shape."""
        raise NotImplementedError

    def hf_name(self, gguf_name: str) -> str | None:
        """The Hugging Face name of a GGUF tensor, or ``None`` for one the model does not use."""
        raise NotImplementedError

    def from_gguf(self, hf_name: str, array: Any, cfg: LlamaConfig) -> Any:
        """A dequantized GGUF tensor in the Hugging Face layout (default: as stored)."""
        return array

    # -- device -----------------------------------------------------------------------------
    def bind(self, cfg: LlamaConfig, weights: Mapping[str, Any], upload: Upload) -> Weights:
        """The device modules from float32 host arrays by Hugging Face name."""
        raise NotImplementedError

    # -- forward ----------------------------------------------------------------------------
    def embed_ops(self, w: Weights, ids: Any, out: Tensor) -> list[Thunk]:
        """Token ids (int32, or an op producing them) to the residual stream ``out``."""
        return [lambda: w.embed(ids, out)]

    def layer_ops(self, layer: Any, io: LayerIO) -> list[Thunk]:
        """One decoder layer: reads the residual stream, writes the layer's KV at
        ``io.start ..`` and leaves its output for the next layer / :meth:`final_norm_ops`."""
        raise NotImplementedError

    def final_norm_ops(self, w: Weights, down: Tensor, resid: Tensor, normed: Tensor) -> list[Thunk]:
        """The end of the residual stream (``down`` the last layer's output, ``resid`` the
        stream, rows as given) normed into ``normed``."""
        raise NotImplementedError

    def lm_head_ops(self, w: Weights, x: Tensor, logits: Tensor) -> list[Thunk]:
        """Normed hidden rows ``x`` to ``logits``."""
        return [lambda: w.lm_head(x, logits)]

    def __repr__(self) -> str:
        return f"<architecture {self.name!r}>"
