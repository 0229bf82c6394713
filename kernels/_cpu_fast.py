"""The ``cpu`` backend's kernel paths: float32 math on NumPy and its BLAS.

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
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np

from ._cpu_blas import BlasThreads, blas
from ._gemm_reference import _act_np, gemm_reference

__all__ = [
    "BlasThreads",
    "WeightCache",
    "activation_cpu",
    "add_rms_norm_cpu",
    "attention_cpu",
    "blas",
    "clear_weight_cache",
    "f32",
    "gemm_cpu",
    "layer_norm_cpu",
    "reference_mode",
    "rms_norm_cpu",
    "rope_cpu",
    "rope_kv_write_cpu",
    "swiglu_cpu",
    "use_reference",
    "weight_cache",
]

_F32 = np.dtype(np.float32)


def _env_mode() -> bool:
    v = os.environ.get("DEVICEOPS_CPU_KERNELS", "fast").strip().lower()
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

    def get(self, storage: Any, token: Any, array: np.ndarray) -> np.ndarray:
        """The float32 copy of ``array`` (a view of ``storage`` last written at ``token``).

        ``token`` is the storage's write count (``Storage.ver``) when the reading task runs;
        ``False`` means "do not cache" (a copy is made and dropped), as does a ``storage`` of
        ``None`` (gone).
        """
        if (storage is None or token is False or self.limit <= 0
                or array.nbytes * 2 > self.limit):
            return array.astype(_F32)
        key = (id(storage), array.__array_interface__["data"][0], array.shape, array.strides)
        with self._lock:
            got = self._entries.get(key)
            if got is not None and got[0]() is storage and got[1] == token:
                self._entries.move_to_end(key)
                self.hits += 1
                return got[2]
            self.misses += 1
        copy = array.astype(_F32)
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
    raw = os.environ.get("DEVICEOPS_CPU_WEIGHT_CACHE_MB", "1024")
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




_SKINNY_ROWS = 64


def _skinny_trans_b(a2: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``a2 @ w.T`` for a few rows (2 ≤ M ≤ 64) of ``a2`` ``(M, K)`` and a weight ``w``
    ``(N, K)``, float32. OpenBLAS's GEMM with a handful of rows is 2-6x slower than its
    GEMV per byte of weight (measured, K = 576..1536, N = 576..49152), so: two GEMVs for
    M = 2, else the product with the operands swapped, ``(w @ a2.T).T`` (the weight as
    the long side), which reads the weight once at near-GEMV speed."""
    m = a2.shape[0]
    if m <= 2:
        out = np.empty((m, w.shape[0]), _F32)
        for i in range(m):
            blas.matmul(w, a2[i], out=out[i])
        return out
    return blas.matmul(w, a2.T).T


def gemm_cpu(a: np.ndarray, b: np.ndarray, out: np.ndarray, *, bias: np.ndarray | None,
             activation: str | None, alpha: float, beta: float, tf32: bool, trans_b: bool,
             b32: np.ndarray | None = None) -> None:
    """``out = act(alpha * a @ b + beta * out + bias)`` in float32 through BLAS.

    Same semantics as :func:`._gemm_reference.gemm_reference` (which runs for ``tf32``).

    Args:
        a, b, out, bias: the operands (shapes as :func:`deviceops.kernels.gemm`).
        activation, alpha, beta, tf32, trans_b: as :func:`deviceops.kernels.gemm`.
        b32: ``b`` already widened to float32 (a cached weight copy), or ``None``.
    """
    if tf32:
        out[...] = gemm_reference(a, b, bias=bias, activation=activation, alpha=alpha,
                                  beta=beta, c=out if beta != 0.0 else None, tf32=True,
                                  trans_b=trans_b)
        return
    bb = f32(b) if b32 is None else b32
    aa = f32(a)
    plain = (out.dtype == _F32 and alpha == 1.0 and beta == 0.0 and bias is None
             and activation is None)
    rows = aa.size // aa.shape[-1] if aa.shape[-1] else 0
    if trans_b and bb.ndim == 2 and 2 <= rows <= _SKINNY_ROWS:
        v = _skinny_trans_b(aa.reshape(rows, aa.shape[-1]), bb).reshape(out.shape)
        if plain:
            out[...] = v
            return
    else:
        if trans_b:
            bb = np.swapaxes(bb, -1, -2)
        if plain:
            blas.matmul(aa, bb, out=out)
            return
        v = blas.matmul(aa, bb)
    if alpha != 1.0:
        v *= np.float32(alpha)
    if beta != 0.0:
        v += np.float32(beta) * f32(out)
    if bias is not None:
        v += f32(bias)
    out[...] = _act_np(v, activation)


# ----------------------------------------------------------------------------- norms


