"""The ``cpu`` backend's kernel paths: float32 math on NumPy and its BLAS.

The shared half of the ``cpu`` backend's kernel paths (each family's ``_cpu.py`` holds its own):
the mode switch, float32 widening, the weight cache and :func:`act_np`.

The CUDA kernels accumulate in float32; the ``cpu`` backend computes every kernel in float32
too (float16/bfloat16 operands are widened to float32, the result rounded once to the output
dtype), through NumPy, whose ``matmul`` runs the BLAS it ships with (on one thread or all of
them, whichever measures faster while the cores are free: :class:`BlasThreads`; a GEMM of
a few rows with a transposed weight runs as the weight times the rows, at GEMV speed). The
float64 NumPy references (``gemm_reference``, ``attention_reference``, ...) stay what the
tests compare every path with, the cpu paths included.

| mode | what the ``cpu`` backend runs | chosen by |
|---|---|---|
| ``"fast"`` (default) | float32 compute, BLAS GEMMs, float32 weight copies cached | — |
| ``"reference"`` | the float64 references, as written | ``DEVICEOPS_CPU_KERNELS=reference``, :func:`use_reference` |

The mode is read when an op is enqueued (not when the worker runs it).

A GEMM's ``b`` operand (a Linear weight) in float16/bfloat16 is widened to float32 once and
the copy is kept (:class:`WeightCache`) for as long as that memory is not written again: the
copy is keyed by the storage, the view and the storage's write count (``Storage.ver``, which
the stream worker advances as each task writing the memory finishes), read when the GEMM's
task runs, so it holds in graph replays too, and any write ordered before the GEMM (a
``memcpy`` into the weight) makes it convert afresh. Copies are held weakly (they go with the
storage) and bounded in bytes (``DEVICEOPS_CPU_WEIGHT_CACHE_MB``, default 1024; 0 disables
the cache), least recently used first out. Writing into a cpu tensor's ``.array`` directly
from the host bypasses the count: call :func:`clear_weight_cache` after doing that to a GEMM
weight.
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from deviceops import _env

from ._cpu_blas import BlasThreads, blas

__all__ = ["BlasThreads", "WeightCache", "act_np", "blas", "clear_weight_cache", "erf_np", "f32", "gelu_erf_np", "reference_mode",
           "use_reference", "weight_cache"]

_F32 = np.dtype(np.float32)


def _env_mode() -> bool:
    v = _env.get("DEVICEOPS_CPU_KERNELS").lower()
    if v not in ("fast", "reference", ""):
        raise ValueError(f"DEVICEOPS_CPU_KERNELS={v!r}: use 'fast' (the default) or 'reference'")
    return v == "reference"


_reference = _env_mode()


def reference_mode() -> bool:
    """True when the ``cpu`` backend runs the float64 references instead of the float32 paths."""
    return _reference


@contextlib.contextmanager
def use_reference(on: bool = True) -> Iterator[None]:
    """Within the block, ops enqueued on the ``cpu`` backend run the float64 references
    (``on=True``) or the float32 paths (``on=False``); the previous mode comes back after.

    Process-wide (not per thread): meant for tests and for bisecting a numerical difference.
    """
    global _reference
    prev, _reference = _reference, bool(on)
    try:
        yield
    finally:
        _reference = prev


def f32(x: np.ndarray) -> np.ndarray:
    """``x`` as float32: ``x`` itself when it is float32, else a widened copy."""
    return x if x.dtype == _F32 else x.astype(_F32)


class WeightCache:
    """Float32 copies of float16/bfloat16 GEMM weights, valid until their memory is written.

    Args:
        limit_bytes: the most bytes of copies kept (least recently used dropped first).
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit = int(limit_bytes)
        self.bytes = 0
        self.hits = 0  # (diagnostics and tests)
        self.misses = 0
        self._lock = threading.Lock()
        # key -> (storage ref, token, copy); key = (id(storage), data pointer, shape, strides)
        self._entries: OrderedDict[tuple[Any, ...], tuple[Any, Any, np.ndarray]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, storage: Any, token: Any, array: np.ndarray,
            convert: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
        """The float32 copy of ``array`` (a view of ``storage`` last written at ``token``).

        ``token`` is the storage's write count (``Storage.ver``) when the reading task runs;
        ``False`` means "do not cache" (a copy is made and dropped), as does a ``storage`` of
        ``None`` (gone). ``convert`` makes the copy (default: ``astype(float32)``; the quant
        family's dequantization); one cache holds one kind of copy.
        """
        conv = convert if convert is not None else (lambda a: a.astype(_F32))
        if (storage is None or token is False or self.limit <= 0
                or array.nbytes * 2 > self.limit):
            return conv(array)
        key = (id(storage), array.__array_interface__["data"][0], array.shape, array.strides)
        with self._lock:
            got = self._entries.get(key)
            if got is not None and got[0]() is storage and got[1] == token:
                self._entries.move_to_end(key)
                self.hits += 1
                return got[2]
            self.misses += 1
        copy = conv(array)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[2].nbytes
            ref = weakref.ref(storage, self._dropper(key))
            self._entries[key] = (ref, token, copy)
            self.bytes += copy.nbytes
            while self.bytes > self.limit and self._entries:
                _k, (_r, _t, arr) = self._entries.popitem(last=False)
                self.bytes -= arr.nbytes
        return copy

    def _dropper(self, key: tuple[Any, ...]) -> Any:
        def drop(_ref: Any) -> None:
            self._drop(key)
        return drop

    def _drop(self, key: tuple[Any, ...]) -> None:
        with self._lock:
            got = self._entries.get(key)
            if got is not None and got[0]() is None:
                del self._entries[key]
                self.bytes -= got[2].nbytes

    def clear(self) -> None:
        """Drop every copy."""
        with self._lock:
            self._entries.clear()
            self.bytes = 0


def _limit_from_env() -> int:
    raw = _env.get("DEVICEOPS_CPU_WEIGHT_CACHE_MB")
    try:
        mb = float(raw)
    except ValueError:
        raise ValueError(f"DEVICEOPS_CPU_WEIGHT_CACHE_MB={raw!r} must be a number of MiB "
                         "(0 disables the cache)") from None
    return max(0, int(mb * 2**20))


weight_cache = WeightCache(_limit_from_env())


def clear_weight_cache() -> None:
    """Drop every cached float32 weight copy (after writing a weight through ``.array``)."""
    weight_cache.clear()


def act_np(v: np.ndarray, activation: str | None) -> np.ndarray:
    """The activations every backend shares (GEMM epilogue, ``gelu``/``silu``): ``None``,
    ``"relu"``, ``"gelu"`` (tanh approximation), ``"gelu_erf"`` (exact: ``0.5 x (1 +
    erf(x / sqrt 2))``, BERT's) or ``"silu"``, in ``v``'s dtype."""
    if activation == "relu":
        return np.maximum(v, 0.0)
    if activation == "gelu":
        return 0.5 * v * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3)))
    if activation == "gelu_erf":
        return gelu_erf_np(v)
    if activation == "silu":
        return v * 0.5 * (1.0 + np.tanh(0.5 * v))  # = x * sigmoid(x), overflow-free
    return v


