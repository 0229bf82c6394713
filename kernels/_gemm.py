"""GEMM: planning, CUDA launchers and the NumPy reference.

Semantics (every backend, every path)::

    out[..., m, n] = act(alpha * sum_k a[..., m, k] * b[(...,) k, n]
                         + beta * out_prev[..., m, n] + bias[n])

* ``a``: ``(*batch, M, K)``; ``b``: ``(K, N)`` (shared by every batch entry) or
  ``(*batch, K, N)`` with the same leading dims as ``a``; ``out``: ``(*batch, M, N)``.
  Any ``M, N, K >= 1``; every leading dim ``>= 1``. Inputs row-major C-contiguous:
  non-contiguous or transposed inputs are refused (``ShapeError``; fix: ``.copy()``).
* ``bias``: shape ``(N,)``, same dtype as ``a``, broadcast over all rows.
* ``out_prev`` is the value of ``out`` before the call; it is read only when
  ``beta != 0`` (so whatever ``out`` held, e.g. NaN, does not leak in when ``beta == 0``).
* ``act``: ``None``; ``"relu"`` ``max(x, 0)``; ``"gelu"`` the tanh approximation
  ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (torch ``approximate="tanh"``);
  ``"silu"`` ``x * sigmoid(x)``.
* dtypes: ``float16`` and ``bfloat16`` (``ml_dtypes.bfloat16``) with float32
  accumulation; ``float32`` on CUDA cores (FFMA) or, with ``tf32=True``, on tensor cores
  with operands rounded to tf32 (round to nearest, ties away). The output dtype is the
  input dtype; the epilogue runs in float32 and rounds once (round to nearest even).

CUDA paths (chosen per call by :func:`_plan`; no allocation, no synchronisation, every
launch on the ``stream`` handed in, so calls can be captured into CUDA graphs):

* ``gemm_sm90_pp`` (sm_90a): the same with a ping-pong schedule (each consumer warpgroup
  owns a 128x128 tile; one's epilogue overlaps the other's mainloop).
* ``gemm_sm90`` (sm_90a only: H100/H200): TMA (``cp.async.bulk.tensor``) + ``mbarrier``
  ring, one producer warpgroup and one or two consumer warpgroups issuing ``wgmma``
  (``setmaxnreg`` rebalances registers), persistent grid, tiles 128x256, 128x128 or
  64x128, split-K for small ``M * N``. Needs ``K % 8 == 0``, ``N % 8 == 0`` and 16-byte
  aligned base pointers (TMA strides); otherwise the sm_80 path runs.
* ``gemm_gemv`` (any sm): f16/bf16 with at most 8 rows (decode) and ``N % 8 == 0``:
  CUDA-core FMA streaming B once with 16-byte loads, no split-K round trip.
* ``gemm_sm80`` (sm_80+: A100, L4, H100, ...): ``cp.async`` 3-stage pipeline, ``ldmatrix``
  and ``mma.sync`` m16n8k16 (f16/bf16) or m16n8k8 (tf32); any shape and alignment.
* ``gemm_simt`` (any sm_70+): float32 FFMA register-tiled SGEMM (128x128x8 tiles).
* ``gemm_splitk_reduce``: sums float32 split-K partials from ``workspace`` and applies
  the epilogue.

Supported architectures: sm_90 / sm_90a (all paths, wgmma for f16/bf16), sm_80, sm_86,
sm_89 (mma.sync / SIMT paths), sm_70+ for float32 without tf32. No cuBLAS, CUTLASS,
Triton or CuPy matmul is used in any kernel path.
"""

from __future__ import annotations

import ctypes
import math
import re
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from deviceops._errors import DTypeError, ShapeError

from ._module import load_module, read_source, set_max_dynamic_smem

__all__ = [
    "ACTIVATIONS",
    "gemm_check",
    "gemm_cuda",
    "gemm_reference",
    "gemm_workspace_nbytes",
]

