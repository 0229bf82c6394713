"""GEMM host planning: the path, tiles and split-K of a problem, and its workspace size.

:func:`plan_path` picks ``(path, config, splits, k-tiles per split)`` from the shapes, dtype and
the device's capabilities (pure logic, tested on the cpu backend); :func:`gemm_workspace_nbytes`
sizes the split-K partials for every path, from the shapes alone. The launch plans built on
these live in :mod:`._cuda`; :class:`GemmOverride` pins a path or geometry instead.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..runtime._override import Override

__all__ = ["GEMV_MAX_M", "GemmOverride", "SKINNY_MAX_M", "SM90_CONFIGS", "gemm_workspace_nbytes", "gemv_config", "skinny_config",
           "skinny_tma_blocks_per_sm", "skinny_tma_config", "skinny_tma_smem"]

# sm_90 configs: name -> (BN, NCW, STAGES); the block tile is (64 * NCW) x BN.
SM90_CONFIGS: dict[str, tuple[int, int, int]] = {
    "128x256": (256, 2, 4),
    "128x128": (128, 2, 6),
    "64x128": (128, 1, 8),
}
GEMV_MAX_M = 8  # f16/bf16 with at most this many rows, b not transposed -> gemm_gemv
# On sm_90 the GEMV serves M = 1, and M <= 4 for weights of at most this many elements; the
# TMA tiles are faster above (H100, ``benchmarks/gemm.py --m 8``: M = 8 4096x4096 64.4 vs 18.9 us).
_GEMV_SMALL_WEIGHT = 1 << 21
SKINNY_MAX_M = 64  # f16/bf16 with at most this many rows, trans_b -> gemm_skinny
_SKINNY_SMALL_BYTES = 8 << 20  # skinny: a weight below this is latency bound (one load round)
_SKINNY_LARGE_BYTES = 64 << 20  # skinny, one m-fragment: from here 8 chunks of loads in flight
_SKINNY_NARROW_N = 6144  # skinny, M > 16: weights with at most this many rows keep one tile a warp
_TMA_NARROW_N = 4096  # TMA skinny: weights with at most this many rows take 64-row tiles and 2 K slices
_SMEM_MAX = 227 * 1024  # sm_90: dynamic shared memory a block may opt in to
_NOMINAL_SMS = 132  # split-K planning is shape-only (workspace size must not depend on device)


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


# Relative mainloop efficiency of the sm_90 configs (measured on H100).
_SM90_EFF = {"128x256": 1.0, "128x128": 0.9, "64x128": 0.65}
_SM_FLOPS_PER_US = 5.5e6  # per-SM dense bf16 rate, about 730 TFLOP/s / 132
_SPLIT_FIXED_US = 1.0  # extra launch + partial round trip of split-K
# No split-K from this many rows (per batch) up: measured on H100 (``benchmarks/gemm.py`` under each ``GemmOverride``),
# one slice beat every split at M = 128..512 of the SmolLM2 and
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


def skinny_config(batch: int, m: int, n: int, k: int, ks: int = 0, tr: int = 0, u: int = 0
                  ) -> tuple[int, int, int, int, int]:
    """Geometry of the skinny (``M <= 64``, ``trans_b``) kernel: ``(MF, TR, U, KS, KCW)``.

    ``MF`` m-fragments of 8 rows; ``TR`` 16-row weight tiles per warp (2 halves the
    activation re-reads for ``MF >= 3`` on large, wide weights, N > 6144; small weights,
    which are latency bound, and narrower ones keep 1 for more blocks); ``U`` 32-wide k-chunks
    loaded per round (registers in flight ``U * (8 TR + 4 MF)`` <= 64, or 96 for small
    weights, for one m-fragment on weights of 64 MB or more (U = 8) and for ``MF >= 3`` with
    ``TR`` = 1; never more chunks than a warp has); ``KS`` warps of a block splitting K (8 for
    one m-fragment and for grids of <= 256 tiles, else 4; 4 for ``MF >= 3`` with ``TR`` = 1 on
    large weights; at least 2 chunks each); ``KCW`` k-chunks per warp. Measured on H100
    (8B M = 32 qkv / o / down 23.9 / 18.5 / 50.8 -> 22.7 / 17.7 / 47.3 µs; M = 1 14336x4096
    42.4 -> 41.0 µs). ``ks``, ``tr``, ``u`` > 0 force ``KS``, ``TR`` (1 or 2) and ``U`` (1 to
    8) (:class:`GemmOverride`).
    """
    mf = _cdiv(m, 8)
    nbytes = batch * n * k * 2
    small = nbytes < _SKINNY_SMALL_BYTES
    if tr <= 0:
        tr = 2 if mf >= 3 and _wide_weight(batch, n, k) else 1
    tr = min(tr, 2)
    chunks = _cdiv(k, 32)
    tiles = batch * _cdiv(n, 16 * tr)
    many_rows = mf >= 3 and tr == 1 and not small  # 4 warps, 4 chunks in flight
    deep = many_rows or (mf == 1 and nbytes >= _SKINNY_LARGE_BYTES)  # up to 8 chunks in flight
    if ks <= 0:
        ks = 4 if many_rows else 8 if mf == 1 or tiles <= 256 else 4
        ks = min(ks, chunks // 2)
    ks = max(1, min(ks, 8, chunks))
    kcw = _cdiv(chunks, ks)
    if u <= 0:
        u = max(1, min(8 if deep else 4, (96 if small or deep else 64) // (8 * tr + 4 * mf), kcw))
    u = min(u, 8)
    return mf, tr, u, _cdiv(chunks, kcw), kcw


def _wide_weight(batch: int, n: int, k: int) -> bool:
    """A weight of 8 MB or more with more than 6144 rows: for M > 16 the TMA kernel on sm_90,
    two 16-row tiles a warp in the register kernel elsewhere."""
    return batch * n > _SKINNY_NARROW_N and batch * n * k * 2 >= _SKINNY_SMALL_BYTES


def _narrow_large_weight(batch: int, n: int, k: int) -> bool:
    """A weight of 8 MB or more with at most 4096 rows: for M > 16 the TMA kernel on sm_90 in
    64-row tiles and two K slices (the register kernel re-reads the activation once per 16 rows)."""
    return batch * n <= _TMA_NARROW_N and batch * n * k * 2 >= _SKINNY_SMALL_BYTES


def skinny_tma_config(batch: int, m: int, n: int, k: int, cl: int = 0, stages: int = 0, ncw: int = 0,
                      persist: int = 0, mc: int = 0,
                      n_sm: int = _NOMINAL_SMS) -> tuple[int, int, int, int, int, int, int]:
    """Geometry of the swapped-operand TMA kernel (``gemm_skinny_tma.cu``, sm_90, M <= 64):
    ``(BN, CL, KPS, STAGES, NCW, PB, MC)``.

    ``BN`` activation rows padded for the wgmma N dimension (32 or 64); ``NCW`` consumer
    warpgroups, each owning 64 weight rows of a tile; ``CL`` K slices, one cluster (at most 8;
    enough tiles x slices to give every SM a block, at least 4 k-tiles a slice); ``KPS``
    64-wide k-tiles a slice; ``STAGES`` of the TMA ring; ``PB`` blocks a batch entry of the
    persistent kernel (0: one block a tile and K slice), each taking an equal count of tiles.
    Planned (H100, M = 32, device time, same-run cuBLAS; benchmarks/RESULTS.md):

    * narrow weights (``batch * N <= 4096``, 8 MB or more): 64-row tiles, 8 stages for BN 32
      (6 for BN 64), so 2 K slices fill the GPU (8B o 17.3 -> 16.0 µs, down 50.0 -> 44.2;
      at M = 48 / 64 o 19.4 / 25.6 -> 17.3 / 18.0);
    * short K (at most 16 k-tiles) over more 64-row tiles than two an SM: 64-row tiles, 6
      stages (BN 64: 4), persistent (SmolLM2 LM head 26.8 -> 24.3 µs: 9 k-tiles a tile, the ring no
      longer drains between tiles); a long K gains nothing from it (8B gate_up 85.7 -> 88.4);
    * otherwise 128-row tiles; BN 64: 3 stages (two blocks an SM); BN 32: 4, or 6 without a K
      split and 16 or more k-tiles (8B gate_up 90.6 -> 85.8 µs); at BN 32 with
      one K slice and at most one tile an SM, clusters of 4 tiles share each activation tile
      by multicast (8B up 46.0 -> 45.5 µs; with two tiles an SM or more it lost: gate_up 85.9
      -> 87.7, LM head 368.0 -> 371.0).

    A ring is never deeper than a slice's k-tiles (at least 2 stages) nor than shared memory
    holds (at most 10). ``MC`` blocks of consecutive tiles share each activation tile by TMA
    multicast (a cluster along the tiles; 1: none). ``cl``, ``stages`` (2 to 10), ``ncw`` (1 or
    2) and ``mc`` (2 or 4; needs one K slice, not persistent) force ``CL``, ``STAGES``,
    ``NCW`` and ``MC`` when > 0; ``persist`` 1 forces the persistent kernel (``CL`` becomes
    1), 2 forbids it (:class:`GemmOverride`).
    """
    bn = 32 if m <= 32 else 64
    kt = _cdiv(k, 64)
    narrow = batch * n <= _TMA_NARROW_N
    if persist == 0:
        persist = 1 if kt <= 16 and not narrow and batch * _cdiv(n, 64) > 2 * n_sm else 2
    if ncw <= 0:
        ncw = 1 if narrow or persist == 1 else 2
    ncw = min(ncw, 2)
    bm = 64 * ncw
    tiles = _cdiv(n, bm)
    if persist == 1:
        cl = 1
    if cl <= 0:
        cl = max(1, min(8, _NOMINAL_SMS // (batch * tiles), kt // 4))
    cl = max(1, min(cl, 8, kt))
    kps = _cdiv(kt, cl)
    if stages <= 0:
        if narrow and ncw == 1:
            stages = 8 if bn == 32 else 6
        elif persist == 1:
            stages = 6 if bn == 32 else 4  # BN 64: two blocks an SM
        else:
            stages = 3 if bn == 64 else 6 if cl == 1 and kps >= 16 else 4
    stages = max(2, min(stages, kps, _tma_max_stages(bn, ncw)))
    if mc <= 0:  # planned: multicast for one wave of 128-row tiles at BN 32 (8B up 46.0 -> 45.5 µs)
        mc = 4 if bn == 32 and ncw == 2 and cl == 1 and persist != 1 and 4 <= batch * tiles <= n_sm else 1
    mc = 1 if mc <= 1 or cl > 1 or persist == 1 else 4 if mc >= 4 else 2
    pb = 0
    if persist == 1:
        slots = max(1, n_sm * skinny_tma_blocks_per_sm(bn, stages, ncw) // batch)
        pb = _cdiv(tiles, _cdiv(tiles, slots))  # every block the same count of tiles
    return bn, _cdiv(kt, kps), kps, stages, ncw, pb, mc


def skinny_tma_smem(bn: int, stages: int, ncw: int = 2) -> int:
    """Dynamic shared memory of the TMA skinny kernel: alignment slack, the ring, the
    barriers and the partial tile ``[BN][64 * NCW + 4]`` float32."""
    bm = 64 * ncw
    return 1024 + stages * (bm * 64 * 2 + bn * 64 * 2) + 16 * stages + bn * (bm + 4) * 4


def _tma_max_stages(bn: int, ncw: int) -> int:
    """The deepest ring (at most 10 stages) whose shared memory a block may hold."""
    return max(st for st in range(2, 11) if skinny_tma_smem(bn, st, ncw) <= _SMEM_MAX)


def skinny_tma_blocks_per_sm(bn: int, stages: int, ncw: int) -> int:
    """Resident blocks of the TMA skinny kernel per multiprocessor (sm_90: 228 KiB of shared
    memory, 1 KiB of it reserved per block; 2048 threads)."""
    return max(1, min(228 * 1024 // (skinny_tma_smem(bn, stages, ncw) + 1024), 2048 // (128 * (ncw + 1))))


def plan_path(
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
        if sm90 and m > 16 and (_wide_weight(batch, n, k) or _narrow_large_weight(batch, n, k)):
            return "tma", skinny_tma_config(batch, m, n, k), 1, 0  # the TMA ring
        return "skinny", skinny_config(batch, m, n, k), 1, 0
    if not trans_b and gemv_ok and n % 8 == 0 and _gemv_rows_ok(m, n, k, sm90):
        return "gemv", None, 1, 0
    if sm90:
        return ("sm90", *_plan_sm90(batch, m, n, k, n_sm))
    wm = 2 if m > 64 and batch * _cdiv(m, 128) * _cdiv(n, 128) >= n_sm // 2 else 1
    tiles = batch * _cdiv(m, 64 * wm) * _cdiv(n, 128)
    kt = _cdiv(k, 32)
    s = _splits_for(tiles, kt, n_sm)
    return "sm80", wm, s, _cdiv(kt, s)


def _gemv_rows_ok(m: int, n: int, k: int, sm90: bool) -> bool:
    """Whether the GEMV serves ``m`` rows: one row always; with the TMA tiles available, up
    to 4 rows of a weight of at most ``_GEMV_SMALL_WEIGHT`` elements; else up to 8 rows."""
    if m == 1:
        return True
    if not sm90:
        return m <= GEMV_MAX_M
    return m <= 4 and k * n <= _GEMV_SMALL_WEIGHT


def gemv_config(m: int, n: int, k: int, cc: int) -> tuple[int, int, int, int]:
    """``(cluster slices of K, rows compiled for, lanes per row segment, prefetch)`` of the
    ``gemm_gemv`` kernel (b as (K, N)).

    Strips of ``8 * lanes`` columns (64 for ``N <= 1024``, else 128); on sm_90 a cluster of
    up to 8 blocks splits K (one launch, no workspace) until the grid holds two blocks per
    SM, each slice keeping at least 128 rows (one step of the block's row groups); the next
    step's rows are prefetched when a block of a cluster of at most 4 has at least 1024 rows
    (with 8 slices the prefetch lost: 1x4096x4096 16.7 -> 21.2 us). Measured on H100
    (``benchmarks/gemm.py --m 1``). Other GPUs: one slice.
    """
    lpr = 8 if n <= 1024 else 16
    strips = _cdiv(n, 8 * lpr)
    cl = 1
    if cc >= 90:
        while cl < 8 and strips * cl < 2 * _NOMINAL_SMS and k >= 256 * cl:
            cl *= 2
    mr = 1
    while mr < m:
        mr *= 2
    return cl, mr, lpr, int(cl <= 4 and k // cl >= 1024)


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
                _, _, s, _ = plan_path(batch, m, n, k, dt, tf32, sm90, _NOMINAL_SMS, gemv_ok, trans_b)
                most = max(most, s)
    return 0 if most == 1 else most * batch * m * n * 4


GEMM_PATHS = ("sm90", "sm80", "simt", "skinny", "tma")


@dataclass(frozen=True)
class GemmOverride(Override):
    """A GEMM path or geometry pinned by a test or benchmark (every field: the planner's
    choice when left at its default). Installed with :func:`..runtime.overrides`.

    A forced path that cannot run the call raises ``ShapeError`` (``sm90``: needs sm_90, 16-bit
    dtypes, ``K % 8 == 0``, ``N % 8 == 0``, aligned pointers; ``skinny``/``tma``: the decode
    shapes :func:`plan_path` gives them) or is ignored (``sm80`` for float32 without tf32,
    ``simt`` for 16-bit dtypes).

    Attributes:
        path: ``"sm90"``, ``"sm80"``, ``"simt"``, ``"skinny"`` or ``"tma"`` (the swapped-operand
            TMA skinny kernel).
        sm90_tile: ``"128x256"``, ``"128x128"`` or ``"64x128"`` (``path="sm90"``).
        splits: split-K slices of the ``sm90``/``sm80``/``simt`` paths.
        skinny_k_warps, skinny_tiles_per_warp, skinny_chunks: ``KS``, ``TR`` (1 or 2) and ``U``
            (1 to 8) of :func:`skinny_config`.
        tma_k_slices, tma_stages, tma_warpgroups, tma_multicast: ``CL``, ``STAGES`` (2 to 10),
            ``NCW`` (1 or 2) and ``MC`` (2 or 4; one K slice, not persistent) of
            :func:`skinny_tma_config`.
        tma_persistent: force (``True``) or forbid (``False``) the persistent TMA kernel.
        sm90_plain_epilogue: ``False`` compiles the general epilogue for plain products too.
        sm90_tma_store: ``False`` stores the sm_90 kernel's output from registers, never
            through shared memory and TMA.
    """

    path: str | None = None
    sm90_tile: str | None = None
    splits: int = 0
    skinny_k_warps: int = 0
    skinny_tiles_per_warp: int = 0
    skinny_chunks: int = 0
    tma_k_slices: int = 0
    tma_stages: int = 0
    tma_warpgroups: int = 0
    tma_persistent: bool | None = None
    tma_multicast: int = 0
    sm90_plain_epilogue: bool = True
    sm90_tma_store: bool = True

    def __post_init__(self) -> None:
        if self.path not in (None, *GEMM_PATHS):
            raise ValueError(f"GemmOverride: path={self.path!r}; use None or one of {GEMM_PATHS}")
        if self.sm90_tile is not None and (self.sm90_tile not in SM90_CONFIGS
                                           or self.path != "sm90"):
            raise ValueError(f"GemmOverride: sm90_tile={self.sm90_tile!r} needs path='sm90' and "
                             f"one of {tuple(SM90_CONFIGS)}")
        ints = ("splits", "skinny_k_warps", "skinny_tiles_per_warp", "skinny_chunks",
                "tma_k_slices", "tma_stages", "tma_warpgroups", "tma_multicast")
        for name in ints:
            v = getattr(self, name)
            if type(v) is not int or v < 0:
                raise TypeError(f"GemmOverride: {name} must be an int >= 0 (0: planned), got {v!r}")
        if self.tma_multicast not in (0, 1, 2, 4):
            raise ValueError(f"GemmOverride: tma_multicast={self.tma_multicast}; use 0, 1, 2 or 4")

    def tma_geometry(self) -> tuple[int, int, int, int, int]:
        """``(cl, stages, ncw, persist, mc)`` as :func:`skinny_tma_config` takes them."""
        persist = 0 if self.tma_persistent is None else 1 if self.tma_persistent else 2
        return (self.tma_k_slices, self.tma_stages, self.tma_warpgroups, persist,
                self.tma_multicast)
