"""GEMM: argument checks, the NumPy reference, and (GPU) the CUDA paths against float64."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import deviceops
from deviceops import api, kernels
from deviceops._errors import DTypeError, ShapeError
from deviceops.kernels.gemm import (  # the family package (deviceops.kernels.gemm is the function)
    GemmOverride,
    _act_np,
    _check_layout,
    _round_tf32,
    gemm_check,
    gemm_cuda,
    gemm_reference,
    gemm_workspace_nbytes,
    gemv_config,
    plan_path,
    skinny_config,
    skinny_tma_blocks_per_sm,
    skinny_tma_config,
    skinny_tma_smem,
)
from deviceops.kernels.runtime import overrides, plan_cache

from .conftest import to_np

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
ACTS = [None, "relu", "gelu", "silu"]
# ||out - ref|| / ||ref|| bounds per dtype (METHOD.md: f32 << 1e-3, tf32 ~ 3e-4, bf16 1e-3..1e-2)
TOL = {"float32": 1e-5, "tf32": 2e-4, "float16": 2e-3, "bfloat16": 1e-2}



def _forced(ov: GemmOverride | None) -> Any:
    """The GEMM override ``ov`` installed for a ``with`` block (``None``: the planner's path)."""
    return overrides(ov) if ov is not None else contextlib.nullcontext()


def _rel(out: np.ndarray, ref: np.ndarray, pre: np.ndarray | None = None) -> float:
    """||out - ref|| / ||ref||, or / max(||ref||, ||pre||) given the pre-activation values.

    An activation evaluated in fp32 has an absolute error of a few eps x |pre-activation|:
    the tanh-form GELU cancels in ``1 + tanh(z)`` below about x = -4, where the true output
    is ~1e-6 (an fp16 subnormal). On a one-element output that is a relative error of up
    to 1 with a correct kernel (0.4% of random (1,1,1) fp16 GELU cases, simulated), so
    errors are measured against the larger of the two norms.
    """
    o = out.astype(np.float64)
    r = ref.astype(np.float64)
    den = float(np.linalg.norm(r))
    if pre is not None:
        den = max(den, float(np.linalg.norm(pre.astype(np.float64))))
    return float(np.linalg.norm(o - r)) / (den or 1.0)


def _rand(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype[Any], scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(dtype)


# --------------------------------------------------------------------------- CPU: checks


def test_error_metric_tolerates_fp32_activation_cancellation() -> None:
    """A correct fp16 GELU output at x = -5 is "wrong" relative to itself, not to its input.

    The kernel's arithmetic is simulated on the cpu: fp32 products and epilogue, fp16 out.
    """
    rng = np.random.default_rng(7)
    a = rng.standard_normal(20_000).astype(F16)
    b = rng.standard_normal(20_000).astype(F16)
    bias = rng.standard_normal(20_000).astype(F16)
    v32 = a.astype(np.float32) * b.astype(np.float32) + bias.astype(np.float32)
    out = _act_np(v32, "gelu").astype(np.float32).astype(F16)
    v64 = a.astype(np.float64) * b.astype(np.float64) + bias.astype(np.float64)
    ref = _act_np(v64, "gelu")
    per_output = [_rel(out[i : i + 1], ref[i : i + 1]) for i in range(out.size)]
    with_pre = [_rel(out[i : i + 1], ref[i : i + 1], v64[i : i + 1]) for i in range(out.size)]
    assert max(per_output) > TOL["float16"]  # the old metric fails correct outputs
    assert max(with_pre) < TOL["float16"]


def test_check_returns_out_shape_and_dtype() -> None:
    assert gemm_check((3, 5), F32, (5, 7), F32) == ((3, 7), F32)
    assert gemm_check((2, 4, 3, 5), BF16, (5, 7), BF16) == ((2, 4, 3, 7), BF16)
    assert gemm_check((2, 3, 5), F16, (2, 5, 7), F16, bias_shape=(7,), bias_dtype=F16) == ((2, 3, 7), F16)


@pytest.mark.parametrize(
    ("a", "b", "kw", "err", "text"),
    [
        ((3, 5), (6, 7), {}, ShapeError, "K=5"),
        ((5,), (5, 7), {}, ShapeError, "at least 2 dims"),
        ((2, 3, 5), (3, 5, 7), {}, ShapeError, "leading dims"),
        ((0, 5), (5, 7), {}, ShapeError, ">= 1"),
        ((3, 5), (5, 7), {"out_shape": (3, 8)}, ShapeError, "(3, 8)"),
        ((3, 5), (5, 7), {"bias_shape": (3,)}, ShapeError, "bias"),
        ((3, 5), (5, 7), {"activation": "tanh"}, ValueError, "activation"),
    ],
)
def test_check_shape_errors(a: tuple[int, ...], b: tuple[int, ...], kw: dict[str, Any], err: type, text: str) -> None:
    with pytest.raises(err, match="gemm") as ei:
        gemm_check(a, F32, b, F32, **kw)
    assert text in str(ei.value)


def test_check_dtype_errors() -> None:
    with pytest.raises(DTypeError, match="float64"):
        gemm_check((3, 5), np.float64, (5, 7), np.float64)
    with pytest.raises(DTypeError, match="must match"):
        gemm_check((3, 5), F16, (5, 7), BF16)
    with pytest.raises(DTypeError, match="out"):
        gemm_check((3, 5), F16, (5, 7), F16, out_dtype=F32)
    with pytest.raises(DTypeError, match="bias"):
        gemm_check((3, 5), F16, (5, 7), F16, bias_shape=(7,), bias_dtype=F32)
    assert issubclass(ShapeError, ValueError) and issubclass(DTypeError, TypeError)


def test_layout_error_names_fix() -> None:
    a = np.zeros((4, 6), np.float32).T
    with pytest.raises(ShapeError, match=r"gemm.*\(6, 4\).*strides.*copy\(\)"):
        _check_layout("a", a.shape, a.strides, a.flags.c_contiguous, "gemm")


# --------------------------------------------------------------------------- CPU: reference


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("act", ACTS)
def test_reference_matches_float64(dtype: np.dtype[Any], act: str | None) -> None:
    rng = np.random.default_rng()
    for m, n, k, batch, bb in [(1, 1, 1, (), False), (7, 13, 31, (), False), (3, 5, 17, (2,), True),
                               (5, 11, 3, (2, 3), False)]:  # fmt: skip
        a = _rand(rng, (*batch, m, k), dtype)
        b = _rand(rng, ((*batch, k, n) if bb else (k, n)), dtype)
        bias = _rand(rng, (n,), dtype)
        c = _rand(rng, (*batch, m, n), dtype)
        out = gemm_reference(a, b, bias=bias, activation=act, alpha=0.5, beta=-1.5, c=c)
        assert out.dtype == dtype and out.shape == (*batch, m, n)
        pre = 0.5 * (a.astype(np.float64) @ b.astype(np.float64)) - 1.5 * c.astype(np.float64) + bias.astype(np.float64)
        v = pre
        if act == "relu":
            v = np.maximum(v, 0)
        elif act == "gelu":
            v = 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)))
        elif act == "silu":
            v = v / (1 + np.exp(-v))
        # bounded against the pre-activation values: a one-element GELU output can be an fp16
        # subnormal (-1e-6: 1.7% relative error from the output's rounding alone; CI, 2026-11-23)
        assert _rel(out, v, pre) < {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}[dtype.name]