ACTIVATIONS: dict[str | None, int] = {None: 0, "relu": 1, "gelu": 2, "silu": 3}

# sm_90 configs: name -> (BN, NCW, STAGES); block tile is (64 * NCW) x BN.
SM90_CONFIGS: dict[str, tuple[int, int, int]] = {
    "128x256": (256, 2, 4),
    "128x128": (128, 2, 6),
    "64x128": (128, 1, 8),
    # ping-pong schedule (gemm_sm90_pp.cu): each consumer owns a whole 128x128 tile
    "pp128x128": (128, 2, 6),
}
GEMV_MAX_M = 8  # f16/bf16 with at most this many rows (per batch entry) -> gemm_gemv

# Extra -D defines for the sm_90 kernel (benchmark experiments only; empty in normal use).
SM90_EXTRA_DEFINES: tuple[str, ...] = ()
# Compile a convert-and-store-only epilogue for plain products (alpha 1, beta 0, no bias/act).
SM90_PLAIN_EPILOGUE = True
_NOMINAL_SMS = 132  # split-K planning is shape-only (workspace size must not depend on device)


def _bf16() -> np.dtype[Any]:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _supported_dtypes() -> tuple[np.dtype[Any], ...]:
    return (np.dtype(np.float32), np.dtype(np.float16), _bf16())


# --------------------------------------------------------------------------- checks


def gemm_check(
    a_shape: tuple[int, ...],
    a_dtype: Any,
    b_shape: tuple[int, ...],
    b_dtype: Any,
    *,
    out_shape: tuple[int, ...] | None = None,
    out_dtype: Any = None,
    bias_shape: tuple[int, ...] | None = None,
    bias_dtype: Any = None,
    activation: str | None = None,
    op: str = "gemm",
) -> tuple[tuple[int, ...], np.dtype[Any]]:
    """Validate a GEMM's arguments; return ``(out_shape, out_dtype)``.

    Args:
        a_shape: ``(*batch, M, K)``.
        a_dtype: float32, float16 or bfloat16.
        b_shape: ``(K, N)`` or ``(*batch, K, N)`` (same leading dims as ``a``).
        b_dtype: must equal ``a_dtype``.
        out_shape: if given, must be ``(*batch, M, N)``.
        out_dtype: if given, must equal ``a_dtype``.
        bias_shape: if given, must be ``(N,)``.
        bias_dtype: if given, must equal ``a_dtype``.
        activation: None, ``"relu"``, ``"gelu"`` or ``"silu"``.
        op: operation name used in messages.

    Returns:
        The output shape and dtype.

    Raises:
        ShapeError: shapes do not fit (message names the shapes).
        DTypeError: dtypes unsupported or mismatched.
        ValueError: unknown activation.
    """
    a_shape = tuple(int(x) for x in a_shape)
    b_shape = tuple(int(x) for x in b_shape)
    ad, bd = np.dtype(a_dtype), np.dtype(b_dtype)
    if ad not in _supported_dtypes():
        raise DTypeError(f"{op}: a has dtype {ad}; supported: float32, float16, bfloat16", op=op)
    if bd != ad:
        raise DTypeError(f"{op}: b has dtype {bd} but a has dtype {ad}; they must match", op=op)
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation {activation!r} not one of None, 'relu', 'gelu', 'silu'")
    if len(a_shape) < 2 or len(b_shape) < 2:
        raise ShapeError(
            f"{op}: a {a_shape} and b {b_shape} must have at least 2 dims ((..., M, K) @ (K, N))", op=op
        )
    *batch, m, k = a_shape
    kb, n = b_shape[-2:]
    if kb != k:
        raise ShapeError(f"{op}: inner dims differ: a {a_shape} has K={k}, b {b_shape} has K={kb}", op=op)
    if len(b_shape) > 2 and tuple(b_shape[:-2]) != tuple(batch):
        raise ShapeError(
            f"{op}: b {b_shape} has leading dims {b_shape[:-2]} but a {a_shape} has {tuple(batch)}; "
            "b must be 2-D or have the same leading dims as a",
            op=op,
        )
    if min(a_shape + b_shape) < 1:
        raise ShapeError(f"{op}: every dim must be >= 1, got a {a_shape}, b {b_shape}", op=op)
    oshape = (*batch, m, n)
    if out_shape is not None and tuple(int(x) for x in out_shape) != oshape:
        raise ShapeError(f"{op}: out has shape {tuple(out_shape)}, expected {oshape} for a {a_shape} @ b {b_shape}", op=op)
    if out_dtype is not None and np.dtype(out_dtype) != ad:
        raise DTypeError(f"{op}: out has dtype {np.dtype(out_dtype)}, expected {ad}", op=op)
    if bias_shape is not None and tuple(int(x) for x in bias_shape) != (n,):
        raise ShapeError(f"{op}: bias has shape {tuple(bias_shape)}, expected ({n},) for N={n}", op=op)
    if bias_dtype is not None and np.dtype(bias_dtype) != ad:
        raise DTypeError(f"{op}: bias has dtype {np.dtype(bias_dtype)}, expected {ad}", op=op)
    return oshape, ad


