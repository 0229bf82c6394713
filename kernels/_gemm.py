"""GEMM: planning, CUDA launchers and the NumPy reference.

Semantics (every backend, every path)::

    out[..., m, n] = act(alpha * sum_k a[..., m, k] * b[(...,) k, n]
                         + beta * out_prev[..., m, n] + bias[n])

* ``a``: ``(*batch, M, K)``; ``b``: ``(K, N)`` (shared by every batch entry) or
  ``(*batch, K, N)`` with the same leading dims as ``a``; ``out``: ``(*batch, M, N)``.
  With ``trans_b=True``, ``b`` is ``(N, K)`` / ``(*batch, N, K)`` (a Linear weight as
  checkpoints store it) and every path reads it as its transpose, without a copy.
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

CUDA paths (chosen by :func:`_plan` once per problem: the plan is cached, see
:mod:`._gemm_cuda`; no allocation, no synchronisation, every launch on the ``stream``
handed in, so calls can be captured into CUDA graphs):

* ``gemm_sm90`` (sm_90a only: H100/H200): TMA (``cp.async.bulk.tensor``) + ``mbarrier``
  ring, one producer warpgroup and one or two consumer warpgroups issuing ``wgmma``
  (``setmaxnreg`` rebalances registers), persistent grid, tiles 128x256, 128x128 or
  64x128, split-K for small ``M * N``. Needs ``K % 8 == 0``, ``N % 8 == 0`` and 16-byte
  aligned base pointers (TMA strides); otherwise the sm_80 path runs.
* ``gemm_skinny`` (sm_80+): f16/bf16, ``trans_b``, at most 64 rows (decode, small
  batches), ``K % 8 == 0``: streams the ``(N, K)`` weight once with 16-byte loads straight
  into ``mma.sync`` fragments (``out^T = W a^T``, the k order permuted identically in both
  operands), warps of a block split K and reduce through shared memory, no workspace.
* ``gemm_gemv`` (any sm): f16/bf16, b not transposed, at most 8 rows and ``N % 8 == 0``:
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

import functools
import math
from typing import Any

import numpy as np

from deviceops.extend import DTypeError, ShapeError

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
}
GEMV_MAX_M = 8  # f16/bf16 with at most this many rows, b not transposed -> gemm_gemv
SKINNY_MAX_M = 64  # f16/bf16 with at most this many rows, trans_b -> gemm_skinny
_SKINNY_SMALL_BYTES = 8 << 20  # skinny: a weight below this is latency bound (one load round)

_NOMINAL_SMS = 132  # split-K planning is shape-only (workspace size must not depend on device)


def _bf16() -> np.dtype[Any]:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _supported_dtypes() -> tuple[np.dtype[Any], ...]:
    return (np.dtype(np.float32), np.dtype(np.float16), _bf16())


# --------------------------------------------------------------------------- checks


@functools.lru_cache(maxsize=4096)
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
    trans_b: bool = False,
) -> tuple[tuple[int, ...], np.dtype[Any]]:
    """Validate a GEMM's arguments; return ``(out_shape, out_dtype)``.

    Cached per argument tuple (shapes as tuples: every argument must be hashable).

    Args:
        a_shape: ``(*batch, M, K)``.
        a_dtype: float32, float16 or bfloat16.
        b_shape: ``(K, N)`` or ``(*batch, K, N)`` (same leading dims as ``a``); with
            ``trans_b``, ``(N, K)`` or ``(*batch, N, K)``.
        b_dtype: must equal ``a_dtype``.
        out_shape: if given, must be ``(*batch, M, N)``.
        out_dtype: if given, must equal ``a_dtype``.
        bias_shape: if given, must be ``(N,)``.
        bias_dtype: if given, must equal ``a_dtype``.
        activation: None, ``"relu"``, ``"gelu"`` or ``"silu"``.
        op: operation name used in messages.
        trans_b: ``b`` is given transposed, ``(..., N, K)`` (a Linear weight as stored).

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
    form = "(N, K), trans_b=True" if trans_b else "(K, N), trans_b=False"
    if len(a_shape) < 2 or len(b_shape) < 2:
        raise ShapeError(
            f"{op}: a {a_shape} and b {b_shape} must have at least 2 dims ((..., M, K) @ b {form})", op=op
        )
    *batch, m, k = a_shape
    if trans_b:
        n, kb = b_shape[-2:]
    else:
        kb, n = b_shape[-2:]
    if kb != k:
        fix = ("; b looks like (K, N): pass trans_b=False" if trans_b and b_shape[-2] == k else
               "; b looks like (N, K) (a Linear weight): pass trans_b=True" if not trans_b and b_shape[-1] == k
               else "")  # fmt: skip
        raise ShapeError(
            f"{op}: inner dims differ: a {a_shape} has K={k}, b {b_shape} read as {form} has K={kb}{fix}",
            op=op,
        )
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
    trans_b: bool = False,
) -> np.ndarray:
    """NumPy GEMM with the CUDA paths' semantics (computed in float64).

    Args:
        a: ``(*batch, M, K)``.
        b: ``(K, N)`` or ``(*batch, K, N)``, same dtype; ``(N, K)`` / ``(*batch, N, K)``
            with ``trans_b``.
        bias: ``(N,)`` or None.
        activation: None, ``"relu"``, ``"gelu"`` (tanh approximation), ``"silu"``.
        alpha: scale of ``a @ b``.
        beta: scale of ``c``; ``c`` is read only when ``beta != 0``.
        c: the previous output ``(*batch, M, N)`` (required when ``beta != 0``).
        tf32: round float32 operands to tf32 first (the ``tf32=True`` CUDA mode).
        trans_b: ``b`` is given as ``(..., N, K)`` and read as its transpose.

    Returns:
        ``act(alpha * a @ b + beta * c + bias)`` in the input dtype.
    """
    oshape, odt = gemm_check(
        a.shape, a.dtype, b.shape, b.dtype,
        bias_shape=None if bias is None else bias.shape,
        bias_dtype=None if bias is None else bias.dtype,
        activation=activation, op="gemm", trans_b=trans_b,
    )  # fmt: skip
    a64 = np.asarray(a).astype(np.float64)
    b64 = np.asarray(b).astype(np.float64)
    if tf32 and odt == np.float32:
        a64 = _round_tf32(np.asarray(a, np.float32)).astype(np.float64)
        b64 = _round_tf32(np.asarray(b, np.float32)).astype(np.float64)
    if trans_b:
        b64 = np.swapaxes(b64, -1, -2)
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