def test_reference_beta_zero_ignores_c_and_tf32_rounds() -> None:
    a = np.ones((2, 3), np.float32)
    b = np.ones((3, 2), np.float32)
    c = np.full((2, 2), np.nan, np.float32)
    assert np.all(gemm_reference(a, b, c=c, beta=0.0) == 3.0)
    x = np.array([[1.0 + 2.0**-12]], np.float32)
    assert gemm_reference(x, np.ones((1, 1), np.float32), tf32=True)[0, 0] == 1.0
    assert gemm_reference(x, np.ones((1, 1), np.float32))[0, 0] == x[0, 0]


def test_workspace_nbytes() -> None:
    assert gemm_workspace_nbytes((4096, 4096), (4096, 4096), BF16) == 0
    ws = gemm_workspace_nbytes((64, 768), (768, 768), BF16)
    assert ws > 0 and ws % (768 * 4) == 0


# --------------------------------------------------------------------------- CPU: trans_b


def test_check_trans_b_shapes_and_messages() -> None:
    assert gemm_check((3, 5), F16, (7, 5), F16, trans_b=True) == ((3, 7), F16)
    assert gemm_check((2, 3, 5), BF16, (2, 7, 5), BF16, trans_b=True) == ((2, 3, 7), BF16)
    with pytest.raises(ShapeError) as ei:  # a (K, N) weight with trans_b=True
        gemm_check((3, 5), F32, (5, 7), F32, trans_b=True)
    msg = str(ei.value)
    assert "(3, 5)" in msg and "(5, 7)" in msg and "trans_b=True" in msg and "pass trans_b=False" in msg
    with pytest.raises(ShapeError) as ei:  # an (N, K) weight without the flag
        gemm_check((3, 5), F32, (7, 5), F32)
    msg = str(ei.value)
    assert "(7, 5)" in msg and "trans_b=False" in msg and "pass trans_b=True" in msg
    with pytest.raises(ShapeError, match="leading dims"):
        gemm_check((2, 3, 5), F32, (3, 7, 5), F32, trans_b=True)
    with pytest.raises(ShapeError, match=r"\(3, 8\)"):
        gemm_check((3, 5), F32, (7, 5), F32, out_shape=(3, 8), trans_b=True)


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_reference_trans_b_is_the_transpose(dtype: np.dtype[Any]) -> None:
    rng = np.random.default_rng()
    for ashape, wshape in [((7, 13), (5, 13)), ((2, 3, 9), (2, 4, 9)), ((1, 64), (33, 64))]:
        a, w = _rand(rng, ashape, dtype), _rand(rng, wshape, dtype)
        bias = _rand(rng, (wshape[-2],), dtype)
        got = gemm_reference(a, w, bias=bias, activation="silu", trans_b=True)
        want = gemm_reference(a, np.swapaxes(w, -1, -2).copy(), bias=bias, activation="silu")
        assert got.shape == want.shape and np.array_equal(got.view(np.uint8), want.view(np.uint8))


def test_plan_paths_for_inference_shapes() -> None:
    plan = plan_path
    for m in (1, 8, 16):
        assert plan(1, m, 4096, 4096, BF16, False, True, 132, True, True, True)[0] == "skinny"
    for m in (17, 32, 64):  # a narrow 32 MB weight, M > 16: the TMA kernel on sm_90, else skinny
        assert plan(1, m, 4096, 4096, BF16, False, True, 132, True, True, True)[0] == "tma"
        assert plan(1, m, 4096, 4096, BF16, False, False, 132, True, True, True)[0] == "skinny"
    assert plan(1, 32, 6144, 4096, BF16, False, True, 132, True, True, True)[0] == "skinny"  # 8B qkv
    assert plan(1, 65, 4096, 4096, BF16, False, True, 132, True, True, True)[0] == "sm90"
    for m, n, k in ((17, 14336, 4096), (32, 128256, 4096), (64, 49152, 576)):  # wide weights, M > 16, sm_90
        assert plan(1, m, n, k, BF16, False, True, 132, True, True, True)[0] == "tma"
        assert plan(1, m, n, k, BF16, False, False, 132, True, True, True)[0] == "skinny"
    assert plan(1, 16, 14336, 4096, BF16, False, True, 132, True, True, True)[0] == "skinny"
    assert plan(1, 32, 8192, 256, BF16, False, True, 132, True, True, True)[0] == "skinny"  # 4 MB: small
    assert plan(1, 1, 4096, 4096, BF16, False, True, 132, True, False, True)[0] == "gemv"  # (K, N) b
    assert plan(1, 8, 4096, 4096, BF16, False, True, 132, True, False, True)[0] == "sm90"
    assert plan(1, 8, 4096, 4096, BF16, False, True, 132, True, True, False)[0] == "sm90"  # misaligned
    assert plan(1, 8, 4096, 4096, F32, False, True, 132, True, True, True)[0] == "simt"


@pytest.mark.parametrize("m", [1, 8, 9, 32, 33, 64])
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (14336, 4096), (4096, 14336), (1728, 576), (576, 1536),
                                      (49152, 576), (8, 8), (24, 40)])