def _check_layout(name: str, shape: tuple[int, ...], strides: tuple[int, ...], contiguous: bool, op: str) -> None:
    if not contiguous:
        raise ShapeError(
            f"{op}: {name} of shape {shape} with strides {strides} is not row-major C-contiguous "
            f"(transposed or strided view); pass {name}.copy() (a contiguous copy)",
            op=op,
        )


# --------------------------------------------------------------------------- reference


def _round_tf32(x: np.ndarray) -> np.ndarray:
    """Round float32 values to tf32 (10 explicit mantissa bits), ties away from zero."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    finite = np.isfinite(x)
    r = ((u + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).astype(np.uint32)
    r = np.where(finite, r, u)
    return r.view(np.float32)


def _act_np(v: np.ndarray, activation: str | None) -> np.ndarray:
    if activation == "relu":
        return np.maximum(v, 0.0)
    if activation == "gelu":
        return 0.5 * v * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3)))
    if activation == "silu":
        return v * 0.5 * (1.0 + np.tanh(0.5 * v))  # = x * sigmoid(x), overflow-free
    return v


def gemm_reference(
    a: np.ndarray,
    b: np.ndarray,
    *,
    bias: np.ndarray | None = None,
    activation: str | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: np.ndarray | None = None,
    tf32: bool = False,
) -> np.ndarray:
    """NumPy GEMM with the CUDA paths' semantics (computed in float64).

    Args:
        a: ``(*batch, M, K)``.
        b: ``(K, N)`` or ``(*batch, K, N)``, same dtype.
        bias: ``(N,)`` or None.
        activation: None, ``"relu"``, ``"gelu"`` (tanh approximation), ``"silu"``.
        alpha: scale of ``a @ b``.
        beta: scale of ``c``; ``c`` is read only when ``beta != 0``.
        c: the previous output ``(*batch, M, N)`` (required when ``beta != 0``).
        tf32: round float32 operands to tf32 first (the ``tf32=True`` CUDA mode).

    Returns:
        ``act(alpha * a @ b + beta * c + bias)`` in the input dtype.
    """
    oshape, odt = gemm_check(
        a.shape, a.dtype, b.shape, b.dtype,
        bias_shape=None if bias is None else bias.shape,
        bias_dtype=None if bias is None else bias.dtype,
        activation=activation, op="gemm",
    )  # fmt: skip
    a64 = np.asarray(a).astype(np.float64)
    b64 = np.asarray(b).astype(np.float64)
    if tf32 and odt == np.float32:
        a64 = _round_tf32(np.asarray(a, np.float32)).astype(np.float64)
        b64 = _round_tf32(np.asarray(b, np.float32)).astype(np.float64)
    v = float(alpha) * np.matmul(a64, b64)
    if beta != 0.0:
        if c is None:
            raise ShapeError("gemm: beta != 0 needs the previous output c", op="gemm")
        if tuple(c.shape) != oshape:
            raise ShapeError(f"gemm: c has shape {c.shape}, expected {oshape}", op="gemm")
        v = v + float(beta) * np.asarray(c).astype(np.float64)
    if bias is not None:
        v = v + np.asarray(bias).astype(np.float64)
    v = _act_np(v, activation)
    return np.asarray(v.astype(odt)).reshape(oshape)


# --------------------------------------------------------------------------- planning


def _cdiv(x: int, y: int) -> int:
    return -(-x // y)


def _dims(a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> tuple[int, int, int, int, bool]:
    """(batch, M, N, K, b_batched) with the batch folded into M when b is 2-D."""
    *batch, m, k = (int(x) for x in a_shape)
    n = int(b_shape[-1])
    nb = math.prod(batch) if batch else 1
    b_batched = len(b_shape) > 2
    if not b_batched:
        return 1, nb * m, n, k, False
    return nb, m, n, k, True


def _splits_for(tiles: int, kt_total: int, n_sm: int) -> int:
    """Split-K factor: fill about one wave of ``n_sm`` blocks, >= 2 k-tiles per split."""
    if tiles >= n_sm // 2 or kt_total < 4:
        return 1
    want = _cdiv(n_sm, tiles)
    s = max(1, min(want, kt_total // 2, 32))
    kps = _cdiv(kt_total, s)
    return _cdiv(kt_total, kps)


# Relative mainloop efficiency of the sm_90 configs (measured on H100, 2026-11-23).
_SM90_EFF = {"128x256": 1.0, "128x128": 0.9, "64x128": 0.65, "pp128x128": 0.0}  # 0: not planned
_SM_FLOPS_PER_US = 5.5e6  # per-SM dense bf16 rate, about 730 TFLOP/s / 132
_SPLIT_FIXED_US = 1.0  # extra launch + partial round trip of split-K


def _plan_sm90(batch: int, m: int, n: int, k: int, n_sm: int) -> tuple[str, int, int]:
    """Pick (config, splits, k-tiles per split) minimising a simple time model.

    time = waves * k-tiles per split * tile cost / efficiency
           + (split-K only) fixed cost + float32 partial traffic at ~3 TB/s.
    """
    kt = _cdiv(k, 64)
    best: tuple[float, str, int, int] | None = None
    for name, (bn, ncw, _) in SM90_CONFIGS.items():
        if not _SM90_EFF.get(name):
            continue
        bm = 64 * ncw
        tiles = batch * _cdiv(m, bm) * _cdiv(n, bn)
        tile_us = 2.0 * bm * bn * 64 / (_SM90_EFF[name] * _SM_FLOPS_PER_US)
        for s in (1, 2, 3, 4, 6, 8, 12, 16):
            if s > 1 and kt // s < 2:
                break
            kps = _cdiv(kt, s)
            s_eff = _cdiv(kt, kps)
            t = _cdiv(tiles * s_eff, n_sm) * kps * tile_us
            if s_eff > 1:
                t += _SPLIT_FIXED_US + (4 * s_eff + 2) * batch * m * n / 3e6
            if best is None or t < best[0] * 0.97:
                best = (t, name, s_eff, kps)
    assert best is not None
    return best[1], best[2], best[3]


def _plan(
    batch: int, m: int, n: int, k: int, dtype: np.dtype[Any], tf32: bool, sm90: bool, n_sm: int,
    gemv_ok: bool = True,
) -> tuple[str, Any, int, int]:
    """Choose (path, config, splits, k-tiles per split) for a problem."""
    if dtype == np.float32 and not tf32:
        bk = 8
        tiles = batch * _cdiv(m, 128) * _cdiv(n, 128)
        kt = _cdiv(k, bk)
        s = _splits_for(tiles, kt, n_sm)
        return "simt", None, s, _cdiv(kt, s)
    if dtype == np.float32:  # tf32 on mma.sync
        wm = 2 if m > 64 and batch * _cdiv(m, 128) * _cdiv(n, 128) >= n_sm // 2 else 1
        tiles = batch * _cdiv(m, 64 * wm) * _cdiv(n, 128)
        kt = _cdiv(k, 16)
        s = _splits_for(tiles, kt, n_sm)
        return "sm80", wm, s, _cdiv(kt, s)
    if gemv_ok and m <= GEMV_MAX_M and n % 8 == 0:
        return "gemv", None, 1, 0
    if sm90:
        return ("sm90", *_plan_sm90(batch, m, n, k, n_sm))
    wm = 2 if m > 64 and batch * _cdiv(m, 128) * _cdiv(n, 128) >= n_sm // 2 else 1
    tiles = batch * _cdiv(m, 64 * wm) * _cdiv(n, 128)
    kt = _cdiv(k, 32)
    s = _splits_for(tiles, kt, n_sm)
    return "sm80", wm, s, _cdiv(kt, s)


def gemm_workspace_nbytes(a_shape: tuple[int, ...], b_shape: tuple[int, ...], dtype: Any) -> int:
    """Bytes of device workspace :func:`gemm_cuda` can use for split-K partials (0: none).

    The size depends on the shapes and dtype only (not on the device), and covers every
    path (sm_90 and sm_80, with or without tf32). Without a large enough workspace,
    :func:`gemm_cuda` runs unsplit (correct, slower for small ``M * N``).
    """
    batch, m, n, k, _ = _dims(tuple(a_shape), tuple(b_shape))
    dt = np.dtype(dtype)
    most = 1
    for tf32 in (False, True):
        for sm90 in (False, True):
            for gemv_ok in (False, True):
                _, _, s, _ = _plan(batch, m, n, k, dt, tf32, sm90, _NOMINAL_SMS, gemv_ok)
                most = max(most, s)
    return 0 if most == 1 else most * batch * m * n * 4


# --------------------------------------------------------------------------- modules

_INCLUDE = re.compile(r'^\s*#include\s+"(gemm_[A-Za-z0-9_]+\.cuh)"\s*$', re.MULTILINE)
_kcache: dict[tuple[Any, ...], Any] = {}
_dev_info: dict[int, tuple[int, int]] = {}
_lock = threading.Lock()


def expanded_source(name: str) -> str:
    """Kernel source ``name`` with its ``#include "gemm_*.cuh"`` lines inlined (once each)."""
    seen: set[str] = set()

    def expand(text: str) -> str:
        def rep(mt: re.Match[str]) -> str:
            inc = mt.group(1)
            if inc in seen:
                return ""
            seen.add(inc)
            return expand(read_source(inc))

        return _INCLUDE.sub(rep, text)

    return expand(read_source(name))


