"""Transformer kernels (rope, rope_kv_write, merge_heads, swiglu, add_rms_norm, sample) on the
default device (the cpu backend in CI, cuda on a GPU machine), against independent float64
NumPy written here, on odd shapes, fresh random inputs, outputs poisoned with NaN first;
argument forms, in-place use, every argument check's error (raised before any launch), and
graph capture. On cuda the same tests cover every launch geometry of the norm kernel and
both paths of the sampler (shared-memory candidate list, whole row); a chi-square test of
the sampler's empirical distribution is marked ``gpu``.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import deviceops
from deviceops import api, kernels
from deviceops._errors import CaptureError, DTypeError, ShapeError
from deviceops.kernels.norms._cuda import norm_geometry
from deviceops.kernels.sampling._reference import uniform

from .conftest import to_np

FLOATS = ["float32", "float16", "bfloat16"]
# about one output ulp of the dtype, relative and absolute
TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def npdt(name: str) -> np.dtype[Any]:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def rand(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(npdt(dtype))


def dev_t(h: np.ndarray, stream: deviceops.Stream) -> deviceops.Tensor:
    return api.from_host(np.ascontiguousarray(h)).sync_on(stream)


def poisoned(shape: tuple[int, ...], dtype: str, stream: deviceops.Stream) -> deviceops.Tensor:
    return api.full(shape, float("nan"), dtype).sync_on(stream)


_side: dict[deviceops.Device, deviceops.Stream] = {}


def z(shape: tuple[int, ...], dtype: str = "float32", fill: float = 0.0) -> deviceops.Tensor:
    """A filled tensor made on a side stream (the tested stream's op count stays put)."""
    dev = deviceops.default_device()
    s = _side.get(dev)
    if s is None:
        s = _side[dev] = dev.new_stream()
    return api.full(shape, fill, dtype).sync_on(s)


def f64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def close(got: np.ndarray, ref: np.ndarray, dtype: str, scale: float = 1.0) -> None:
    g = f64(got)
    assert not np.isnan(g).any(), "output still holds NaN (poison)"
    np.testing.assert_allclose(g, ref, rtol=TOL[dtype] * scale, atol=TOL[dtype] * scale)


# ----------------------------------------------------------------------------- references
# Written independently of the library's references (loops over j, explicit angles).


def rope64(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """x (..., D) float64, pos broadcastable to x.shape[:-1]."""
    d = x.shape[-1]
    out = np.empty_like(x)
    for j in range(d // 2):
        a = pos * theta ** (-2.0 * j / d)
        c, s = np.cos(a), np.sin(a)
        out[..., j] = x[..., j] * c - x[..., j + d // 2] * s
        out[..., j + d // 2] = x[..., j + d // 2] * c + x[..., j] * s
    return out


def silu64(g: np.ndarray) -> np.ndarray:
    return g / (1.0 + np.exp(-g))


def rms64(s: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return s / np.sqrt((s * s).mean(-1, keepdims=True) + eps) * w


# ----------------------------------------------------------------------------- rope


ROPE_SHAPES = [(1, 1, 1, 2), (2, 3, 5, 6), (3, 7, 2, 64), (2, 5, 3, 128), (1, 2, 9, 34)]


@pytest.mark.parametrize("dtype", FLOATS)
def test_rope_matches_float64(dtype: str, stream: deviceops.Stream) -> None:
    rng = np.random.default_rng()
    for shape in ROPE_SHAPES:
        b, length = shape[:2]
        for starts in (np.zeros(b, np.int32), rng.integers(0, 5000, b).astype(np.int32)):
            xh = rand(rng, shape, dtype)
            theta = float(rng.choice([10000.0, 500000.0, 10.5]))
            out = poisoned(shape, dtype, stream)
            got = kernels.rope(dev_t(xh, stream), dev_t(starts, stream), theta=theta, out=out)
            assert got.sync_on(stream) is out
            pos = (starts[:, None].astype(np.float64) + np.arange(length))[:, :, None]  # (B, L, 1)
            close(to_np(out), rope64(f64(xh), pos, theta), dtype)


def test_rope_large_positions_in_place_and_forms(stream: deviceops.Stream) -> None:
    rng = np.random.default_rng()
    xh = rand(rng, (2, 3, 4, 64), "float32")
    starts = np.array([131000, 7], np.int32)
    x = dev_t(xh, stream)
    assert kernels.rope(x, dev_t(starts, stream), out=x).sync_on(stream) is x  # in place
    pos = (starts[:, None].astype(np.float64) + np.arange(3))[:, :, None]
    close(to_np(x), rope64(f64(xh), pos, 10000.0), "float32")
    # allocated output, DeviceOp arguments, negative positions, a Partition out
    starts = np.array([-3, 0], np.int32)
    got = kernels.rope(api.from_host(xh), api.from_host(starts)).sync_on(stream)
    assert isinstance(got, deviceops.Tensor) and got.shape == xh.shape
    pos = (starts[:, None].astype(np.float64) + np.arange(3))[:, :, None]
    close(to_np(got), rope64(f64(xh), pos, 10000.0), "float32")
    o = poisoned(xh.shape, "float32", stream)
    part = o.partition((1, 3, 4, 64))
    assert kernels.rope(dev_t(xh, stream), dev_t(starts, stream), out=part).sync_on(stream) is part
    close(to_np(o), rope64(f64(xh), pos, 10000.0), "float32")


def test_rope_errors_before_launch(stream: deviceops.Stream) -> None:
    x = z((2, 3, 4, 8))
    st = z((2,), "int32")
    seq = stream.seq
    with pytest.raises(ShapeError, match=r"rope.*\(2, 3, 4, 7\).*D even"):
        kernels.rope(z((2, 3, 4, 7)), st)
    with pytest.raises(ShapeError, match=r"rope.*\(2, 3, 8\)"):
        kernels.rope(z((2, 3, 8)), st)
    with pytest.raises(DTypeError, match=r"rope.*int32"):
        kernels.rope(z((2, 3, 4, 8), "int32"), st)
    with pytest.raises(DTypeError, match=r"rope.*start.*int64.*int32"):
        kernels.rope(x, z((2,), "int64"))
    with pytest.raises(ShapeError, match=r"rope.*start.*\(3,\).*\(2,\)"):
        kernels.rope(x, z((3,), "int32"))
    with pytest.raises(ShapeError, match=r"rope.*out.*\(2, 3, 4, 6\)"):
        kernels.rope(x, st, out=z((2, 3, 4, 6)))
    with pytest.raises(DTypeError, match=r"rope.*out.*float16"):
        kernels.rope(x, st, out=z((2, 3, 4, 8), "float16"))
    with pytest.raises(ValueError, match="theta"):
        kernels.rope(x, st, theta=1.0)
    with pytest.raises(TypeError, match="Tensor"):
        kernels.rope(np.zeros((2, 3, 4, 8)), st)
    assert stream.seq == seq
    # a deferred argument is checked once it ran, before this op launches
    out = poisoned((2, 3, 4, 8), "float32", stream)
    with pytest.raises(ShapeError, match=r"start.*\(5,\)"):
        kernels.rope(x, api.zeros((5,), "int32"), out=out).sync_on(stream)
    assert np.isnan(to_np(out)).all()


# ----------------------------------------------------------------------------- rope_kv_write


def _kv_case(rng: np.random.Generator, dtype: str, b: int, length: int, hq: int, hkv: int, d: int,
             s: int, starts: np.ndarray, stream: deviceops.Stream) -> None:
    qkvh = rand(rng, (b, length, (hq + 2 * hkv) * d), dtype)
    kc0, vc0 = rand(rng, (b, hkv, s, d), dtype), rand(rng, (b, hkv, s, d), dtype)
    kc, vc = dev_t(kc0, stream), dev_t(vc0, stream)
    q_out = poisoned((b, hq, length, d), dtype, stream)
    theta = 10000.0
    op = kernels.rope_kv_write(dev_t(qkvh, stream), dev_t(starts, stream), kc, vc, n_heads=hq,
                               n_kv_heads=hkv, theta=theta, q_out=q_out)
    assert op.sync_on(stream) is q_out
    heads = f64(qkvh).reshape(b, length, hq + 2 * hkv, d)
    pos = starts[:, None].astype(np.float64) + np.arange(length)  # (B, L)
    q_ref = rope64(heads[:, :, :hq], pos[:, :, None], theta).transpose(0, 2, 1, 3)
    close(to_np(q_out), q_ref, dtype)
    k_rot = rope64(heads[:, :, hq:hq + hkv], pos[:, :, None], theta)  # (B, L, Hkv, D)
    k_ref, v_ref = f64(kc0).copy(), f64(vc0).copy()
    for bi in range(b):
        for i in range(length):
            p = int(pos[bi, i])
            if 0 <= p < s:
                k_ref[bi, :, p] = k_rot[bi, i]
                v_ref[bi, :, p] = heads[bi, i, hq + hkv:]
    close(to_np(kc), k_ref, dtype)
    np.testing.assert_array_equal(f64(to_np(vc)), v_ref)  # v is copied exactly


@pytest.mark.parametrize("dtype", FLOATS)
def test_rope_kv_write_matches_float64(dtype: str, stream: deviceops.Stream) -> None:
    rng = np.random.default_rng()
    # (B, L, Hq, Hkv, D, S): GQA, MHA, odd sizes, decode (L = 1) and prefill
    for b, length, hq, hkv, d, s in [(1, 1, 1, 1, 2, 1), (2, 3, 6, 2, 6, 9), (3, 1, 9, 3, 64, 40),
                                     (2, 7, 4, 4, 128, 17), (1, 5, 3, 1, 34, 5)]:
        for starts in (np.zeros(b, np.int32), rng.integers(0, s, b).astype(np.int32)):
            _kv_case(rng, dtype, b, length, hq, hkv, d, s, starts, stream)
    # positions past the cache end and negative ones are skipped (q still written)
    _kv_case(rng, dtype, 3, 4, 2, 1, 8, 6, np.array([4, -2, 100], np.int32), stream)


def _paged_case(rng: np.random.Generator, dtype: str, b: int, length: int, hq: int, hkv: int,
                d: int, bs: int, nb: int, table: np.ndarray, starts: np.ndarray,
                stream: deviceops.Stream) -> None:
    """Paged rope_kv_write against float64 loops: pool (NB, Hkv, BS, D), table (B, MB)."""
    mb = table.shape[1]
    qkvh = rand(rng, (b, length, (hq + 2 * hkv) * d), dtype)
    kc0, vc0 = rand(rng, (nb, hkv, bs, d), dtype), rand(rng, (nb, hkv, bs, d), dtype)
    kc, vc = dev_t(kc0, stream), dev_t(vc0, stream)
    q_out = poisoned((b, hq, length, d), dtype, stream)
    theta = 500.0
    op = kernels.rope_kv_write(dev_t(qkvh, stream), dev_t(starts, stream), kc, vc, n_heads=hq,
                               n_kv_heads=hkv, theta=theta, q_out=q_out,
                               block_table=dev_t(table, stream))
    assert op.sync_on(stream) is q_out
    heads = f64(qkvh).reshape(b, length, hq + 2 * hkv, d)
    pos = starts[:, None].astype(np.float64) + np.arange(length)  # (B, L)
    q_ref = rope64(heads[:, :, :hq], pos[:, :, None], theta).transpose(0, 2, 1, 3)
    close(to_np(q_out), q_ref, dtype)
    k_rot = rope64(heads[:, :, hq:hq + hkv], pos[:, :, None], theta)  # (B, L, Hkv, D)
    k_ref, v_ref = f64(kc0).copy(), f64(vc0).copy()
    written = np.zeros((nb, bs), bool)
    for bi in range(b):
        for i in range(length):
            p = int(pos[bi, i])
            if not 0 <= p < mb * bs:
                continue
            blk = int(table[bi, p // bs])
            if 0 <= blk < nb:
                k_ref[blk, :, p % bs] = k_rot[bi, i]
                v_ref[blk, :, p % bs] = heads[bi, i, hq + hkv:]
                written[blk, p % bs] = True
    kg, vg = f64(to_np(kc)), f64(to_np(vc))
    close(kg.transpose(0, 2, 1, 3)[written], k_ref.transpose(0, 2, 1, 3)[written], dtype)
    # every slot not written keeps its bits; v is copied exactly
    np.testing.assert_array_equal(kg.transpose(0, 2, 1, 3)[~written],
                                  k_ref.transpose(0, 2, 1, 3)[~written])
    np.testing.assert_array_equal(vg, v_ref)


@pytest.mark.parametrize("dtype", FLOATS)
def test_rope_kv_write_paged_matches_float64(dtype: str, stream: deviceops.Stream) -> None:
    rng = np.random.default_rng()
    # (B, L, Hq, Hkv, D, block_size, num_blocks, max_blocks): decode, prefill, odd sizes
    for b, length, hq, hkv, d, bs, nb, mb in [(1, 1, 1, 1, 2, 1, 3, 2), (3, 1, 9, 3, 64, 16, 11, 3),
                                              (2, 7, 6, 2, 6, 5, 9, 4), (2, 13, 4, 4, 128, 7, 8, 3),
                                              (1, 5, 3, 1, 34, 3, 4, 4)]:
        table = rng.permutation(nb)[: b * mb].reshape(b, mb) if nb >= b * mb else \
            rng.integers(0, nb, (b, mb))
        table = table.astype(np.int32)
        for starts in (np.zeros(b, np.int32), rng.integers(0, mb * bs, b).astype(np.int32)):
            _paged_case(rng, dtype, b, length, hq, hkv, d, bs, nb, table, starts, stream)
    # skipped: negative and past-the-pool block ids, positions < 0 or >= max_blocks * block_size
    table = np.array([[2, -1, 0], [7, 1, 3], [4, 5, -3]], np.int32)
    _paged_case(rng, dtype, 3, 6, 2, 1, 8, 4, 6, table, np.array([1, -3, 9], np.int32), stream)
    _paged_case(rng, dtype, 3, 2, 2, 1, 8, 4, 6, table, np.array([11, 12, 7], np.int32), stream)


def test_rope_kv_write_paged_errors(stream: deviceops.Stream) -> None:
    qkv = z((2, 3, 5 * 8))  # Hq 3, Hkv 1, D 8
    st = z((2,), "int32")
    kc, vc = z((6, 1, 4, 8)), z((6, 1, 4, 8))  # pool of 6 blocks of 4 positions
    bt = z((2, 3), "int32")
    seq = stream.seq
    kw: dict[str, Any] = {"n_heads": 3, "n_kv_heads": 1}
    with pytest.raises(DTypeError, match=r"rope_kv_write.*block_table.*float32.*int32"):
        kernels.rope_kv_write(qkv, st, kc, vc, block_table=z((2, 3)), **kw)
    with pytest.raises(ShapeError, match=r"block_table.*\(3, 3\).*\(2, max_blocks\)"):
        kernels.rope_kv_write(qkv, st, kc, vc, block_table=z((3, 3), "int32"), **kw)
    with pytest.raises(ShapeError, match=r"block_table.*\(2, 0\)"):
        kernels.rope_kv_write(qkv, st, kc, vc, block_table=z((2, 0), "int32"), **kw)
    with pytest.raises(ShapeError, match=r"k_cache.*\(6, 2, 4, 8\).*block pool.*\(num_blocks, 1"):
        kernels.rope_kv_write(qkv, st, z((6, 2, 4, 8)), vc, block_table=bt, **kw)
    with pytest.raises(ShapeError, match=r"v_cache.*\(6, 1, 5, 8\)"):
        kernels.rope_kv_write(qkv, st, kc, z((6, 1, 5, 8)), block_table=bt, **kw)
    with pytest.raises(TypeError, match=r"block_table"):
        kernels.rope_kv_write(qkv, st, kc, vc, block_table=np.zeros((2, 3), np.int32), **kw)
    assert stream.seq == seq
    # a pool with more blocks than rows is fine only with a table (else: k_cache shape error)
    with pytest.raises(ShapeError, match=r"k_cache.*\(6, 1, 4, 8\).*\(2, 1, S, 8\)"):
        kernels.rope_kv_write(qkv, st, kc, vc, **kw)
    q = kernels.rope_kv_write(api.from_host(np.ones((2, 3, 40), np.float32)), st, kc, vc,
                              block_table=api.from_host(np.array([[4, 1, 0], [2, 3, 5]], np.int32)),
                              **kw).sync_on(stream)
    assert q.shape == (2, 3, 3, 8)
    v = to_np(vc)
    assert (v[4, :, :3] == 1).all() and (v[2, :, :3] == 1).all() and (v[4, :, 3] == 0).all()
    assert (v[[0, 1, 3, 5]] == 0).all()


def test_rope_kv_write_allocates_and_errors(stream: deviceops.Stream) -> None:
    qkv = z((2, 3, 5 * 8))  # Hq 3, Hkv 1, D 8
    st = z((2,), "int32")
    kc, vc = z((2, 1, 4, 8)), z((2, 1, 4, 8))
    q = kernels.rope_kv_write(api.from_host(np.ones((2, 3, 40), np.float32)), st, kc, vc,
                              n_heads=3, n_kv_heads=1).sync_on(stream)
    assert q.shape == (2, 3, 3, 8) and q.dtype == np.float32
    assert (to_np(vc)[:, :, :3] == 1).all() and (to_np(vc)[:, :, 3] == 0).all()
    seq = stream.seq
    kw: dict[str, Any] = {"n_heads": 3, "n_kv_heads": 1}
    with pytest.raises(ValueError, match=r"n_heads=3, n_kv_heads=2"):
        kernels.rope_kv_write(qkv, st, kc, vc, n_heads=3, n_kv_heads=2)
    with pytest.raises(ShapeError, match=r"rope_kv_write.*qkv.*\(2, 3, 41\).*5 \* D"):
        kernels.rope_kv_write(z((2, 3, 41)), st, kc, vc, **kw)
    with pytest.raises(ShapeError, match=r"qkv.*\(2, 3, 35\).*D even"):
        kernels.rope_kv_write(z((2, 3, 35)), st, kc, vc, **kw)
    with pytest.raises(DTypeError, match=r"qkv.*int32"):
        kernels.rope_kv_write(z((2, 3, 40), "int32"), st, kc, vc, **kw)
    with pytest.raises(ShapeError, match=r"k_cache.*\(2, 2, 4, 8\).*\(2, 1, S, 8\)"):
        kernels.rope_kv_write(qkv, st, z((2, 2, 4, 8)), vc, **kw)
    with pytest.raises(ShapeError, match=r"v_cache.*\(2, 1, 5, 8\).*\(2, 1, 4, 8\)"):
        kernels.rope_kv_write(qkv, st, kc, z((2, 1, 5, 8)), **kw)
    with pytest.raises(DTypeError, match=r"k_cache.*float16.*float32"):
        kernels.rope_kv_write(qkv, st, z((2, 1, 4, 8), "float16"), vc, **kw)
    with pytest.raises(DTypeError, match=r"start.*float32"):
        kernels.rope_kv_write(qkv, z((2,)), kc, vc, **kw)
    with pytest.raises(ShapeError, match=r"q_out.*\(2, 3, 3, 7\).*\(2, 3, 3, 8\)"):
        kernels.rope_kv_write(qkv, st, kc, vc, q_out=z((2, 3, 3, 7)), **kw)
    with pytest.raises(ShapeError, match=r"k_cache.*shares memory with v_cache"):
        kernels.rope_kv_write(qkv, st, kc, kc, **kw)
    with pytest.raises(ValueError, match="theta"):
        kernels.rope_kv_write(qkv, st, kc, vc, theta=float("nan"), **kw)
    assert stream.seq == seq


# ----------------------------------------------------------------------------- merge_heads


@pytest.mark.parametrize("dtype", [*FLOATS, "int32"])
def test_merge_heads(dtype: str, stream: deviceops.Stream) -> None:
    rng = np.random.default_rng()
    for shape in [(1, 1, 1, 1), (2, 3, 5, 7), (1, 9, 1, 64), (3, 4, 7, 128), (2, 2, 3, 6)]:
        if dtype == "int32":
            xh = rng.integers(-1000, 1000, shape).astype(np.int32)
            out = api.full((shape[0], shape[2], shape[1] * shape[3]), -7, "int32").sync_on(stream)
        else:
            xh = rand(rng, shape, dtype)
            out = poisoned((shape[0], shape[2], shape[1] * shape[3]), dtype, stream)
        assert kernels.merge_heads(dev_t(xh, stream), out=out).sync_on(stream) is out
        ref = np.stack([xh[:, h] for h in range(shape[1])], axis=2)  # (B, L, H, D)
        np.testing.assert_array_equal(f64(to_np(out)), f64(ref).reshape(out.shape))
    got = kernels.merge_heads(api.from_host(rand(rng, (1, 2, 3, 4), "float32"))).sync_on(stream)
    assert got.shape == (1, 3, 8)
    x = z((1, 2, 3, 4))
    with pytest.raises(ShapeError, match=r"merge_heads.*\(2, 3, 4\)"):
        kernels.merge_heads(z((2, 3, 4)))
    with pytest.raises(ShapeError, match=r"merge_heads.*out.*\(1, 2, 12\).*\(1, 3, 8\)"):
        kernels.merge_heads(x, out=z((1, 2, 12)))
    with pytest.raises(DTypeError, match=r"merge_heads.*out.*float16"):
        kernels.merge_heads(x, out=z((1, 3, 8), "float16"))
    with pytest.raises(ShapeError, match=r"in place"):
        kernels.merge_heads(x, out=x.reshape(1, 3, 8))


# ----------------------------------------------------------------------------- swiglu


@pytest.mark.parametrize("dtype", FLOATS)
def test_swiglu_matches_float64(dtype: str, stream: deviceops.Stream) -> None:
    rng = np.random.default_rng()
    for shape in [(1, 2), (7, 10), (33, 254), (3, 5, 2 * 1536), (2, 2 * 1001), (16,)]:
        xh = rand(rng, shape, dtype, 3.0)
        oshape = (*shape[:-1], shape[-1] // 2)
        out = poisoned(oshape, dtype, stream)
        assert kernels.swiglu(dev_t(xh, stream), out=out).sync_on(stream) is out
        f = shape[-1] // 2
        ref = silu64(f64(xh)[..., :f]) * f64(xh)[..., f:]
        close(to_np(out), ref, dtype, 2.0)
    got = kernels.swiglu(api.from_host(rand(rng, (3, 8), dtype))).sync_on(stream)
    assert got.shape == (3, 4) and got.dtype == npdt(dtype)


def test_swiglu_errors(stream: deviceops.Stream) -> None:
    x = z((3, 8))
    seq = stream.seq
    with pytest.raises(ShapeError, match=r"swiglu.*\(3, 7\).*2F"):
        kernels.swiglu(z((3, 7)))
    with pytest.raises(DTypeError, match=r"swiglu.*int32"):
        kernels.swiglu(z((3, 8), "int32"))
    with pytest.raises(ShapeError, match=r"swiglu.*out.*\(3, 8\).*\(3, 4\)"):
        kernels.swiglu(x, out=z((3, 8)))
    with pytest.raises(DTypeError, match=r"swiglu.*out.*bfloat16"):
        kernels.swiglu(x, out=z((3, 4), "bfloat16"))
    assert stream.seq == seq


# ----------------------------------------------------------------------------- add_rms_norm

NORM_SHAPES = [(1, 1), (1, 5), (7, 33), (3, 768), (2, 767), (5, 4096), (1, 4095), (2, 3, 129),
               (3, 9000), (1, 70000), (300, 64), (2, 40000)]


@pytest.mark.parametrize("dtype", FLOATS)
def test_add_rms_norm_matches_float64(dtype: str, stream: deviceops.Stream) -> None:
    rng = np.random.default_rng()
    for shape in NORM_SHAPES:
        d = shape[-1]
        xh, rh, wh = rand(rng, shape, dtype, 2.0), rand(rng, shape, dtype), rand(rng, (d,), dtype)
        x, r, w = dev_t(xh, stream), dev_t(rh, stream), dev_t(wh, stream)
        out = poisoned(shape, dtype, stream)
        ro = poisoned(shape, dtype, stream)
        got = kernels.add_rms_norm(x, r, w, eps=1e-5, out=out, residual_out=ro).sync_on(stream)
        assert got[0] is out and got[1] is ro
        s = (f64(xh) + f64(rh)).astype(npdt(dtype))  # the stored sum, rounded once
        np.testing.assert_array_equal(f64(to_np(ro)), f64(s))
        close(to_np(out), rms64(f64(s), f64(wh), 1e-5), dtype)
        np.testing.assert_array_equal(to_np(r), rh)  # residual untouched when residual_out given


@pytest.mark.parametrize("dtype", FLOATS)
def test_rms_norm_geometries(dtype: str, stream: deviceops.Stream) -> None:
    """rms_norm runs on the same kernel: every geometry (held rows, streamed rows, vector or not)."""
    rng = np.random.default_rng()
    for shape in NORM_SHAPES:
        d = shape[-1]
        xh, wh = rand(rng, shape, dtype, 2.0), rand(rng, (d,), dtype)
        out = poisoned(shape, dtype, stream)
        assert kernels.rms_norm(dev_t(xh, stream), dev_t(wh, stream), out=out).sync_on(stream) is out
        close(to_np(out), rms64(f64(xh), f64(wh), 1e-6), dtype)


def test_add_rms_norm_in_place_and_forms(stream: deviceops.Stream) -> None:
    rng = np.random.default_rng()
    xh, rh, wh = rand(rng, (5, 96), "float16"), rand(rng, (5, 96), "float16"), rand(rng, (96,), "float16")
    s = (f64(xh) + f64(rh)).astype(np.float16)
    ref = rms64(f64(s), f64(wh), 1e-6)
    # default: residual updated in place, out allocated
    x, r, w = dev_t(xh, stream), dev_t(rh, stream), dev_t(wh, stream)
    out, ro = kernels.add_rms_norm(x, r, w).sync_on(stream)
    assert ro is r and isinstance(out, deviceops.Tensor)
    np.testing.assert_array_equal(f64(to_np(r)), f64(s))
    close(to_np(out), ref, "float16")
    np.testing.assert_array_equal(to_np(x), xh)
    # out = x (in place), residual in place
    x, r = dev_t(xh, stream), dev_t(rh, stream)
    got = kernels.add_rms_norm(x, r, w, out=x).sync_on(stream)
    assert got[0] is x and got[1] is r
    close(to_np(x), ref, "float16")
    np.testing.assert_array_equal(f64(to_np(r)), f64(s))
    # residual_out = x, DeviceOp residual and weight, a Partition out
    x = dev_t(xh, stream)
    o = poisoned((5, 96), "float16", stream)
    part = o.partition((1, 96))
    got = kernels.add_rms_norm(x, api.from_host(rh), api.from_host(wh), out=part,
                               residual_out=x).sync_on(stream)
    assert got[0] is part and got[1] is x
    close(to_np(o), ref, "float16")
    np.testing.assert_array_equal(f64(to_np(x)), f64(s))


def test_add_rms_norm_errors(stream: deviceops.Stream) -> None:
    x = z((4, 8))
    r = z((4, 8))
    w = z((8,), fill=1.0)
    seq = stream.seq
    with pytest.raises(ShapeError, match=r"add_rms_norm.*residual.*\(4, 9\).*\(4, 8\)"):
        kernels.add_rms_norm(x, z((4, 9)), w)
    with pytest.raises(DTypeError, match=r"add_rms_norm.*residual.*float16.*float32"):
        kernels.add_rms_norm(x, z((4, 8), "float16"), w)
    with pytest.raises(ShapeError, match=r"add_rms_norm.*weight.*\(7,\).*\(8,\)"):
        kernels.add_rms_norm(x, r, z((7,), fill=1.0))
    with pytest.raises(DTypeError, match=r"add_rms_norm.*weight.*bfloat16"):
        kernels.add_rms_norm(x, r, z((8,), "bfloat16", fill=1.0))
    with pytest.raises(DTypeError, match=r"add_rms_norm.*x.*int32"):
        kernels.add_rms_norm(z((4, 8), "int32"), r, w)
    with pytest.raises(ShapeError, match=r"add_rms_norm.*out.*\(4, 7\)"):
        kernels.add_rms_norm(x, r, w, out=z((4, 7)))
    with pytest.raises(ShapeError, match=r"add_rms_norm.*residual_out.*\(8, 4\)"):
        kernels.add_rms_norm(x, r, w, residual_out=z((8, 4)))
    with pytest.raises(ShapeError, match=r"out.*shares memory with residual_out"):
        kernels.add_rms_norm(x, r, w, out=r)
    with pytest.raises(ShapeError, match=r"out.*shares memory with residual_out"):
        kernels.add_rms_norm(x, r, w, out=x, residual_out=x)
    with pytest.raises(ValueError, match="eps"):
        kernels.add_rms_norm(x, r, w, eps=float("inf"))
    assert stream.seq == seq


def test_norm_geometry() -> None:
    """The launch geometry: short rows one vector per thread; long rows held up to 8 vectors."""
    assert norm_geometry(1, 768, 8) == (1, 96, 1)  # decode: one 16-byte load per thread
    assert norm_geometry(1, 4096, 8) == (1, 512, 1)
    assert norm_geometry(32, 4096, 8) == (32, 512, 1)
    assert norm_geometry(4096, 4096, 8) == (4096, 256, 2)  # many rows: smaller blocks
    assert norm_geometry(4096, 4096, 4) == (4096, 256, 4)
    assert norm_geometry(1, 767, 1) == (1, 768, 1)
    assert norm_geometry(1, 32768, 8) == (1, 1024, 4)  # 32 floats held a thread at most
    assert norm_geometry(1, 32776, 8) == (1, 1024, 0)
    assert norm_geometry(1, 8192, 1) == (1, 1024, 8)
    assert norm_geometry(1, 65537, 1) == (1, 1024, 0)  # too long to hold: streamed twice
    assert norm_geometry(1, 1, 1) == (1, 32, 1)
    for rows, cols, vec in [(1, 5, 1), (300, 9000, 1), (7, 33, 1), (2, 70000, 8)]:
        blocks, threads, nv = norm_geometry(rows, cols, vec)
        assert threads % 32 == 0 and 32 <= threads <= 1024 and blocks == rows
        assert nv == 0 or threads * nv * vec >= cols


# ----------------------------------------------------------------------------- sample


def _u(seed: int, counter: int) -> float:
    """The hash written out again (splitmix64 finalizer twice), independently of the library."""
    m = (1 << 64) - 1

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    return (mix((mix(seed & m) + (counter + 1) * 0x9E3779B97F4A7C15) & m) >> 40) / 2.0**24


def sample64(lg: np.ndarray, temp: float, k: int, p: float, u: float, tol: float = 0.0) -> set[int]:
    """Independent float64 sampler by full sort (what the kernel does without one).

    Returns the token, or with ``tol > 0`` every token a float32 computation may pick: a
    top-p threshold whose mass is within ``tol`` (relative) of ``top_p``, a draw boundary
    within ``tol`` of ``u``.
    """
    if temp <= 0:
        return {int(np.argmax(lg))}
    v = lg.shape[0]
    order = np.argsort(-lg, kind="stable")
    desc = lg[order]
    keep = np.ones(v, bool) if not 0 < k < v else lg >= desc[k - 1]
    w = np.where(keep, np.exp((lg - lg.max()) / temp), 0.0)
    sets = [keep]
    if p < 1.0:
        total = w.sum()
        csum = np.cumsum(w[order])
        last = np.r_[desc[1:] != desc[:-1], True]  # the last of each run of ties
        vals, mass = desc[last], csum[last]  # mass of {x >= vals[j]}
        need = p * total
        first = int(np.argmax(mass >= need - 1e-12 * total))
        thr = {vals[first]} | {t for t, m in zip(vals, mass, strict=True)
                               if abs(m - need) <= tol * total}
        sets = [keep & (lg >= t) for t in thr]
    got: set[int] = set()
    for ks in sets:
        ww = np.where(ks, w, 0.0)
        c = np.cumsum(ww)
        target, slack = u * c[-1], tol * c[-1]
        lo = c - ww
        hit = (ww > 0) & (lo <= target + slack) & (c > target - slack)
        got |= {int(i) for i in np.nonzero(hit)[0]}
    return got


def _tol(dev: deviceops.Device) -> float:
    """cpu: the library's float64 reference must agree exactly; cuda: float32 boundaries."""
    return 0.0 if dev.is_cpu else 2e-5


def _params(b: int, temps: list[float], ks: list[int], ps: list[float], seeds: list[int],
            ctrs: list[int], stream: deviceops.Stream) -> tuple[deviceops.Tensor, ...]:
    return (dev_t(np.array(temps, np.float32), stream), dev_t(np.array(ks, np.int32), stream),
            dev_t(np.array(ps, np.float32), stream), dev_t(np.array(seeds, np.int64), stream),
            dev_t(np.array(ctrs, np.int64), stream))


def test_uniform_hash() -> None:
    for seed, ctr in [(0, 0), (1, 0), (-5, 3), (2**62, 2**40), (12345, 99)]:
        assert uniform(seed, ctr) == _u(seed, ctr)
        assert 0.0 <= uniform(seed, ctr) < 1.0
    us = np.array([uniform(7, c) for c in range(4000)])
    assert abs(us.mean() - 0.5) < 0.02 and len(set(us.tolist())) > 3990


@pytest.mark.parametrize("dtype", FLOATS)
def test_sample_matches_float64(dtype: str, dev: deviceops.Device, stream: deviceops.Stream) -> None:
    """Every row's token is the sort-based float64 sampler's draw with the same u (on cuda:
    up to float32 rounding at a boundary). Rows: greedy, plain, top-k, top-p, both."""
    rng = np.random.default_rng()
    for v in (1, 2, 50, 1000, 9001):
        # (temperature, top_k, top_p); on cuda, V > 2048 exercises both the shared-memory
        # candidate list (small k; peaked rows under top-p) and the whole-row path (k > 2048;
        # flat rows under top-p)
        cfgs = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 20, 0.5),
                (2.0, 1, 1.0), (1.0, v + 3, 0.95), (0.5, 3, 0.0), (1.0, 3000, 1.0),
                (1.0, 3000, 0.9), (0.3, 0, 0.9)]
        b = len(cfgs)
        lh = np.stack([rng.permutation(v) * 4.0 / max(v, 1) + 0.5 * rng.random() for _ in range(b)])
        lh = lh.astype(npdt(dtype))
        seeds = [int(s) for s in rng.integers(-2**62, 2**62, b)]
        ctrs = [int(c) for c in rng.integers(0, 1000, b)]
        params = _params(b, *(list(c) for c in zip(*cfgs, strict=True)), seeds, ctrs, stream)
        out = api.full((b,), -1, "int32").sync_on(stream)
        assert kernels.sample(dev_t(lh, stream), *params, out=out).sync_on(stream) is out
        got = to_np(out).tolist()
        for i, c in enumerate(cfgs):
            want = sample64(f64(lh[i]), float(np.float32(c[0])), c[1], float(np.float32(c[2])),
                            _u(seeds[i], ctrs[i]), _tol(dev))
            assert got[i] in want, (v, dtype, i, c, got[i], want)
            if dev.is_cpu:
                assert len(want) == 1
        np.testing.assert_array_equal(to_np(params[4]), np.array(ctrs) + 1)  # every counter advanced


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sample_ties_and_padding(dtype: str, dev: deviceops.Device, stream: deviceops.Stream) -> None:
    """Many equal logits (ties at the top-k threshold beyond any candidate list) and rows
    padded with very negative logits (weights that underflow to 0)."""
    rng = np.random.default_rng()
    v = 6000
    tied = rng.integers(0, 4, (4, v)).astype(np.float64)
    padded = np.full((4, v), -1e4)
    hot = rng.choice(v, 40, replace=False)
    padded[:, hot] = rng.standard_normal((4, 40))
    lh = np.concatenate([tied, padded]).astype(npdt(dtype))
    cfgs = [(1.0, 5, 1.0), (0.8, 100, 0.7), (1.2, 0, 0.6), (1.0, 0, 1.0)] * 2
    b = len(cfgs)
    seeds, ctrs = [int(x) for x in rng.integers(0, 2**40, b)], [0] * b
    params = _params(b, *(list(c) for c in zip(*cfgs, strict=True)), seeds, ctrs, stream)
    got = to_np(kernels.sample(dev_t(lh, stream), *params).sync_on(stream)).tolist()
    for i, c in enumerate(cfgs):
        want = sample64(f64(lh[i]), c[0], c[1], float(np.float32(c[2])), _u(seeds[i], 0), _tol(dev))
        assert got[i] in want, (i, c, got[i], want)
    assert all(g in set(hot.tolist()) for g in got[4:])


def test_sample_greedy_ties_forms_and_errors(stream: deviceops.Stream) -> None:
    lh = np.array([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 5.0, 2.0]], np.float32)
    params = _params(2, [0.0, -1.0], [0, 0], [1.0, 1.0], [1, 2], [0, 0], stream)
    got = kernels.sample(api.from_host(lh), *params).sync_on(stream)  # allocated, DeviceOp logits
    assert got.dtype == np.int32 and to_np(got).tolist() == [1, 0]
    # top_k = 1 is greedy whatever the temperature (ties at the threshold are all kept)
    params = _params(2, [5.0, 5.0], [1, 1], [1.0, 1.0], [3, 4], [0, 0], stream)
    lh2 = np.array([[0.0, 3.0, 2.0, 1.0], [5.0, -1.0, 4.0, 2.0]], np.float32)
    assert to_np(kernels.sample(dev_t(lh2, stream), *params).sync_on(stream)).tolist() == [1, 0]
    lg = z((2, 4))
    t, k, p, s, c = _params(2, [1, 1], [0, 0], [1, 1], [0, 0], [0, 0], stream)
    seq = stream.seq
    with pytest.raises(ShapeError, match=r"sample.*logits.*\(8,\).*\(B, V\)"):
        kernels.sample(z((8,)), t, k, p, s, c)
    with pytest.raises(DTypeError, match=r"sample.*logits.*int32"):
        kernels.sample(z((2, 4), "int32"), t, k, p, s, c)
    with pytest.raises(ShapeError, match=r"sample.*temperature.*\(3,\).*\(2,\)"):
        kernels.sample(lg, z((3,), fill=1.0), k, p, s, c)
    with pytest.raises(DTypeError, match=r"sample.*top_k.*float32.*int32"):
        kernels.sample(lg, t, z((2,), fill=1.0), p, s, c)
    with pytest.raises(DTypeError, match=r"sample.*top_p.*float16.*float32"):
        kernels.sample(lg, t, k, z((2,), "float16", fill=1.0), s, c)
    with pytest.raises(DTypeError, match=r"sample.*seed.*int32.*int64"):
        kernels.sample(lg, t, k, p, z((2,), "int32", fill=1.0), c)
    with pytest.raises(ShapeError, match=r"sample.*counter.*\(1,\)"):
        kernels.sample(lg, t, k, p, s, z((1,), "int64"))
    with pytest.raises(DTypeError, match=r"sample.*out.*int64.*int32"):
        kernels.sample(lg, t, k, p, s, c, out=z((2,), "int64"))
    with pytest.raises(ShapeError, match=r"sample.*out.*\(3,\)"):
        kernels.sample(lg, t, k, p, s, c, out=z((3,), "int32"))
    assert stream.seq == seq


def test_sample_in_graph_draws_fresh_numbers(dev: deviceops.Device, stream: deviceops.Stream) -> None:
    """One captured sample op: each replay advances the counter and draws again."""
    rng = np.random.default_rng()
    v, b = 64, 3
    lh = rng.standard_normal((b, v)).astype(np.float32)
    logits = dev_t(lh, stream)
    seeds, ctrs = [11, 12, 13], [0, 5, 9]
    t, k, p, s, c = _params(b, [1.0, 0.8, 1.5], [0, 10, 0], [1.0, 1.0, 0.9], seeds, ctrs, stream)
    out = api.full((b,), -1, "int32").sync_on(stream)
    graph = kernels.sample(logits, t, k, p, s, c, out=out).graph_on(stream)
    cfg = [(1.0, 0, 1.0), (0.8, 10, 1.0), (1.5, 0, 0.9)]
    draws = []
    for step in range(6):
        graph.launch()
        graph.synchronize()
        got = to_np(out).tolist()
        for i in range(b):
            want = sample64(f64(lh[i]), cfg[i][0], cfg[i][1], float(np.float32(cfg[i][2])),
                            _u(seeds[i], ctrs[i] + step), _tol(dev))
            assert got[i] in want, (step, i, got[i], want)
        draws.append(got)
    np.testing.assert_array_equal(to_np(c), np.array(ctrs) + 6)
    assert len({tuple(d) for d in draws}) > 1  # fresh numbers at every replay
    with pytest.raises(CaptureError, match="sample"):
        kernels.sample(logits, t, k, p, s, c).graph_on(stream)  # allocating inside a capture


def _chi2_ok(counts: np.ndarray, probs: np.ndarray) -> None:
    n = counts.sum()
    assert counts[probs == 0].sum() == 0, "a token outside the kept set was drawn"
    keep = probs > 0
    exp = probs[keep] * n
    stat = float(((counts[keep] - exp) ** 2 / exp).sum())
    dof = int(keep.sum()) - 1
    # 99.99% quantile, Wilson-Hilferty approximation: fails about once in 10^4 honest runs
    z = 3.719
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3 if dof > 0 else 0.0
    assert stat <= limit, (stat, limit, dof)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sample_distribution_chi_square(dtype: str, stream: deviceops.Stream) -> None:
    """Many rows of the same logits with distinct seeds: the empirical distribution of the
    CUDA kernel's draws matches temperature / top-k / top-p probabilities (chi-square)."""
    rng = np.random.default_rng()
    v, n = 24, 20000
    row = (rng.standard_normal(v) * 1.5).astype(npdt(dtype))
    lh = np.broadcast_to(row, (n, v)).copy()
    logits = dev_t(lh, stream)
    r64 = f64(row)
    # the same 24 logits hidden among 3000 of -1e4 (weight 0): the whole-row path on cuda
    pos = np.sort(rng.choice(3024, v, replace=False))
    wide = np.full(3024, -1e4)
    wide[pos] = r64
    wide_logits = dev_t(np.broadcast_to(wide.astype(npdt(dtype)), (n, 3024)).copy(), stream)
    for temp, k, p, lg in [(1.0, 0, 1.0, logits), (0.6, 7, 1.0, logits), (1.4, 0, 0.7, logits),
                           (1.0, 12, 0.8, logits), (1.0, 0, 1.0, wide_logits),
                           (1.4, 0, 0.7, wide_logits), (1.0, 2500, 0.8, wide_logits)]:
        params = _params(n, [temp] * n, [k] * n, [p] * n, list(range(1000, 1000 + n)),
                         [3] * n, stream)
        toks = to_np(kernels.sample(lg, *params).sync_on(stream))
        if lg is wide_logits:
            assert np.isin(toks, pos).all(), "a zero-weight token was drawn"
            toks = np.searchsorted(pos, toks)
            k = 0 if k >= 2048 else k  # (all 24 real logits are in the top 2500)
        keep = np.ones(v, bool) if k == 0 else r64 >= np.sort(r64)[::-1][k - 1]
        w = np.where(keep, np.exp((r64 - r64.max()) / temp), 0.0)
        if p < 1:
            for t in np.unique(r64[keep])[::-1]:
                if w[r64 >= t].sum() >= np.float32(p) * w.sum():
                    w = np.where(r64 >= t, w, 0.0)
                    break
        _chi2_ok(np.bincount(toks, minlength=v), w / w.sum())
        np.testing.assert_array_equal(to_np(params[4]), 4)