def test_skinny_config_covers_k_and_fits_registers(m: int, n: int, k: int) -> None:
    mf, tr, u, ks, kcw = skinny_config(1, m, n, k)
    chunks = -(-k // 32)
    assert 8 * mf >= m > 8 * (mf - 1)
    assert 1 <= ks <= 8 and ks * kcw >= chunks and (ks - 1) * kcw < chunks  # every chunk, no idle warp
    assert u * (8 * tr + 4 * mf) <= 96 or u == 1  # registers of loads in flight
    assert 1 <= u <= kcw and tr in (1, 2)  # never more chunks a round than a warp has
    assert ks * tr * mf * 512 <= 64 * 1024  # reduction buffer (dynamic shared memory)
    assert skinny_config(1, m, n, k, ks=3)[3] <= 3


def test_skinny_config_measured_rules() -> None:
    """The H100 sweep's choices (benchmarks/gemm.py --variants): 8 chunks in flight for one
    m-fragment on weights >= 64 MB; 1 tile per warp, 4 warps, 4 chunks for M > 16 on large
    weights up to N = 6144; 2 tiles per warp on wider ones; small weights unchanged."""
    c = skinny_config
    assert c(1, 1, 14336, 4096) == (1, 1, 8, 8, 16) and c(1, 8, 4096, 14336)[2] == 8
    assert c(1, 1, 4096, 4096) == (1, 1, 4, 8, 16)  # 32 MB: 4 chunks
    assert c(1, 32, 4096, 4096) == (4, 1, 4, 4, 32) and c(1, 32, 6144, 4096)[:4] == (4, 1, 4, 4)
    assert c(1, 32, 14336, 4096) == (4, 2, 2, 4, 32)
    assert c(1, 32, 576, 576) == (4, 1, 3, 6, 3)  # 18 chunks over 6 warps: 3 a round


@pytest.mark.parametrize("m", [1, 17, 32, 33, 64])
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (14336, 4096), (4096, 14336), (49152, 576), (8, 8), (100, 72)])
def test_skinny_tma_config_covers_k_and_fits_shared_memory(m: int, n: int, k: int) -> None:
    bn, cl, kps, stages, ncw, pb, mc = skinny_tma_config(1, m, n, k)
    kt = -(-k // 64)
    assert bn in (32, 64) and bn >= m and 1 <= cl <= 8 and cl * kps >= kt and (cl - 1) * kps < kt
    assert skinny_tma_smem(bn, stages, ncw) <= 227 * 1024
    # 64-row tiles for narrow weights and the persistent short-K kernel, else 128
    persistent = kt <= 16 and n > 4096 and -(-n // 64) > 2 * 132
    assert ncw == (1 if n <= 4096 or persistent else 2) and (pb > 0) == persistent
    for w in (1, 2):  # a forced warpgroup count keeps the slices covering K
        bn1, cl1, kps1, st1, w1, _, _ = skinny_tma_config(1, m, n, k, ncw=w)
        assert w1 == w and cl1 * kps1 >= kt and (cl1 - 1) * kps1 < kt
        assert skinny_tma_smem(bn1, st1, w1) <= 227 * 1024
    if ncw == 1 and not persistent and kt >= 8:  # narrow: 64 tiles x 2 slices, a deep ring
        assert (cl, stages) == (2 if n == 4096 else min(8, kt // 4), 8 if bn == 32 else 6)
    elif persistent:
        assert cl == 1 and stages == (6 if bn == 32 else 4)
        assert skinny_tma_smem(bn, stages, ncw) <= 113 * 1024  # two blocks an SM
    elif ncw == 1:  # a narrow weight of a few k-tiles: the ring no deeper than the slice
        assert stages <= max(2, kps)
    elif cl > 1 or kps < 16:
        assert skinny_tma_smem(bn, stages) <= 113 * 1024  # two blocks an SM
    else:  # one long slice a block: a deeper ring (one block an SM)
        assert stages == (6 if bn == 32 else 3)
    assert skinny_tma_config(1, m, n, k, cl=3, persist=2)[1] <= 3
    one_wave = bn == 32 and ncw == 2 and cl == 1 and not persistent and 4 <= -(-n // 128) <= 132
    assert mc == (4 if one_wave else 1)  # activation multicast: one wave of 128-row tiles
    assert skinny_tma_config(1, 32, 14336, 4096) == (32, 1, 64, 6, 2, 0, 4)  # 112 tiles, one slice
    assert skinny_tma_config(1, 32, 4096, 4096) == (32, 2, 32, 8, 1, 0, 1)  # 64 tiles x 2 slices
    assert skinny_tma_config(1, 32, 14336, 4096, stages=10, mc=4)[3:] == (10, 2, 0, 4)
    assert skinny_tma_config(1, 32, 4096, 4096, mc=4)[6] == 1  # two K slices: no multicast
    assert skinny_tma_config(1, 64, 14336, 4096, stages=10, mc=3)[3::3] == (8, 2)  # smem; 2 or 4
    assert skinny_tma_config(1, 32, 4096, 4096, ncw=2)[:3] == (32, 4, 16)  # 32 tiles x 4
    assert skinny_tma_config(1, 32, 49152, 576)[4:] == (1, 256, 1)  # 768 tiles, 3 a block


@pytest.mark.parametrize(("batch", "n", "ncw", "stages"), [(1, 49152, 1, 4), (1, 49152, 2, 4), (1, 128256, 2, 6),
                                                          (3, 4104, 1, 4), (2, 100, 2, 3), (1, 14336, 1, 6)])
def test_skinny_tma_persistent_grid_gives_each_block_the_same_tile_count(batch: int, n: int, ncw: int,
                                                                         stages: int) -> None:
    bn, cl, _, st, w, pb, _ = skinny_tma_config(batch, 32, n, 576, stages=stages, ncw=ncw, persist=1)
    tiles = -(-n // (64 * w))
    per_block = -(-tiles // pb)
    slots = 132 * skinny_tma_blocks_per_sm(bn, st, w)
    assert cl == 1 and w == ncw and st == stages
    assert batch * pb <= max(slots, batch)  # one wave of resident blocks
    assert pb * per_block >= tiles and (pb - 1) * per_block < tiles  # every tile, no idle block
    assert per_block == -(-tiles // max(1, slots // batch))  # as few tiles a block as fit
    planned = skinny_tma_config(batch, 32, n, 576)[5] > 0
    assert planned == (batch * n > 4096 and batch * -(-n // 64) > 2 * 132)  # short K, many tiles


def test_tma_launch_packs_maps_pointers_and_scalars(monkeypatch: pytest.MonkeyPatch) -> None:
    """The TMA kernels' launch (kernels/runtime/_tma.py) without a GPU: one map per (key index,
    geometry), then the three pointers and the typed scalars; a repeated pointer set reuses its
    packed block, a fresh pointer encodes only the maps that changed."""
    import ctypes
    import types

    from deviceops.kernels.runtime import _tma

    encoded: list[tuple[int, tuple[int, ...]]] = []

    def enc(tm_addr: int, dtype: int, rank: int, ptr: int, gdim: int, gstr: int, box: int, estr: int,
            *rest: int) -> int:
        dims = tuple((ctypes.c_uint64 * 3).from_address(gdim))
        encoded.append((ptr, dims))
        ctypes.c_uint64.from_address(tm_addr).value = ptr  # mark the map with its pointer
        return 0

    monkeypatch.setattr(_tma, "_encoder", lambda: enc)
    monkeypatch.setattr(_tma, "_tma_cache", type(_tma._tma_cache)())
    monkeypatch.setattr(_tma, "pdl_enabled", lambda dev: False)
    monkeypatch.setattr(_tma, "function_ptr", lambda fn, dev: int(fn.kernel.ptr))  # (no CuPy)
    launched: list[tuple[int, ...]] = []
    monkeypatch.setattr(_tma, "launch_packed", lambda ln, g, b, smem, sp, entry: launched.append((g, smem, entry[0])))
    fn = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=42))
    geo_a = ((64, 5, 1), (128, 640), (64, 128, 1))
    geo_b = ((64, 40, 1), (128, 5120), (64, 256, 1))
    geo_c = ((40, 5, 1), (80, 400), (64, 64, 1))
    tail = ((ctypes.c_int32, 7), (ctypes.c_float, 0.5))
    tl = _tma.TmaLaunch(fn, 0, (2, 1, 1), (384, 1, 1), 1000, ((0, geo_a), (1, geo_b), (2, geo_c)), tail)
    tl((0x1000, 0x2000, 0x3000, 0x4000, 0x5000), 77)
    assert [p for p, _ in encoded] == [0x1000, 0x2000, 0x3000]
    params = (ctypes.c_void_p * 8).from_address(launched[0][2])
    maps = [ctypes.c_uint64.from_address(params[i]).value for i in range(3)]
    assert maps == [0x1000, 0x2000, 0x3000]
    assert [ctypes.c_void_p.from_address(params[i]).value for i in range(3, 6)] == [0x3000, 0x4000, 0x5000]
    assert ctypes.c_int32.from_address(params[6]).value == 7 and ctypes.c_float.from_address(params[7]).value == 0.5
    tl((0x1000, 0x2000, 0x3000, 0x4000, 0x5000), 77)  # same pointers: the packed block again
    assert len(encoded) == 3 and launched[1][2] == launched[0][2]
    tl((0x1000, 0x2000, 0x6000, 0x4000, 0x5000), 77)  # a fresh output: only its map is encoded
    assert [p for p, _ in encoded[3:]] == [0x6000] and launched[2][:2] == ((2, 1, 1), 1000)


def test_workspace_nbytes_trans_b() -> None:
    assert gemm_workspace_nbytes((4096, 4096), (4096, 4096), BF16, True) == 0
    assert gemm_workspace_nbytes((8, 4096), (1024, 4096), BF16, True) == gemm_workspace_nbytes(
        (8, 4096), (4096, 1024), BF16)
    assert gemm_workspace_nbytes((64, 768), (768, 768), BF16, True) == gemm_workspace_nbytes(
        (64, 768), (768, 768), BF16)


def _weight_case(rng: np.random.Generator, dtype: np.dtype[Any], m: int, n: int, k: int,
                 batch: tuple[int, ...] = (), b_batched: bool = False) -> tuple[np.ndarray, ...]:
    a = _rand(rng, (*batch, m, k), dtype)
    w = _rand(rng, ((*batch, n, k) if b_batched else (n, k)), dtype, 1 / math.sqrt(k))
    bias = _rand(rng, (n,), dtype)
    return a, w, bias


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_kernel_op_trans_b_matches_float64(dtype: np.dtype[Any], stream: deviceops.Stream) -> None:
    """``kernels.gemm/matmul(..., trans_b=True)`` on the default device (cpu in CI), poisoned out."""
    rng = np.random.default_rng()
    for m, n, k, batch, bb, act in [(1, 24, 40, (), False, "silu"), (7, 33, 64, (), False, None),
                                    (5, 1000, 72, (2,), False, "gelu"), (3, 24, 16, (2,), True, "relu"),
                                    (33, 57, 128, (), False, None)]:  # fmt: skip
        a, w, bias = _weight_case(rng, dtype, m, n, k, batch, bb)
        ta, tw, tbias = (api.from_host(x).sync_on(stream) for x in (a, w, bias))
        out = api.full((*batch, m, n), float("nan"), dtype.name if dtype != BF16 else "bfloat16").sync_on(stream)
        got = kernels.gemm(ta, tw, out, bias=tbias, activation=act, trans_b=True).sync_on(stream)
        assert got is out
        ref64, pre64 = _ref64(a, np.swapaxes(w, -1, -2), bias, {"alpha": 1.0, "beta": 0.0, "act": act}, a, False)
        err = _rel(to_np(out), ref64, pre64)
        assert err < TOL[dtype.name], (m, n, k, batch, bb, act, err)
        mm = kernels.matmul(ta, tw, trans_b=True).sync_on(stream)
        ref_mm = np.matmul(a.astype(np.float64), np.swapaxes(w, -1, -2).astype(np.float64))
        assert _rel(to_np(mm), ref_mm) < TOL[dtype.name]


def test_kernel_op_trans_b_errors_before_launch(stream: deviceops.Stream) -> None:
    a = api.zeros((3, 5)).sync_on(stream)
    w_kn = api.zeros((5, 7)).sync_on(stream)
    seq = stream.seq
    with pytest.raises(ShapeError, match=r"gemm: .*\(3, 5\).*\(5, 7\).*trans_b=True"):
        kernels.gemm(a, w_kn, trans_b=True).sync_on(stream)
    with pytest.raises(ShapeError, match=r"matmul: .*trans_b=True"):
        kernels.matmul(a, w_kn, trans_b=True).sync_on(stream)
    assert stream.seq == seq  # nothing enqueued


# --------------------------------------------------------------------------- GPU

def _cupy() -> Any:
    try:
        import cupy
    except Exception as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"cupy not importable: {exc}")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA GPU")
    except Exception as exc:  # pragma: no cover
        pytest.skip(f"no CUDA GPU: {exc}")
    return cupy


_SIZES = [1, 2, 3, 5, 7, 8, 13, 16, 31, 33, 61, 64, 65, 97, 127, 128, 129, 191, 255, 257, 263, 320, 383, 509, 640]


def _case(rng: np.random.Generator, cc: int) -> dict[str, Any]:
    kind = rng.choice(["float32", "tf32", "float16", "bfloat16", "float16", "bfloat16"])
    dtype = {"float32": F32, "tf32": F32, "float16": F16, "bfloat16": BF16}[str(kind)]
    aligned = rng.random() < 0.5

    def dim() -> int:
        v = int(rng.choice(_SIZES))
        return max(8, v // 8 * 8) if aligned else v

    m = int(rng.choice(_SIZES))
    n, k = dim(), dim()
    nb = int(rng.choice([0, 0, 0, 1, 2]))
    batch = tuple(int(x) for x in rng.integers(1, 4, size=nb))
    b_batched = nb > 0 and rng.random() < 0.5
    trans_b = bool(rng.random() < 0.5)
    if trans_b and rng.random() < 0.4:  # decode-sized: the skinny path
        m = int(rng.choice([1, 2, 3, 5, 8, 9, 16, 17, 31, 33, 64]))
        batch = batch if b_batched else ()
    force = None
    if dtype != F32 and rng.random() < 0.6:
        opts = [GemmOverride(path="sm80"), GemmOverride(path="sm80", splits=3)]
        if cc == 90 and n % 8 == 0 and k % 8 == 0:
            opts += [GemmOverride(path="sm90", sm90_tile="128x256"), GemmOverride(path="sm90", sm90_tile="128x128"), GemmOverride(path="sm90", sm90_tile="64x128"), GemmOverride(path="sm90", sm90_tile="64x128", splits=3), GemmOverride(path="sm90", sm90_tile="128x128", splits=2)]
        rows = m if b_batched else m * math.prod(batch)
        if trans_b and k % 8 == 0 and rows <= 64:
            opts += [GemmOverride(path="skinny"), GemmOverride(path="skinny"), GemmOverride(path="skinny", skinny_k_warps=1), GemmOverride(path="skinny", skinny_k_warps=3)]
            if cc == 90:
                opts += [GemmOverride(path="tma"), GemmOverride(path="tma", tma_k_slices=1), GemmOverride(path="tma", tma_k_slices=3), GemmOverride(path="tma", tma_k_slices=1, tma_stages=6), GemmOverride(path="tma", tma_warpgroups=1), GemmOverride(path="tma", tma_k_slices=2, tma_stages=6, tma_warpgroups=1), GemmOverride(path="tma", tma_warpgroups=1, tma_persistent=True), GemmOverride(path="tma", tma_warpgroups=2, tma_persistent=True),
                         GemmOverride(path="tma", tma_k_slices=1, tma_stages=10, tma_warpgroups=2, tma_persistent=False, tma_multicast=4), GemmOverride(path="tma", tma_k_slices=1, tma_warpgroups=1, tma_persistent=False, tma_multicast=2)]
        force = opts[int(rng.integers(0, len(opts)))]
    elif dtype == F32 and kind == "float32" and rng.random() < 0.3:
        force = GemmOverride(path="simt", splits=3)
    return {
        "kind": str(kind), "dtype": dtype, "m": m, "n": n, "k": k, "batch": batch, "b_batched": b_batched,
        "bias": bool(rng.random() < 0.5), "act": ACTS[int(rng.integers(0, 4))],
        "alpha": float(rng.choice([1.0, 0.5, -2.0])), "beta": float(rng.choice([0.0, 0.0, 1.0, -0.5])),
        "force": force, "trans_b": trans_b,
    }  # fmt: skip


def _run_case(cupy: Any, rng: np.random.Generator, cs: dict[str, Any], stream: Any) -> float:
    dt, m, n, k, batch = cs["dtype"], cs["m"], cs["n"], cs["k"], cs["batch"]
    tb = bool(cs.get("trans_b", False))
    a = _rand(rng, (*batch, m, k), dt)
    b = _rand(rng, ((*batch, k, n) if cs["b_batched"] else (k, n)), dt)
    b_given = np.ascontiguousarray(np.swapaxes(b, -1, -2)) if tb else b  # (N, K) with trans_b
    bias = _rand(rng, (n,), dt) if cs["bias"] else None
    c = _rand(rng, (*batch, m, n), dt)
    tf32 = cs["kind"] == "tf32"
    ref = gemm_reference(a, b_given, bias=bias, activation=cs["act"], alpha=cs["alpha"], beta=cs["beta"],
                               c=c, tf32=tf32, trans_b=tb)  # fmt: skip
    # float64 "true" reference for the error bound (tf32 compares against its rounded operands)
    ref64, pre64 = _ref64(a, b, bias, cs, c, tf32)
    da, db = cupy.asarray(a), cupy.asarray(b_given)
    dbias = cupy.asarray(bias) if bias is not None else None
    # poison: every element must be written (beta != 0 starts from c instead)
    dout = cupy.asarray(c) if cs["beta"] != 0.0 else cupy.full((*batch, m, n), np.nan, dtype=dt)
    nbytes = gemm_workspace_nbytes(a.shape, b_given.shape, dt, tb)
    ws = cupy.empty(max(nbytes, 12 * c.size) // 4 + 1, dtype=np.float32)
    # the poison fill ran on CuPy's legacy default stream, which a non-blocking `stream` does
    # not wait for: without this a fast kernel could finish before the fill overwrites it
    cupy.cuda.Device().synchronize()
    with _forced(cs["force"]):
        gemm_cuda(da, db, dout, bias=dbias, activation=cs["act"], alpha=cs["alpha"], beta=cs["beta"],
                        tf32=tf32, trans_b=tb, workspace=ws, stream=stream)  # fmt: skip
    stream.synchronize()
    out = cupy.asnumpy(dout)
    assert not np.isnan(out.astype(np.float32)).any(), f"unwritten / NaN outputs for {cs}"
    assert out.shape == ref.shape and out.dtype == ref.dtype
    return _rel(out, ref64, pre64)


def _ref64(a: np.ndarray, b: np.ndarray, bias: np.ndarray | None, cs: dict[str, Any], c: np.ndarray,
           tf32: bool) -> tuple[np.ndarray, np.ndarray]:
    """float64 output and pre-activation values."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    if tf32:
        a64 = _round_tf32(a).astype(np.float64)
        b64 = _round_tf32(b).astype(np.float64)
    v = cs["alpha"] * (a64 @ b64)
    if cs["beta"] != 0.0:
        v = v + cs["beta"] * c.astype(np.float64)
    if bias is not None:
        v = v + bias.astype(np.float64)
    return _act_np(v, cs["act"]), v


@pytest.mark.gpu
def test_gpu_random_shapes_vs_float64() -> None:
    cupy = _cupy()
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    cc = int(cupy.cuda.Device().compute_capability)
    stream = cupy.cuda.Stream(non_blocking=True)
    n_cases = int(os.environ.get("GEMM_TEST_CASES", "220"))
    worst: dict[str, float] = {}
    fails = []
    for _ in range(n_cases):
        cs = _case(rng, cc)
        err = _run_case(cupy, rng, cs, stream)
        worst[cs["kind"]] = max(worst.get(cs["kind"], 0.0), err)
        if not err < TOL[cs["kind"]]:
            fails.append((err, cs))
    print(f"seed={seed} worst rel err per kind: {worst}")
    assert not fails, f"seed={seed}: {len(fails)} mismatches, first: {fails[:3]}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_gpu_edge_shapes(dtype: np.dtype[Any]) -> None:
    cupy = _cupy()
    seed = int(np.random.SeedSequence().entropy % 2**32)  # fresh inputs, reproducible from the message
    rng = np.random.default_rng(seed)
    stream = cupy.cuda.Stream(non_blocking=True)
    kind = dtype.name
    for m, n, k in [(1, 1, 1), (1, 768, 768), (2, 3, 5), (128, 768, 768), (257, 264, 1000), (64, 8, 4096),
                    (1, 8, 8), (300, 512, 72)]:  # fmt: skip
        for act in ACTS:
            for tb in (False, True):
                cs = {"kind": kind, "dtype": dtype, "m": m, "n": n, "k": k, "batch": (), "b_batched": False,
                      "bias": True, "act": act, "alpha": 1.0, "beta": 0.0, "force": None, "trans_b": tb}  # fmt: skip
                err = _run_case(cupy, rng, cs, stream)
                assert err < TOL[kind], f"seed={seed} err={err:.3g} > {TOL[kind]} for m,n,k={m},{n},{k}: {cs}"


@pytest.mark.gpu
def test_gpu_tma_store_epilogue_matches_register_store() -> None:
    """The sm_90 epilogue through shared memory and TMA writes exactly what the register
    epilogue writes (same arithmetic), on tails in M and N, batches and every epilogue
    without beta; and it is within the float64 bound."""
    cupy = _cupy()
    if int(cupy.cuda.Device().compute_capability) != 90:
        pytest.skip("the TMA-store epilogue is sm_90 only")
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    stream = cupy.cuda.Stream(non_blocking=True)
    for (m, n, k, batch), force in itertools.product(
        [(67, 136, 200, ()), (300, 520, 72, (2,)), (129, 264, 1000, ())], [GemmOverride(path="sm90", sm90_tile="128x256"), GemmOverride(path="sm90", sm90_tile="128x128"), GemmOverride(path="sm90", sm90_tile="64x128")]
    ):
        for dt, act, bias in ((BF16, None, False), (F16, "silu", True), (BF16, "gelu", True)):
            ah, bh = _rand(rng, (*batch, m, k), dt), _rand(rng, (n, k), dt)
            bvh = _rand(rng, (n,), dt) if bias else None
            a, b = cupy.asarray(ah), cupy.asarray(bh)
            bv = cupy.asarray(bvh) if bvh is not None else None
            outs = []
            for tma_store in (True, False):
                o = cupy.full((*batch, m, n), np.nan, dtype=dt)
                cupy.cuda.Device().synchronize()
                with overrides(dataclasses.replace(force, sm90_tma_store=tma_store)):
                    gemm_cuda(a, b, o, bias=bv, activation=act, alpha=0.5, trans_b=True, stream=stream)
                stream.synchronize()
                outs.append(cupy.asnumpy(o))
            assert not np.isnan(outs[0].astype(np.float32)).any(), f"unwritten outputs {force} {m},{n},{k}"
            np.testing.assert_array_equal(outs[0].view(np.uint16), outs[1].view(np.uint16),
                                          err_msg=f"{force} m,n,k={m},{n},{k} batch={batch} act={act}")
            # both against the float64 reference (an epilogue both paths share could be wrong)
            cs = {"alpha": 0.5, "beta": 0.0, "act": act}
            ref64, pre64 = _ref64(ah, np.ascontiguousarray(bh.T), bvh, cs, ah[..., :0], False)
            err = _rel(outs[0], ref64, pre64)
            kind = np.dtype(dt).name
            assert err < TOL[kind], (f"{force} m,n,k={m},{n},{k} batch={batch} act={act}: "
                                     f"relative error {err:.3g} > {TOL[kind]}")


@pytest.mark.gpu
def test_gpu_back_to_back_dependent_gemms() -> None:
    """Each GEMM reads the previous one's output with no host sync between (on sm_90 they go
    out with programmatic dependent launch and must wait for their predecessor), over every
    path: sm_90 tiles (with and without clusters and split-K), skinny, TMA skinny, GEMV."""
    cupy = _cupy()
    stream = cupy.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    cc = int(cupy.cuda.Device().compute_capability)
    forces: list[GemmOverride | None] = [None, GemmOverride(path="sm80"), GemmOverride(path="skinny")]
    if cc == 90:
        forces += [GemmOverride(path="sm90", sm90_tile="128x256"), GemmOverride(path="sm90", sm90_tile="64x128", splits=4), GemmOverride(path="tma")]
    for m, d in ((1, 512), (32, 512), (200, 1024)):
        for force in forces:
            if force is not None and force.path in ("skinny", "tma") and m > 64:
                continue
            w = (rng.standard_normal((d, d)) / math.sqrt(d)).astype(F16)  # (N, K)
            x0 = rng.standard_normal((m, d)).astype(F16)
            dw = cupy.asarray(w)
            xs = [cupy.asarray(x0)] + [cupy.full((m, d), np.nan, dtype=F16) for _ in range(6)]
            ws = cupy.empty(gemm_workspace_nbytes((m, d), (d, d), F16, True) // 4 + 8 * m * d, dtype=np.float32)
            cupy.cuda.Device().synchronize()
            with _forced(force):
                for i in range(6):
                    gemm_cuda(xs[i], dw, xs[i + 1], trans_b=True, workspace=ws, stream=stream)
            stream.synchronize()
            ref = x0.astype(np.float64)
            for i in range(6):
                ref = ref @ w.astype(np.float64).T
                out = cupy.asnumpy(xs[i + 1]).astype(np.float64)
                rel = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
                assert rel < 2e-2, f"{force} m={m} d={d}: step {i} rel err {rel:.3g}"
                ref = out  # compare each step against the product of what it was given


@pytest.mark.gpu
def test_gpu_refuses_before_launch() -> None:
    cupy = _cupy()
    stream = cupy.cuda.Stream(non_blocking=True)
    a = cupy.ones((64, 32), dtype=np.float16)
    b = cupy.ones((48, 64), dtype=np.float16)
    out = cupy.full((32, 48), np.nan, dtype=np.float16)
    with pytest.raises(ShapeError, match=r"gemm.*\(32, 64\).*strides.*copy\(\)"):
        gemm_cuda(a.T, b.T, out, stream=stream)
    with pytest.raises(ShapeError, match="gemm"):
        gemm_cuda(a, b, out, stream=stream)
    with pytest.raises(DTypeError, match="gemm"):
        gemm_cuda(a.T.copy(), b.T.copy(), out.astype(np.float32), stream=stream)
    stream.synchronize()
    assert bool(cupy.isnan(out).all())  # nothing was launched


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_gpu_skinny_trans_b_odd_shapes(dtype: np.dtype[Any]) -> None:
    """The skinny paths (trans_b, M <= 64: registers only and, on sm_90, the swapped-operand
    TMA kernel with its cluster K slices) on odd M / N and K % 8 == 0 (tails in every dim)."""
    cupy = _cupy()
    cc = int(cupy.cuda.Device().compute_capability)
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    stream = cupy.cuda.Stream(non_blocking=True)
    shapes = [(1, 1, 8), (1, 17, 40), (3, 33, 584), (7, 130, 1000), (8, 576, 576), (9, 1728, 576), (16, 24, 8),
              (17, 61, 1544), (31, 257, 264), (32, 576, 1536), (33, 100, 72), (63, 40, 136), (64, 129, 4096),
              (33, 2056, 2048), (20, 4104, 1032),  # weights > 8 MB (two row tiles per warp)
              (33, 26008, 200), (17, 49160, 72),  # short K, 400+ tiles: several tiles a persistent block
              (24, 9000, 520)]  # 71 tiles, one K slice: planned activation multicast, a padded cluster
    for i, (m, n, k) in enumerate(shapes):
        act = ACTS[i % 4]
        beta = -0.5 if i % 3 == 0 else 0.0
        forces: tuple[GemmOverride | None, ...] = (GemmOverride(path="skinny"), GemmOverride(path="skinny", skinny_k_warps=1), None)
        if cc == 90:  # the TMA kernel: planned K slices, one slice, three; one consumer warpgroup
            forces += (GemmOverride(path="tma"), GemmOverride(path="tma", tma_k_slices=1), GemmOverride(path="tma", tma_k_slices=3), GemmOverride(path="tma", tma_warpgroups=1), GemmOverride(path="tma", tma_k_slices=3, tma_warpgroups=1), GemmOverride(path="tma", tma_warpgroups=1, tma_persistent=True), GemmOverride(path="tma", tma_stages=3, tma_warpgroups=2, tma_persistent=True),
                       GemmOverride(path="tma", tma_k_slices=1, tma_stages=10, tma_warpgroups=2, tma_persistent=False, tma_multicast=4), GemmOverride(path="tma", tma_k_slices=1, tma_stages=4, tma_warpgroups=1, tma_persistent=False, tma_multicast=2))
        for force in forces:
            cs = {"kind": dtype.name, "dtype": dtype, "m": m, "n": n, "k": k, "batch": (), "b_batched": False,
                  "bias": i % 2 == 0, "act": act, "alpha": 0.5 if i % 2 else 1.0, "beta": beta, "force": force,
                  "trans_b": True}  # fmt: skip
            err = _run_case(cupy, rng, cs, stream)
            assert err < TOL[dtype.name], f"seed={seed} err={err:.3g}: {cs}"
    # batched weights (b_batched) and a batch folded into M
    cases = itertools.product((((3,), True), ((2, 3), False)), (GemmOverride(path="skinny"), GemmOverride(path="tma", tma_k_slices=2), GemmOverride(path="tma", tma_warpgroups=1, tma_persistent=True)))
    for (batch, bb), force in cases:
        if force.path == "tma" and cc != 90:
            continue
        n = 20000 if force == GemmOverride(path="tma", tma_warpgroups=1, tma_persistent=True) else 72  # persistent: several tiles a block in each batch entry
        cs = {"kind": dtype.name, "dtype": dtype, "m": 5, "n": n, "k": 200, "batch": batch, "b_batched": bb,
              "bias": True, "act": "gelu", "alpha": 1.0, "beta": 0.0, "force": force, "trans_b": True}  # fmt: skip
        err = _run_case(cupy, rng, cs, stream)
        assert err < TOL[dtype.name], f"seed={seed} err={err:.3g}: {cs}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_gpu_gemv_b_kn_odd_shapes(dtype: np.dtype[Any]) -> None:
    """The GEMV path (b as (K, N), M <= 8): K slices of a cluster (K from 1 to 4103, K % 8 != 0
    included), strip tails in N, every row count, batched weights, epilogues; deterministic."""
    cupy = _cupy()
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    stream = cupy.cuda.Stream(non_blocking=True)
    shapes = [(1, 8, 1), (1, 136, 7), (2, 264, 255), (3, 4096, 256), (4, 520, 511), (1, 1000, 1024),
              (1, 128, 1543), (1, 2056, 3001), (1, 4104, 4103), (1, 4096, 4096), (4, 576, 1536), (1, 49160, 584),
              (1, 14336, 4096)]
    for i, (m, n, k) in enumerate(shapes):
        assert plan_path(1, m, n, k, dtype, False, True, 132, True, False, True)[0] == "gemv"
        cs = {"kind": dtype.name, "dtype": dtype, "m": m, "n": n, "k": k, "batch": (), "b_batched": False,
              "bias": i % 2 == 0, "act": ACTS[i % 4], "alpha": 0.5 if i % 2 else 1.0,
              "beta": -0.5 if i % 3 == 0 else 0.0, "force": None, "trans_b": False}  # fmt: skip
        err = _run_case(cupy, rng, cs, stream)
        assert err < TOL[dtype.name], f"seed={seed} err={err:.3g}: {cs}"
    for batch, bb, m in (((3,), True, 1), ((2,), False, 2)):
        cs = {"kind": dtype.name, "dtype": dtype, "m": m, "n": 72, "k": 1200, "batch": batch, "b_batched": bb,
              "bias": True, "act": "gelu", "alpha": 1.0, "beta": 0.0, "force": None, "trans_b": False}  # fmt: skip
        err = _run_case(cupy, rng, cs, stream)
        assert err < TOL[dtype.name], f"seed={seed} err={err:.3g}: {cs}"
    # the cluster reduction sums the K slices in a fixed order: bit-identical repeats
    a = cupy.asarray(_rand(rng, (1, 4096), dtype))
    b = cupy.asarray(_rand(rng, (4096, 1000), dtype))
    outs = []
    for _ in range(3):
        o = cupy.full((1, 1000), np.nan, dtype=dtype)
        cupy.cuda.Device().synchronize()  # the fill ran on the legacy stream
        gemm_cuda(a, b, o, stream=stream)
        stream.synchronize()
        outs.append(cupy.asnumpy(o).view(np.uint16))
    assert all((x == outs[0]).all() for x in outs[1:]), f"seed={seed}: gemv results differ between runs"


def test_gemv_config() -> None:
    """Cluster slices of K on sm_90 until two blocks per SM (at least 128 rows each), one
    slice elsewhere; rows rounded up to a power of two; narrow strips for small N."""
    assert gemv_config(1, 4096, 4096, 90) == (8, 1, 16, 0)
    assert gemv_config(1, 14336, 4096, 90) == (4, 1, 16, 1)
    assert gemv_config(1, 49152, 576, 90) == (1, 1, 16, 0)
    assert gemv_config(3, 576, 1536, 90) == (8, 4, 8, 0)
    assert gemv_config(8, 4096, 1023, 90) == (4, 8, 16, 0)
    assert gemv_config(2, 4096, 255, 90) == (1, 2, 16, 0)
    assert gemv_config(1, 4096, 4096, 80) == (1, 1, 16, 1)
    assert gemv_config(1, 4096, 14336, 90) == (8, 1, 16, 0)
    for m in range(1, 9):
        for n, k in ((8, 1), (1000, 100), (4096, 256), (128256, 1000), (576, 5000)):
            cl, mr, lpr, pf = gemv_config(m, n, k, 90)
            assert mr >= m and cl in (1, 2, 4, 8) and (cl == 1 or k // cl >= 128) and lpr in (8, 16)
            assert pf == int(cl <= 4 and k // cl >= 1024)


def test_plan_gemv_rows() -> None:
    """b as (K, N) on sm_90: the GEMV for one row (and up to 4 rows of a small weight), the
    TMA tiles above; without the TMA path the GEMV takes up to 8 rows."""
    plan = plan_path
    assert plan(1, 1, 4096, 4096, BF16, False, True, 132, True, False, True)[0] == "gemv"
    assert plan(1, 2, 4096, 4096, BF16, False, True, 132, True, False, True)[0] == "sm90"
    assert plan(1, 4, 3072, 576, BF16, False, True, 132, True, False, True)[0] == "gemv"
    assert plan(1, 5, 3072, 576, BF16, False, True, 132, True, False, True)[0] == "sm90"
    assert plan(1, 8, 4096, 4096, BF16, False, False, 132, True, False, True)[0] == "gemv"


@pytest.mark.gpu
def test_gpu_cached_plan_fresh_buffers_and_layout_recheck() -> None:
    """A cached plan serves new buffers of the same problem (new pointers: new tensor maps and
    packed arguments) and still refuses a non-contiguous array of the same shape."""
    cupy = _cupy()
    rng = np.random.default_rng()
    stream = cupy.cuda.Stream(non_blocking=True)
    cc = int(cupy.cuda.Device().compute_capability)
    for m, n, k, force in ((1, 256, 512, None), (200, 256, 512, None), (200, 256, 512, GemmOverride(path="sm90", sm90_tile="128x128") if cc == 90 else None)):
        for tb in (False, True):
            outs = []
            for _ in range(3):
                a = _rand(rng, (m, k), BF16)
                w = _rand(rng, (n, k) if tb else (k, n), BF16, 1 / math.sqrt(k))
                dout = cupy.full((m, n), np.nan, dtype=BF16)
                with _forced(force):
                    gemm_cuda(cupy.asarray(a), cupy.asarray(w), dout, trans_b=tb, stream=stream)
                outs.append((dout, gemm_reference(a, w, trans_b=tb)))
            stream.synchronize()
            for dout, ref in outs:
                assert _rel(cupy.asnumpy(dout), ref.astype(np.float64)) < TOL["bfloat16"], (m, n, k, tb, force)
    a = cupy.ones((64, 64), dtype=np.float16)
    good = cupy.ones((64, 64), dtype=np.float16)
    out = cupy.empty((64, 64), dtype=np.float16)
    gemm_cuda(a, good, out, trans_b=True, stream=stream)
    with pytest.raises(ShapeError, match="copy"):
        gemm_cuda(a, cupy.ones((64, 64), dtype=np.float16).T, out, trans_b=True, stream=stream)
    stream.synchronize()


# --------------------------------------------------------------------------- CPU: plan cache


class _FakeMem:
    def __init__(self, ptr: int) -> None:
        self.ptr, self.device_id = ptr, 0


class _FakeArr:
    """Just what ``gemm_cuda``'s per-call key reads from a cupy array."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype[Any], ptr: int, strides: tuple[int, ...] | None = None):
        self.shape, self.dtype, self.data = shape, dtype, _FakeMem(ptr)
        self.strides = strides or tuple(int(np.prod(shape[i + 1:])) * dtype.itemsize for i in range(len(shape)))
        self.nbytes = int(np.prod(shape)) * dtype.itemsize


class _FakeStream:
    ptr = 1234


def test_plan_built_once_per_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host cost: the launch plan (checks, path, grid, kernel) is computed once per problem key;
    later calls with new buffers only pass their pointers; a changed layout, alignment, dtype,
    flag or epilogue builds (and so re-checks) a new plan."""
    from deviceops.kernels.gemm import _cuda as _gemm_cuda

    built: list[tuple[Any, ...]] = []
    runs: list[tuple[int, ...]] = []

    def fake_build(*args: Any) -> Any:
        built.append(args)
        return lambda *ptrs: runs.append(ptrs)

    monkeypatch.setattr(_gemm_cuda, "_build", fake_build)
    plan_cache.clear()  # (the runtime's one plan cache)
    f16 = np.dtype(np.float16)

    def call(ptr0: int, **kw: Any) -> None:
        a = _FakeArr((1, 64), f16, ptr0)
        w = _FakeArr((32, 64), f16, ptr0 + 4096, kw.pop("w_strides", None))
        o = _FakeArr((1, 32), f16, ptr0 + 8192)
        _gemm_cuda.gemm_cuda(a, w, o, stream=_FakeStream(), **kw)

    call(1 << 20, trans_b=True)
    call(2 << 20, trans_b=True)  # new buffers, same problem
    assert len(built) == 1 and len(runs) == 2
    assert runs[1][:3] == (2 << 20, (2 << 20) + 4096, (2 << 20) + 8192) and runs[1][5] == 1234
    call(3 << 20, trans_b=False)  # flag
    call(4 << 20, trans_b=True, w_strides=(2, 64))  # layout (a transposed view): re-checked
    call((5 << 20) + 2, trans_b=True)  # 16-byte alignment of the pointers
    call(6 << 20, trans_b=True, activation="gelu")  # epilogue
    assert len(built) == 5 and len(runs) == 6