def _device_info(device_id: int) -> tuple[int, int]:
    info = _dev_info.get(device_id)
    if info is None:
        import cupy

        dev = cupy.cuda.Device(device_id)
        cc = int(dev.compute_capability)
        n_sm = int(dev.attributes["MultiProcessorCount"])
        info = _dev_info[device_id] = (cc, n_sm)
    return info


def _kernel(device_id: int, file: str, func: str, defines: tuple[str, ...], arch_suffix: str = "") -> Any:
    key = (device_id, file, func, defines, arch_suffix)
    fn = _kcache.get(key)
    if fn is None:
        with _lock:
            fn = _kcache.get(key)
            if fn is None:
                mod = load_module(
                    expanded_source(file),
                    options=tuple(f"-D{d}" for d in defines),
                    device_id=device_id,
                    arch_suffix=arch_suffix,
                )
                fn = _kcache[key] = mod.get_function(func)
    return fn


def _sm90_smem(bn: int, ncw: int, stages: int) -> int:
    return stages * (64 * ncw * 64 * 2 + 64 * bn * 2) + 2 * 8 * stages + 16 + 1024


def _sm80_smem(wm: int, tf32: bool) -> int:
    bm = 64 * wm
    if tf32:
        return 3 * (bm * (16 + 4) + 16 * (128 + 8)) * 4
    return 3 * (bm * (32 + 8) + 32 * (128 + 8)) * 2


