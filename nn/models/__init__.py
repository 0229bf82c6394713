"""Architectures, one module each, behind a registry keyed by the checkpoint's architecture.

A key is what a checkpoint says it is: GGUF ``general.architecture`` (``"llama"``), a
Hugging Face ``config.json`` ``architectures`` entry (``"LlamaForCausalLM"``) or its
``model_type``, and the architecture's own name, which its config carries
(``LlamaConfig.architecture``). :func:`deviceops.nn.load_gguf`,
:func:`~deviceops.nn.load_safetensors`, :func:`~deviceops.nn.random_model` and
:class:`~deviceops.nn.CausalLM` pick the architecture with :func:`get`; an unknown key is
refused naming the registered ones.

What a module provides is :class:`~.base.Architecture` (:mod:`.base`). Registered:

| module | name | GGUF | Hugging Face |
|---|---|---|---|
| :mod:`.llama` | ``llama`` | ``llama`` | ``LlamaForCausalLM`` |
| :mod:`.qwen2` | ``qwen2`` | ``qwen2`` | ``Qwen2ForCausalLM`` |
| :mod:`.gemma3` | ``gemma3`` | ``gemma3`` | ``Gemma3ForCausalLM`` (``gemma3_text``) |

A new architecture is one module and one :func:`register` line below (or, outside the
package, one :func:`register` call).

The encoder architecture, :mod:`.bert` (BERT: sentence embeddings), is not in this registry
of decoders: :func:`deviceops.nn.load_encoder` reads its folders and
:class:`deviceops.nn.Encoder` runs it.
"""

from __future__ import annotations

from .base import Architecture, LayerIO, Weights
from .gemma3 import Gemma3, Gemma3Config
from .llama import Llama, LlamaConfig
from .qwen2 import Qwen2

__all__ = ["Architecture", "Gemma3", "Gemma3Config", "LayerIO", "Llama", "LlamaConfig", "Qwen2",
           "Weights", "get", "register", "registered", "unregister"]

_REGISTRY: dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    """Register ``arch`` under its name, GGUF names and Hugging Face names; returns it.

    Raises:
        ValueError: ``arch`` has no name, or one of its keys belongs to another architecture.
    """
    if not arch.name:
        raise ValueError(f"register: {type(arch).__name__} has no name")
    keys = dict.fromkeys([arch.name, *arch.gguf_names, *arch.hf_names])
    taken = [k for k in keys if k in _REGISTRY and _REGISTRY[k] is not arch]
    if taken:
        raise ValueError(f"register: {', '.join(map(repr, taken))} already name "
                         f"{_REGISTRY[taken[0]]!r}; unregister it first")
    for k in keys:
        _REGISTRY[k] = arch
    return arch


def unregister(arch: Architecture) -> None:
    """Remove every key of ``arch`` (no-op for keys it does not hold)."""
    for k in [k for k, v in _REGISTRY.items() if v is arch]:
        del _REGISTRY[k]


def registered() -> list[str]:
    """Every registered key, sorted."""
    return sorted(_REGISTRY)


def get(key: str, *, what: str = "deviceops.nn", kind: str = "architecture") -> Architecture:
    """The architecture registered under ``key``.

    Args:
        key: a checkpoint's architecture string (or an architecture's name).
        what: the caller, named in the error (``"load_gguf"``).
        kind: what ``key`` is, named in the error (``"architecture"``, ``"model_type"``).

    Raises:
        ValueError: no architecture is registered under ``key``; the message lists those that are.
    """
    arch = _REGISTRY.get(str(key))
    if arch is None:
        raise ValueError(f"{what}: unsupported {kind} {key!r}; deviceops.nn runs the registered "
                         f"architectures: {', '.join(registered())} (deviceops.nn.models.register "
                         "adds one)")
    return arch


register(Llama())
register(Qwen2())
register(Gemma3())