#: Abramowitz & Stegun 7.1.26: erf(z) = 1 - t (a1 + t (a2 + ... + t a5)) exp(-z^2),
#: t = 1 / (1 + p z) for z >= 0; absolute error at most 1.5e-7 (a few float32 ulps)
_AS_P = 0.3275911
_AS_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)  # a1 .. a5
_erf64 = np.frompyfunc(math.erf, 1, 1)
_CHUNK = 16384  # elements per pass of the float32 paths (their temporaries stay in cache)


def _erfc_abs32(z: np.ndarray, t: np.ndarray, out: np.ndarray) -> None:
    """``out = 1 - erf(|z|)`` (A&S 7.1.26) for float32 ``z``; ``t`` scratch of its size;
    ``z`` is overwritten."""
    np.abs(z, out=z)
    np.multiply(z, np.float32(_AS_P), out=t)
    t += np.float32(1.0)
    np.reciprocal(t, out=t)
    np.multiply(t, np.float32(_AS_A[4]), out=out)
    for c in _AS_A[3::-1]:
        out += np.float32(c)
        out *= t
    np.multiply(z, z, out=z)
    np.negative(z, out=z)
    np.exp(z, out=z)
    out *= z


def erf_np(x: np.ndarray) -> np.ndarray:
    """``erf(x)`` elementwise in ``x``'s dtype (NumPy has none).

    float64 (the references): :func:`math.erf` of each element, exact to double precision
    and slow; other dtypes (the cpu fast path) in float32 by Abramowitz & Stegun 7.1.26,
    within 1.5e-7 of the exact value (plus float32 rounding)."""
    if x.dtype == np.float64:
        return np.asarray(_erf64(x), dtype=np.float64).reshape(x.shape)
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    out = np.empty(flat.shape, np.float32)
    z, t = np.empty(_CHUNK, np.float32), np.empty(_CHUNK, np.float32)
    for s in range(0, flat.size, _CHUNK):
        m = min(_CHUNK, flat.size - s)
        z[:m] = flat[s:s + m]
        o = out[s:s + m]
        _erfc_abs32(z[:m], t[:m], o)
        np.subtract(np.float32(1.0), o, out=o)
        np.copysign(o, flat[s:s + m], out=o)
    return out.reshape(x.shape).astype(x.dtype, copy=False)


def gelu_erf_np(v: np.ndarray) -> np.ndarray:
    """Exact GELU ``0.5 v (1 + erf(v / sqrt 2))`` in ``v``'s dtype: float64 through
    :func:`erf_np`'s exact path, other dtypes in float32, a cache-sized chunk at a time
    (``v Phi(v)`` with ``Phi = 1 - erfc / 2`` above 0 and ``erfc / 2`` below)."""
    if v.dtype == np.float64:
        return 0.5 * v * (1.0 + erf_np(v * math.sqrt(0.5)))
    flat = np.ascontiguousarray(v, dtype=np.float32).reshape(-1)
    out = np.empty(flat.shape, np.float32)
    z, t, h = (np.empty(_CHUNK, np.float32) for _ in range(3))
    r2 = np.float32(math.sqrt(0.5))
    for s in range(0, flat.size, _CHUNK):
        m = min(_CHUNK, flat.size - s)
        xs = flat[s:s + m]
        np.multiply(xs, r2, out=z[:m])
        _erfc_abs32(z[:m], t[:m], h[:m])  # 1 - erf(|x| / sqrt 2)
        h[:m] *= np.float32(0.5)
        np.subtract(np.float32(1.0), h[:m], out=t[:m])  # Phi(|x|)
        np.copyto(t[:m], h[:m], where=xs < 0)  # Phi(x) = 1 - Phi(|x|) below 0
        np.multiply(xs, t[:m], out=out[s:s + m])
    return out.reshape(v.shape).astype(v.dtype, copy=False)
