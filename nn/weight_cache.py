"""On-disk cache of converted GGUF weights: a second load reads NumPy files instead of
parsing and dequantizing the GGUF again.

:func:`deviceops.nn.checkpoint.read_gguf` converts a file once (metadata parsed, every
tensor dequantized, put in Hugging Face layout and cast to the target dtype), then stores
the result here; the next read of the same file for the same dtype maps the stored arrays
(``np.load(mmap_mode="r")``) and skips the conversion.

* Where: ``DEVICEOPS_WEIGHT_CACHE`` (``1``, the default: ``$XDG_CACHE_HOME/deviceops/weights``,
  else ``~/.cache/deviceops/weights``; a path: that folder; empty or ``0``: no cache).
* An entry is a folder ``<file stem>-<key>`` holding one ``.npy`` per tensor and
  ``index.json`` (the GGUF metadata, the tensor names, shapes and dtypes). The key hashes
  the file's size, modification time, first and last MiB, the dtype and this module's
  format version; ``index.json`` also records the architecture's
  :attr:`~deviceops.nn.models.base.Architecture.conversion_version`, and an entry of
  another version is rebuilt.
* Written atomically: into a temporary folder beside it, then renamed. A damaged entry
  (a truncated or missing file, a bad index) is reported with one log line, removed and
  rebuilt. Writing an entry removes older entries of the same file and dtype (the file
  changed since).
* ``tokenizers/`` in the same folder holds built Gemma SentencePiece tokenizers as
  ``tokenizers`` JSON (:func:`deviceops.nn.tokenizer.sentencepiece_cache_file`), one file per
  vocabulary and builder version, written atomically too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from deviceops import _env

__all__ = ["CacheEntry", "cache_root", "entry_dir", "load_entry", "np_dtype", "store_entry"]

log = logging.getLogger("deviceops.nn")

#: the layout of an entry; a change makes every older entry a miss (another key)
FORMAT = 1
_MIB = 1 << 20


def cache_root() -> Path | None:
    """The cache folder ``DEVICEOPS_WEIGHT_CACHE`` names (module docstring), or ``None``
    when it is off."""
    value = _env.get("DEVICEOPS_WEIGHT_CACHE")
    if value in ("", "0"):
        return None
    if value == "1":
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(base) / "deviceops" / "weights"
    return Path(value).expanduser()


def _file_key(path: Path, dtype: str) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{FORMAT}|{st.st_size}|{st.st_mtime_ns}|{dtype}|".encode())
    with open(path, "rb") as fh:
        h.update(fh.read(_MIB))
        if st.st_size > 2 * _MIB:
            fh.seek(-_MIB, os.SEEK_END)
        h.update(fh.read(_MIB))
    return h.hexdigest()[:24]


def entry_dir(root: Path, path: Path, dtype: str) -> Path:
    """The folder of ``path``'s entry for ``dtype`` under ``root`` (it may not exist)."""
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", path.name)[:80]
    return root / f"{stem}-{_file_key(path, dtype)}"


@dataclass
class CacheEntry:
    """What an entry holds: the GGUF metadata (JSON values), the file's tensor names, the
    architecture name and the converted weights by Hugging Face name (memory-mapped)."""

    meta: dict[str, Any]
    tensor_names: list[str]
    architecture: str
    weights: dict[str, np.ndarray]
    #: what the writer stored beside (``store_entry(extra=...)``; ``{}`` if nothing)
    extra: dict[str, Any] = field(default_factory=dict)


def np_dtype(name: str) -> Any:
    """The NumPy dtype of ``name`` (``bfloat16``: ml_dtypes')."""
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


class _Damaged(Exception):
    pass