def _rms(s32: np.ndarray, w32: np.ndarray, eps: float) -> np.ndarray:
    d = s32.shape[-1]
    ms = np.add.reduce(np.square(s32), axis=-1, keepdims=True)  # (pairwise summation)
    ms *= np.float32(1.0 / d) if d else np.float32(0.0)
    ms += np.float32(eps)
    np.sqrt(ms, out=ms)
    y = s32 / ms
    y *= w32
    return y


def rms_norm_cpu(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> None:
    """``out = x / sqrt(mean(x**2, -1) + eps) * weight`` in float32."""
    out[...] = _rms(f32(x), f32(weight), eps)


def add_rms_norm_cpu(x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: float,
                     out: np.ndarray, residual_out: np.ndarray) -> None:
    """``residual_out = x + residual`` (rounded to the dtype), ``out = rms_norm(it) * weight``.

    ``out`` may be ``x`` and ``residual_out`` may be ``residual`` or ``x`` (both results are
    computed before either is written).
    """
    s = np.add(f32(x), f32(residual))
    if x.dtype != _F32:
        s = s.astype(x.dtype).astype(_F32)  # the stored sum, rounded once
    y = _rms(s, f32(weight), eps)
    residual_out[...] = s
    out[...] = y


def layer_norm_cpu(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, eps: float,
                   out: np.ndarray) -> None:
    """Layer norm over the last dim (biased variance) in float32."""
    x32 = f32(x)
    mean = x32.mean(axis=-1, keepdims=True)
    c = x32 - mean
    var = np.square(c).mean(axis=-1, keepdims=True)
    y = c / np.sqrt(var + np.float32(eps)) * f32(weight)
    if bias is not None:
        y += f32(bias)
    out[...] = y


# ----------------------------------------------------------------------------- activations


def _silu32(g: np.ndarray) -> np.ndarray:
    return g * np.float32(0.5) * (np.float32(1.0) + np.tanh(np.float32(0.5) * g))  # overflow-free


def swiglu_cpu(gate_up: np.ndarray, out: np.ndarray) -> None:
    """``out = silu(g) * u`` of the halves of the last dim, in float32."""
    f = gate_up.shape[-1] // 2
    g, u = f32(gate_up[..., :f]), f32(gate_up[..., f:])
    out[...] = _silu32(g) * u


def activation_cpu(kind: str, x: np.ndarray, out: np.ndarray) -> None:
    """``out = gelu(x)`` (tanh approximation), ``silu(x)`` or ``softmax(x)`` (last dim), float32."""
    x32 = f32(x)
    if kind == "softmax":
        e = np.exp(x32 - x32.max(axis=-1, keepdims=True))
        out[...] = e / e.sum(axis=-1, keepdims=True)
    elif kind == "silu":
        out[...] = _silu32(x32)
    else:
        out[...] = _act_np(x32, kind)


# ----------------------------------------------------------------------------- rope


_inv_freq: dict[tuple[int, float], np.ndarray] = {}


def _cos_sin32(pos: np.ndarray, d: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """``cos`` and ``sin`` of the angles ``pos * theta**(-2j/d)`` (computed in float64)."""
    f = _inv_freq.get((d, theta))
    if f is None:
        j = np.arange(d // 2, dtype=np.float64)
        f = _inv_freq[(d, theta)] = float(theta) ** (-2.0 * j / d)
    a = pos.astype(np.float64)[..., None] * f
    return np.cos(a).astype(_F32), np.sin(a).astype(_F32)


def _rotate32(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Llama's rotate-half RoPE of ``x`` (float32): ``[x1 c - x2 s, x2 c + x1 s]``."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    out = np.empty(x.shape, _F32)
    lo, hi = out[..., :h], out[..., h:]
    np.multiply(x1, cos, out=lo)
    lo -= x2 * sin
    np.multiply(x2, cos, out=hi)
    hi += x1 * sin
    return out


def _positions(start: np.ndarray, length: int) -> np.ndarray:
    return start.astype(np.int64)[:, None] + np.arange(length, dtype=np.int64)[None, :]


def rope_cpu(x: np.ndarray, start: np.ndarray, theta: float, out: np.ndarray) -> None:
    """RoPE of ``x`` ``(B, L, H, D)`` (token ``(b, i)`` at ``start[b] + i``) in float32."""
    cos, sin = _cos_sin32(_positions(start, x.shape[1]), x.shape[-1], theta)
    out[...] = _rotate32(f32(x), cos[:, :, None], sin[:, :, None])


def rope_kv_write_cpu(qkv: np.ndarray, start: np.ndarray, k_cache: np.ndarray,
                      v_cache: np.ndarray, q_out: np.ndarray, n_heads: int, n_kv_heads: int,
                      theta: float, block_table: np.ndarray | None = None) -> None:
    """:func:`._rope_reference.rope_kv_write_reference` in float32, cache writes vectorized."""
    b_, l_, w = qkv.shape
    hq, hkv = n_heads, n_kv_heads
    d = w // (hq + 2 * hkv)
    heads = qkv.reshape(b_, l_, hq + 2 * hkv, d)
    pos = _positions(start, l_)  # (B, L)
    cos, sin = _cos_sin32(pos, d, theta)
    rot = _rotate32(f32(heads[:, :, : hq + hkv]), cos[:, :, None], sin[:, :, None])
    q_out[...] = rot[:, :, :hq].transpose(0, 2, 1, 3)
    k = rot[:, :, hq:]  # (B, L, Hkv, D)
    v = heads[:, :, hq + hkv:]
    s_len = k_cache.shape[2]
    if b_ * l_ <= 8:  # decode: a few tokens, plain indexing beats the vectorized form
        for bi_ in range(b_):
            for i_ in range(l_):
                p_ = int(pos[bi_, i_])
                if block_table is None:
                    if 0 <= p_ < s_len:
                        k_cache[bi_, :, p_] = k[bi_, i_]
                        v_cache[bi_, :, p_] = v[bi_, i_]
                    continue
                if not 0 <= p_ < block_table.shape[1] * s_len:
                    continue
                blk_ = int(block_table[bi_, p_ // s_len])
                if 0 <= blk_ < k_cache.shape[0]:
                    k_cache[blk_, :, p_ % s_len] = k[bi_, i_]
                    v_cache[blk_, :, p_ % s_len] = v[bi_, i_]
        return
    if block_table is None:
        ok = (pos >= 0) & (pos < s_len)
        bi, ii = np.nonzero(ok)
        p = pos[bi, ii]
        k_cache[bi, :, p] = k[bi, ii]
        v_cache[bi, :, p] = v[bi, ii]
        return
    ok = (pos >= 0) & (pos < block_table.shape[1] * s_len)
    bi, ii = np.nonzero(ok)
    p = pos[bi, ii]
    blk = block_table[bi, p // s_len].astype(np.int64)
    good = (blk >= 0) & (blk < k_cache.shape[0])
    bi, ii, p, blk = bi[good], ii[good], p[good], blk[good]
    k_cache[blk, :, p % s_len] = k[bi, ii]
    v_cache[blk, :, p % s_len] = v[bi, ii]


# ----------------------------------------------------------------------------- attention


def attention_cpu(q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray, *,
                  causal: bool, scale: float | None, kv_len: np.ndarray | None,
                  block_table: np.ndarray | None) -> None:
    """:func:`._attention_reference.attention_reference` in float32, one batched matmul per
    batch row (every head of a key/value head group at once). Shapes checked beforehand."""
    b, hq, lq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    sc = np.float32(1.0 / math.sqrt(d) if scale is None else scale)
    if block_table is None:
        lk = k.shape[2]
        lens = (np.full(b, lk, np.int64) if kv_len is None
                else np.clip(kv_len.astype(np.int64), 0, lk))
    else:
        assert kv_len is not None
        nb, _h, bs, _d = k.shape
        lens = np.clip(kv_len.astype(np.int64), 0, block_table.shape[1] * bs)
    for bi in range(b):
        n = int(lens[bi])
        if n == 0:
            out[bi] = 0
            continue
        if block_table is None:
            kk, vv = k[bi, :, :n], v[bi, :, :n]  # (Hkv, n, D)
        else:
            n_blk = -(-n // bs)
            ids = block_table[bi, :n_blk].astype(np.int64)
            bad = (ids < 0) | (ids >= nb)
            if bad.any():
                raise IndexError(
                    f"flash_attention: block_table[{bi}] holds block {int(ids[bad][0])}, "
                    f"outside the pool of {nb} blocks (kv_len[{bi}] = {n} reads its first "
                    f"{n_blk} entries)")
            kk = k[ids].transpose(1, 0, 2, 3).reshape(hkv, n_blk * bs, d)[:, :n]
            vv = v[ids].transpose(1, 0, 2, 3).reshape(hkv, n_blk * bs, d)[:, :n]
        qq = f32(q[bi]).reshape(hkv, g * lq, d)
        s = np.matmul(qq, f32(kk).transpose(0, 2, 1))  # (Hkv, g*Lq, n)
        s *= sc
        if causal and lq > 1:  # (with Lq = 1 every valid key is visible)
            hidden = np.arange(n)[None, :] > np.arange(lq)[:, None] + (n - lq)  # (Lq, n)
            if hidden.any():
                s.reshape(hkv, g, lq, n)[:, :, hidden] = -np.inf
        m = s.max(axis=-1, keepdims=True)
        finite = np.isfinite(m)
        if not finite.all():  # a row with every key masked (or inf scores): as the reference
            m[~finite] = 0.0
        s -= m
        np.exp(s, out=s)
        denom = np.add.reduce(s, axis=-1, keepdims=True)
        o = np.matmul(s, f32(vv))  # (Hkv, g*Lq, D)
        pos = denom > 0
        if pos.all():
            o /= denom
        else:
            np.divide(o, denom, out=o, where=pos)
            o[np.broadcast_to(~pos, o.shape)] = 0.0
        out[bi] = o.reshape(hq, lq, d)