def _dims(
    a_shape: tuple[int, ...], b_shape: tuple[int, ...], trans_b: bool = False
) -> tuple[int, int, int, int, bool]:
    """(batch, M, N, K, b_batched) with the batch folded into M when b is 2-D."""
    *batch, m, k = (int(x) for x in a_shape)
    n = int(b_shape[-2] if trans_b else b_shape[-1])
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
_SM90_EFF = {"128x256": 1.0, "128x128": 0.9, "64x128": 0.65}
_SM_FLOPS_PER_US = 5.5e6  # per-SM dense bf16 rate, about 730 TFLOP/s / 132
_SPLIT_FIXED_US = 1.0  # extra launch + partial round trip of split-K
# No split-K from this many rows (per batch) up: measured on H100 (2026-11-23,
# tools/gemm_sweep_gpu.py), one slice beat every split at M = 128..512 of the SmolLM2 and
# 8B prefill shapes (128x768x768 bf16 6.50 vs 7.63 us, 128x4096x4096 16.0 vs 24.7 us,
# 512x576x1536 8.40 vs 10.07 us): the partial round trip costs more than the model says.
_SPLIT_MAX_ROWS = 128


def _plan_sm90(batch: int, m: int, n: int, k: int, n_sm: int) -> tuple[str, int, int]:
    """Pick (config, splits, k-tiles per split) minimising a simple time model.

    time = waves * k-tiles per split * tile cost / efficiency
           + (split-K only) fixed cost + float32 partial traffic at ~3 TB/s;
    split-K is considered only below ``_SPLIT_MAX_ROWS`` rows.
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
            if s > 1 and (kt // s < 2 or m >= _SPLIT_MAX_ROWS):
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


def skinny_config(batch: int, m: int, n: int, k: int, ks: int = 0) -> tuple[int, int, int, int, int]:
    """Geometry of the skinny (``M <= 64``, ``trans_b``) kernel: ``(MF, TR, U, KS, KCW)``.

    ``MF`` m-fragments of 8 rows; ``TR`` 16-row weight tiles per warp (2 halves the
    activation re-reads for ``MF >= 3`` on large weights; small weights, which are latency
    bound, keep 1 for more blocks); ``U`` 32-wide k-chunks loaded per round (registers in
    flight ``U * (8 TR + 4 MF)`` <= 64, or 96 for small weights: one round per warp);
    ``KS`` warps of a block splitting K (8 for one m-fragment and for grids of <= 256
    tiles, else 4: the best of 2 / 4 / 8 measured on H100 at the SmolLM2 and 8B shapes,
    2026-11-23; at least 2 chunks each); ``KCW`` k-chunks per warp. ``ks > 0`` forces
    ``KS`` (experiments).
    """
    mf = _cdiv(m, 8)
    small = batch * n * k * 2 < _SKINNY_SMALL_BYTES
    tr = 1 if mf <= 2 or small else 2
    u = max(1, min(4, (96 if small else 64) // (8 * tr + 4 * mf)))
    chunks = _cdiv(k, 32)
    tiles = batch * _cdiv(n, 16 * tr)
    if ks <= 0:
        ks = 8 if mf == 1 or tiles <= 256 else 4
        ks = min(ks, chunks // 2)
    ks = max(1, min(ks, 8, chunks))
    kcw = _cdiv(chunks, ks)
    return mf, tr, u, _cdiv(chunks, kcw), kcw


def _plan(
    batch: int, m: int, n: int, k: int, dtype: np.dtype[Any], tf32: bool, sm90: bool, n_sm: int,
    gemv_ok: bool = True, trans_b: bool = False, skinny_ok: bool = False,
) -> tuple[str, Any, int, int]:
    """Choose (path, config, splits, k-tiles per split) for a problem.

    ``gemv_ok`` / ``skinny_ok``: the decode kernels' alignment needs hold (B 16-byte aligned;
    skinny also ``K % 8 == 0`` and ``a`` aligned); ``sm90``: the TMA path's needs hold.
    """
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
    if trans_b and skinny_ok and m <= SKINNY_MAX_M and k % 8 == 0:
        return "skinny", skinny_config(batch, m, n, k), 1, 0
    if not trans_b and gemv_ok and m <= GEMV_MAX_M and n % 8 == 0:
        return "gemv", None, 1, 0
    if sm90:
        return ("sm90", *_plan_sm90(batch, m, n, k, n_sm))
    wm = 2 if m > 64 and batch * _cdiv(m, 128) * _cdiv(n, 128) >= n_sm // 2 else 1
    tiles = batch * _cdiv(m, 64 * wm) * _cdiv(n, 128)
    kt = _cdiv(k, 32)
    s = _splits_for(tiles, kt, n_sm)
    return "sm80", wm, s, _cdiv(kt, s)


@functools.lru_cache(maxsize=4096)
def gemm_workspace_nbytes(
    a_shape: tuple[int, ...], b_shape: tuple[int, ...], dtype: Any, trans_b: bool = False
) -> int:
    """Bytes of device workspace :func:`gemm_cuda` can use for split-K partials (0: none).

    The size depends on the shapes, dtype and ``trans_b`` only (not on the device), and
    covers every path (sm_90 and sm_80, with or without tf32). Without a large enough
    workspace, :func:`gemm_cuda` runs unsplit (correct, slower for small ``M * N``).
    Cached per argument tuple (host cost per call).
    """
    batch, m, n, k, _ = _dims(tuple(a_shape), tuple(b_shape), trans_b)
    dt = np.dtype(dtype)
    most = 1
    for tf32 in (False, True):
        for sm90 in (False, True):
            for gemv_ok in (False, True):
                _, _, s, _ = _plan(batch, m, n, k, dt, tf32, sm90, _NOMINAL_SMS, gemv_ok, trans_b)
                most = max(most, s)
    return 0 if most == 1 else most * batch * m * n * 4


from ._gemm_cuda import gemm_cuda  # noqa: E402  (the launcher half; imports this module)