def _read(d: Path, dtype: str, versions: Callable[[str], int | None]) -> CacheEntry | None:
    """The entry in ``d``; ``None`` for a stale one (another conversion version).

    Raises:
        _Damaged: a file is missing, truncated or does not match the index.
    """
    try:
        index = json.loads((d / "index.json").read_text())
    except (OSError, ValueError) as exc:
        raise _Damaged(f"index.json unreadable ({exc})") from None
    try:
        if index["format"] != FORMAT or index["dtype"] != dtype:
            raise _Damaged("index.json of another format or dtype")
        arch = str(index["architecture"])
        if versions(arch) != index["conversion_version"]:
            return None
        weights: dict[str, np.ndarray] = {}
        want: Any = np_dtype(dtype) if index["tensors"] else None
        for name, (fname, shape) in index["tensors"].items():
            try:
                a = np.load(d / fname, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as exc:
                raise _Damaged(f"{fname} unreadable ({exc})") from None
            if dtype == "bfloat16":
                a = a.view(want) if a.dtype == np.uint16 else a
            if tuple(a.shape) != tuple(shape) or a.dtype != want:
                raise _Damaged(f"{fname} holds {a.dtype} {tuple(a.shape)}, the index says "
                               f"{dtype} {tuple(shape)}")
            weights[name] = a
        return CacheEntry(dict(index["meta"]), list(index["tensor_names"]), arch, weights,
                          dict(index.get("extra") or {}))
    except (KeyError, TypeError, ValueError) as exc:
        raise _Damaged(f"index.json malformed ({exc!r})") from None


def load_entry(root: Path, path: Path, dtype: str,
               versions: Callable[[str], int | None]) -> CacheEntry | None:
    """``path``'s converted weights for ``dtype`` from ``root``, or ``None`` (a miss).

    ``versions(architecture)`` gives an architecture's current conversion version
    (``None``: not registered); an entry made by another version is removed and a miss. A
    damaged entry is logged, removed, and a miss.
    """
    d = entry_dir(root, path, dtype)
    if not d.is_dir():
        return None
    try:
        entry = _read(d, dtype, versions)
    except _Damaged as exc:
        log.warning("deviceops: the weight cache entry %s is damaged (%s); converting %s "
                    "again", d, exc, path.name)
        shutil.rmtree(d, ignore_errors=True)
        return None
    if entry is None:  # made by another conversion version: replaced by the caller's
        shutil.rmtree(d, ignore_errors=True)
    return entry


def store_entry(root: Path, path: Path, dtype: str, *, meta: Mapping[str, Any],
                tensor_names: list[str], architecture: str, conversion_version: int,
                weights: Mapping[str, np.ndarray],
                on_tensor: Callable[[], object] | None = None,
                extra: Mapping[str, Any] | None = None) -> Path:
    """Write ``path``'s converted weights for ``dtype`` under ``root`` atomically (a
    temporary folder renamed into place) and remove older entries of the same source file
    and dtype. Returns the entry's folder. ``on_tensor`` is called after each tensor is
    written (a progress bar). ``extra``: a JSON object stored in the index
    (:attr:`CacheEntry.extra`).

    Raises:
        OSError: the folder cannot be written (full disk, no permission).
        TypeError: ``meta`` holds a value JSON cannot store.
    """
    d = entry_dir(root, path, dtype)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{d.name}.", suffix=".tmp"))
    try:
        files: dict[str, tuple[str, list[int]]] = {}
        for i, (name, a) in enumerate(weights.items()):
            fname = f"{i:05d}.npy"
            arr = np.ascontiguousarray(a)
            np.save(tmp / fname, arr.view(np.uint16) if dtype == "bfloat16" else arr,
                    allow_pickle=False)
            files[name] = (fname, list(arr.shape))
            if on_tensor is not None:
                on_tensor()
        index = {"format": FORMAT, "dtype": dtype, "source": str(path.resolve()),
                 "architecture": architecture, "conversion_version": conversion_version,
                 "tensor_names": tensor_names, "tensors": files, "meta": dict(meta),
                 "extra": dict(extra or {})}
        (tmp / "index.json").write_text(json.dumps(index))
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        try:
            os.rename(tmp, d)
        except OSError:  # another process stored the same entry first (or a stale folder)
            if not (d / "index.json").is_file():
                shutil.rmtree(d, ignore_errors=True)
                os.rename(tmp, d)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _remove_older(root, d, str(path.resolve()), dtype)
    return d


def _remove_older(root: Path, keep: Path, source: str, dtype: str) -> None:
    stem = keep.name.rsplit("-", 1)[0]
    for other in root.glob(f"{stem}-*"):  # the stem has no glob characters (entry_dir)
        if other == keep or not other.is_dir():
            continue
        try:
            index = json.loads((other / "index.json").read_text())
        except (OSError, ValueError):
            continue
        if index.get("source") == source and index.get("dtype") == dtype:
            shutil.rmtree(other, ignore_errors=True)