# --------------------------------------------------------------------------- TMA maps

_TMA_DTYPE = np.dtype([("v", np.uint64, (16,))])
_tma_cache: OrderedDict[tuple[int, ...], Any] = OrderedDict()
_libcuda: Any = None
_tma_lock = threading.Lock()


def _encode_tiled(ptr: int, dims: tuple[int, int, int], strides: tuple[int, int], box: tuple[int, int, int]) -> Any:
    """A 3-D ``CUtensorMap`` (16-bit elements, 128B swizzle) as a numpy record (kernel arg)."""
    global _libcuda
    key = (ptr, *dims, *strides, *box)
    with _tma_lock:
        hit = _tma_cache.get(key)
        if hit is not None:
            _tma_cache.move_to_end(key)
            return hit
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
        _libcuda.cuTensorMapEncodeTiled.restype = ctypes.c_int
    rec = np.zeros(1, dtype=_TMA_DTYPE)
    g_dim = (ctypes.c_uint64 * 3)(*dims)
    g_str = (ctypes.c_uint64 * 2)(*strides)
    b_dim = (ctypes.c_uint32 * 3)(*box)
    e_str = (ctypes.c_uint32 * 3)(1, 1, 1)
    res = _libcuda.cuTensorMapEncodeTiled(
        ctypes.c_void_p(rec.ctypes.data),
        ctypes.c_int(1),  # CU_TENSOR_MAP_DATA_TYPE_UINT16 (raw 16-bit elements)
        ctypes.c_uint32(3),
        ctypes.c_void_p(ptr),
        g_dim, g_str, b_dim, e_str,
        ctypes.c_int(0),  # interleave none
        ctypes.c_int(3),  # swizzle 128B
        ctypes.c_int(2),  # L2 promotion 128B
        ctypes.c_int(0),  # OOB fill zeros
    )  # fmt: skip
    if res != 0:
        raise ShapeError(
            f"gemm: cuTensorMapEncodeTiled failed (CUresult {res}) for dims {dims} strides {strides} box {box}",
            op="gemm",
        )
    val = rec[0]
    with _tma_lock:
        _tma_cache[key] = val
        if len(_tma_cache) > 512:
            _tma_cache.popitem(last=False)
    return val


# --------------------------------------------------------------------------- launcher


def gemm_cuda(
    a: Any,
    b: Any,
    out: Any,
    *,
    bias: Any = None,
    activation: str | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    tf32: bool = False,
    workspace: Any = None,
    stream: Any,
    _force: str | None = None,
) -> None:
    """Enqueue ``out = act(alpha * a @ b + beta * out + bias)`` on ``stream``.

    No device allocation and no synchronisation happen here (graph-capture safe).

    Args:
        a: ``(*batch, M, K)`` cupy array, C-contiguous.
        b: ``(K, N)`` or ``(*batch, K, N)`` cupy array, C-contiguous, same dtype.
        out: ``(*batch, M, N)`` cupy array to write (read first when ``beta != 0``).
        bias: ``(N,)`` cupy array or None.
        activation: None, ``"relu"``, ``"gelu"``, ``"silu"``.
        alpha: scale of ``a @ b``.
        beta: scale of the previous ``out``.
        tf32: float32 inputs on tensor cores with tf32 operands.
        workspace: cupy array of at least :func:`gemm_workspace_nbytes` bytes, or None.
        stream: the ``cupy.cuda.Stream`` every launch goes to.
        _force: testing/benchmark override: ``"sm80"``, ``"simt"``, or an sm_90
            config name (``"128x256"``, ``"128x128"``, ``"64x128"``), optionally with
            ``":S"`` to force ``S`` split-K slices.

    Raises:
        ShapeError, DTypeError: before any launch.
    """
    _, odt = gemm_check(
        a.shape, a.dtype, b.shape, b.dtype, out_shape=out.shape, out_dtype=out.dtype,
        bias_shape=None if bias is None else bias.shape,
        bias_dtype=None if bias is None else bias.dtype,
        activation=activation, op="gemm",
    )  # fmt: skip
    dev = a.device.id
    for name, arr in (("a", a), ("b", b), ("out", out), ("bias", bias)):
        if arr is None:
            continue
        _check_layout(name, tuple(arr.shape), tuple(arr.strides), bool(arr.flags.c_contiguous), "gemm")
        if arr.device.id != dev:
            raise ShapeError(f"gemm: {name} is on device {arr.device.id}, a on device {dev}", op="gemm")
    batch, m, n, k, b_batched = _dims(tuple(a.shape), tuple(b.shape))
    cc, n_sm = _device_info(dev)
    i32, f32 = np.int32, np.float32
    act = i32(ACTIVATIONS[activation])
    has_bias = i32(bias is not None)
    has_beta = i32(float(beta) != 0.0)
    bias_arg = bias if bias is not None else out  # never read when has_bias == 0
    is16 = odt != np.float32
    bf16 = is16 and odt == _bf16()
    ptrs16 = all(int(x.data.ptr) % 16 == 0 for x in (a, b, out))
    tma_ok = is16 and cc == 90 and k % 8 == 0 and n % 8 == 0 and ptrs16

    force_cfg, force_s = _force, 0
    if _force and ":" in _force:
        force_cfg, s_txt = _force.split(":")
        force_s = int(s_txt)
    if force_cfg in SM90_CONFIGS and not tma_ok:
        raise ShapeError(f"gemm: forced sm_90 config {_force} not usable for this call", op="gemm")
    gemv_ok = not _force and int(b.data.ptr) % 16 == 0
    path, cfg, splits, kps = _plan(batch, m, n, k, odt, tf32, tma_ok, _NOMINAL_SMS, gemv_ok)
    if force_cfg in SM90_CONFIGS:
        path, cfg = "sm90", force_cfg
    elif force_cfg == "sm80" and (is16 or tf32):
        path, cfg = "sm80", 2 if m > 64 else 1
    elif force_cfg == "simt" and not is16:
        path, cfg = "simt", None
    bk = {"sm90": 64, "simt": 8}.get(path, 16 if not is16 else 32)
    kt_total = _cdiv(k, bk)
    if force_s:
        splits = max(1, min(force_s, kt_total))
    splits = max(1, min(splits, kt_total))
    kps = _cdiv(kt_total, splits)
    splits = _cdiv(kt_total, kps)
    need = splits * batch * m * n * 4
    if splits > 1 and (workspace is None or int(workspace.nbytes) < need):
        splits, kps = 1, kt_total
    ws_arg = workspace if splits > 1 else out

    if path == "gemv":
        fn = _kernel(dev, "gemm_gemv.cu", "gemm_gemv", (f"GEMM_BF16={int(bf16)}",))
        fn(
            (_cdiv(n, 16), 1, batch), (256, 1, 1),
            (a, b, out, bias_arg, i32(m), i32(n), i32(k), np.int64(k * n if b_batched else 0), f32(alpha),
             f32(beta), act, has_bias, has_beta),
            stream=stream,
        )  # fmt: skip
        return
    if path == "sm90":
        bn, ncw, stages = SM90_CONFIGS[cfg]
        bm = 64 * ncw
        plain = SM90_PLAIN_EPILOGUE and splits == 1 and alpha == 1.0 and not has_beta and not has_bias and not act
        defs90 = (f"BN={bn}", f"NCW={ncw}", f"STAGES={stages}", f"GEMM_BF16={int(bf16)}",
                  f"GEMM_EPI_PLAIN={int(plain)}", *SM90_EXTRA_DEFINES)  # fmt: skip
        pp = cfg.startswith("pp")
        fn = _kernel(dev, "gemm_sm90_pp.cu" if pp else "gemm_sm90.cu", "gemm_sm90_pp" if pp else "gemm_sm90",
                     defs90, arch_suffix="a")  # fmt: skip
        smem = _sm90_smem(bn, ncw, stages)
        set_max_dynamic_smem(fn, smem)
        tm_a = _encode_tiled(int(a.data.ptr), (k, m, batch), (k * 2, m * k * 2), (64, bm, 1))
        bb = batch if b_batched else 1
        tm_b = _encode_tiled(int(b.data.ptr), (n, k, bb), (n * 2, k * n * 2), (64, 64, 1))
        tiles_m, tiles_n = _cdiv(m, bm), _cdiv(n, bn)
        total = batch * splits * tiles_m * tiles_n
        fn(
            (min(total, n_sm), 1, 1), (128 * (ncw + 1), 1, 1),
            (tm_a, tm_b, out, bias_arg, ws_arg, i32(m), i32(n), i32(batch), i32(tiles_m), i32(tiles_n),
             i32(splits), i32(kt_total), i32(kps), i32(b_batched), i32(total), f32(alpha), f32(beta),
             act, has_bias, has_beta),
            shared_mem=smem, stream=stream,
        )  # fmt: skip
    else:
        vec_align = 8 if is16 else 4
        vec = i32(k % vec_align == 0 and n % vec_align == 0 and ptrs16)
        b_bstride = np.int64(k * n if b_batched else 0)
        if path == "sm80":
            wm = int(cfg)
            defines = (f"WARPS_M={wm}", f"GEMM_TF32={int(not is16)}", f"GEMM_BF16={int(bf16)}")
            fn = _kernel(dev, "gemm_sm80.cu", "gemm_sm80", defines)
            smem = _sm80_smem(wm, not is16)
            set_max_dynamic_smem(fn, smem)
            grid: tuple[int, int, int] = (_cdiv(n, 128), _cdiv(m, 64 * wm), batch * splits)
            block = (128 * wm, 1, 1)
        else:
            fn = _kernel(dev, "gemm_simt.cu", "gemm_simt", ())
            smem = 0
            grid = (_cdiv(n, 128), _cdiv(m, 128), batch * splits)
            block = (256, 1, 1)
        if grid[1] > 65535 or grid[2] > 65535:
            raise ShapeError(f"gemm: a {tuple(a.shape)} b {tuple(b.shape)} too large for one launch", op="gemm")
        fn(
            grid, block,
            (a, b, out, bias_arg, ws_arg, i32(m), i32(n), i32(k), i32(batch), b_bstride, i32(splits),
             i32(kps), vec, f32(alpha), f32(beta), act, has_bias, has_beta),
            shared_mem=smem, stream=stream,
        )  # fmt: skip
    if splits > 1:
        red = _kernel(dev, "gemm_reduce.cu", "gemm_splitk_reduce",
                      (f"GEMM_OUT_F32={int(not is16)}", f"GEMM_BF16={int(bf16)}"))  # fmt: skip
        total_out = batch * m * n
        blocks = min(_cdiv(total_out, 256), 8 * n_sm)
        red(
            (blocks, 1, 1), (256, 1, 1),
            (workspace, out, bias_arg, np.int64(total_out), i32(n), i32(splits), f32(alpha), f32(beta),
             act, has_bias, has_beta),
            stream=stream,
        )  # fmt: skip
