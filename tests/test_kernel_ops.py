"""Kernel ops through the public launchers, on the default device (cpu here, cuda on a GPU).

gemm/matmul, flash_attention, rms_norm, layer_norm, softmax, gelu, silu, embedding and
argmax against independent float64 NumPy on odd shapes, every dtype, fresh random
inputs, outputs poisoned with NaN first; argument forms (Partition out, DeviceOp
arguments), errors raised before launch, and graph capture with the workspace rule.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import deviceops
from deviceops import api, kernels
from deviceops._errors import CaptureError, DeviceError, DTypeError, ShapeError

from .conftest import to_np

FLOATS = ["float32", "float16", "bfloat16"]
ROWS = [1, 7, 33]
COLS = [1, 5, 127, 1000]
# rows x cols, plus a leading-dims case and long rows (block-per-row on cuda)
ROW_SHAPES = [(r, c) for r in ROWS for c in COLS] + [(2, 3, 129), (3, 3000), (1, 5000)]
# elementwise tolerance (about one output ulp) and ||err|| / ||ref|| bounds
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
REL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2, "tf32": 2e-3}


def npdt(name: str) -> np.dtype[Any]:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def rand(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(npdt(dtype))


def dev_t(h: np.ndarray, stream: deviceops.Stream) -> deviceops.Tensor:
    return api.from_host(h).sync_on(stream)


def poisoned(shape: tuple[int, ...], dtype: str, stream: deviceops.Stream) -> deviceops.Tensor:
    return api.full(shape, float("nan"), dtype).sync_on(stream)


def f64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def close(got: np.ndarray, ref: np.ndarray, dtype: str) -> None:
    g = f64(got)
    assert not np.isnan(g).any(), "output still holds NaN (poison)"
    np.testing.assert_allclose(g, ref, rtol=TOL[dtype], atol=TOL[dtype])


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    g = f64(got)
    assert not np.isnan(g).any(), "output still holds NaN (poison)"
    den = float(np.linalg.norm(ref)) or 1.0
    return float(np.linalg.norm(g - ref)) / den


# ----------------------------------------------------------------------------- row ops


def _gelu64(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _ref(op: str, x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    if op == "rms_norm":
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w
    if op == "layer_norm":
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * w + b
    if op == "softmax":
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    if op == "gelu":
        return _gelu64(x)
    assert op == "silu"
    return x / (1.0 + np.exp(-x))


def _launch(op: str, x: Any, w: Any, b: Any, out: Any) -> deviceops.DeviceOp[Any]:
    if op == "rms_norm":
        return kernels.rms_norm(x, w, out=out)
    if op == "layer_norm":
        return kernels.layer_norm(x, w, b, out=out)
    return getattr(kernels, op)(x, out=out)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "softmax", "gelu", "silu"])
def test_row_ops_match_float64(op: str, dtype: str, stream: deviceops.Stream) -> None:
    rng = np.random.default_rng()
    for shape in ROW_SHAPES:
        d = shape[-1]
        xh = rand(rng, shape, dtype, 2.0)
        wh, bh = rand(rng, (d,), dtype), rand(rng, (d,), dtype)
        x, w, b = dev_t(xh, stream), dev_t(wh, stream), dev_t(bh, stream)
        out = poisoned(shape, dtype, stream)
        assert _launch(op, x, w, b, out).sync_on(stream) is out
        close(to_np(out), _ref(op, f64(xh), f64(wh), f64(bh)), dtype)


@pytest.mark.parametrize("dtype", FLOATS)
def test_row_ops_forms(dtype: str, stream: deviceops.Stream) -> None:
    rng = np.random.default_rng()
    xh, wh = rand(rng, (7, 33), dtype), rand(rng, (33,), dtype)
    w = dev_t(wh, stream)
    ref = _ref("rms_norm", f64(xh), f64(wh), f64(wh))
    # allocated output, DeviceOp argument
    got = kernels.rms_norm(api.from_host(xh), w).sync_on(stream)
    assert isinstance(got, deviceops.Tensor) and got.dtype == npdt(dtype)
    close(to_np(got), ref, dtype)
    # in place
    x = dev_t(xh, stream)
    assert kernels.rms_norm(x, w, out=x).sync_on(stream) is x
    close(to_np(x), ref, dtype)
    # Partition out stays a Partition
    o = poisoned((7, 33), dtype, stream)
    part = o.partition((1, 33))
    assert kernels.softmax(dev_t(xh, stream), out=part).sync_on(stream) is part
    close(to_np(o), _ref("softmax", f64(xh), f64(wh), f64(wh)), dtype)
    # layer_norm without bias, via a DeviceOp weight
    ln = kernels.layer_norm(dev_t(xh, stream), api.from_host(wh)).sync_on(stream)
    close(to_np(ln), _ref("layer_norm", f64(xh), f64(wh), np.zeros(33)), dtype)
    # gelu on an odd 3-D shape
    g = kernels.gelu(dev_t(xh.reshape(3, 7, 11), stream)).sync_on(stream)
    close(to_np(g), _gelu64(f64(xh)).reshape(3, 7, 11), dtype)


def test_row_op_errors_before_launch(stream: deviceops.Stream) -> None:
    x = api.zeros((4, 8)).sync_on(stream)
    w = api.ones((8,)).sync_on(stream)
    w7 = api.ones((7,)).sync_on(stream)
    w16 = api.ones((8,), "float16").sync_on(stream)
    xi = api.zeros((4, 8), "int32").sync_on(stream)
    o49 = api.zeros((4, 9)).sync_on(stream)
    o16 = api.zeros((4, 8), "float16").sync_on(stream)
    seq = stream.seq
    with pytest.raises(ShapeError, match=r"rms_norm.*\(7,\).*\(8,\).*\(4, 8\)"):
        kernels.rms_norm(x, w7)
    with pytest.raises(DTypeError, match=r"layer_norm.*float16.*float32"):
        kernels.layer_norm(x, w16)
    with pytest.raises(DTypeError, match=r"softmax.*int32"):
        kernels.softmax(xi)
    with pytest.raises(ShapeError, match=r"gelu.*\(4, 9\).*\(4, 8\)"):
        kernels.gelu(x, out=o49)
    with pytest.raises(DTypeError, match=r"silu.*float16"):
        kernels.silu(x, out=o16)
    with pytest.raises(ValueError, match="eps"):
        kernels.rms_norm(x, w, eps=-1.0)
    with pytest.raises(TypeError, match="Tensor"):
        kernels.softmax(np.zeros((4, 8)))
    assert stream.seq == seq
    # a deferred argument is checked after it ran, before this op launches
    out = poisoned((4, 8), "float32", stream)
    with pytest.raises(ShapeError, match=r"\(4, 8\)"):
        kernels.rms_norm(x, api.ones((5,)), out=out).sync_on(stream)
    assert np.isnan(to_np(out)).all()


# ----------------------------------------------------------------------------- argmax


@pytest.mark.parametrize("dtype", FLOATS)
def test_argmax_matches_numpy(dtype: str, stream: deviceops.Stream) -> None:
    rng = np.random.default_rng()
    for shape in [*ROW_SHAPES, (9,)]:
        xh = rand(rng, shape, dtype)
        if shape[-1] >= 5:  # ties: the first index wins
            xh[..., 3] = xh[..., 1] = np.max(f64(xh)) + 1
        x = dev_t(xh, stream)
        for idt in ("int32", "int64"):
            out = api.full(shape[:-1], -7, idt).sync_on(stream)
            assert kernels.argmax(x, out=out).sync_on(stream) is out
            got = to_np(out)
            assert got.dtype == np.dtype(idt)
            np.testing.assert_array_equal(got, np.argmax(f64(xh), axis=-1))
    got = to_np(kernels.argmax(dev_t(rand(rng, (2, 3, 7), dtype), stream), dtype="int64").sync_on(stream))
    assert got.shape == (2, 3) and got.dtype == np.int64


@pytest.mark.parametrize("dtype", FLOATS)
def test_argmax_vocab_rows(dtype: str, stream: deviceops.Stream) -> None:
    """Vocabulary-sized rows: 16-byte vector loads (aligned rows: 49152 and 4096 columns) and
    the scalar path (49157 columns: rows 1 and 2 start unaligned), ties between threads and
    inside one vector, the maximum in the tail, NaN anywhere."""
    rng = np.random.default_rng()
    for shape in [(3, 49152), (3, 49157), (4, 4096), (3, 1031)]:
        xh = rand(rng, shape, dtype)
        top = np.max(f64(xh)) + 1
        cols = shape[1]
        xh[0, cols - 1] = top                      # the last column (a tail when unaligned)
        xh[1, [cols // 2, 9, cols - 3]] = top + 1  # ties far apart: the first index wins
        xh[2, [5, 6]] = top + 2                    # a tie inside one vector
        if shape[0] > 3:
            xh[3, [700, 17]] = np.nan              # the first NaN wins
        x = dev_t(xh, stream)
        out = api.full(shape[:-1], -7, "int32").sync_on(stream)
        got = to_np(kernels.argmax(x, out=out).sync_on(stream))
        want = np.argmax(f64(xh), axis=-1)
        np.testing.assert_array_equal(got, want, err_msg=f"{shape} {dtype}")
        assert want[1] == 9 and want[2] == 5


def test_argmax_nan_and_errors(stream: deviceops.Stream) -> None:
    xh = np.array([[1.0, np.nan, 5.0, np.nan], [0.0, -1.0, 2.0, 2.0]], np.float32)
    got = to_np(kernels.argmax(dev_t(xh, stream)).sync_on(stream))
    np.testing.assert_array_equal(got, [1, 2])
    assert got.dtype == np.int32
    x = api.zeros((3, 4)).sync_on(stream)
    with pytest.raises(ShapeError, match=r"argmax.*\(4,\).*\(3,\)"):
        kernels.argmax(x, out=api.zeros((4,), "int32").sync_on(stream))
    with pytest.raises(DTypeError, match=r"argmax.*float32"):
        kernels.argmax(x, out=api.zeros((3,)).sync_on(stream))
    with pytest.raises(DTypeError, match="int32 or int64"):
        kernels.argmax(x, dtype="float32")


# ----------------------------------------------------------------------------- embedding


@pytest.mark.parametrize("tdtype", [*FLOATS, "int32"])
@pytest.mark.parametrize("idtype", ["int32", "int64"])
def test_embedding_gathers(idtype: str, tdtype: str, stream: deviceops.Stream) -> None:
    rng = np.random.default_rng()
    for v, d in [(1, 1), (7, 5), (33, 127), (50, 1000)]:
        table_h = rng.integers(-99, 99, (v, d)).astype(tdtype) if tdtype == "int32" else rand(rng, (v, d), tdtype)
        table = dev_t(table_h, stream)
        for ishape in [(), (1,), (7,), (3, 5)]:
            ids_h = rng.integers(0, v, ishape).astype(idtype)
            out = api.full((*ishape, d), -3, tdtype).sync_on(stream)
            ids = dev_t(ids_h.reshape(-1), stream).reshape(ishape)  # (from_host makes 0-d 1-d)
            assert kernels.embedding(ids, table, out=out).sync_on(stream) is out
            np.testing.assert_array_equal(f64(to_np(out)), f64(table_h[ids_h]))
    # allocated output, DeviceOp ids
    got = kernels.embedding(api.from_host(np.array([[2, 0]], idtype)), table).sync_on(stream)
    assert got.shape == (1, 2, 1000) and got.dtype == npdt(tdtype)


def test_embedding_out_of_range_and_errors(dev: deviceops.Device, stream: deviceops.Stream) -> None:
    table_h = np.arange(12, dtype=np.float32).reshape(4, 3)
    table = dev_t(table_h, stream)
    ids = dev_t(np.array([1, 4, -1], np.int32), stream)
    # documented, both backends (issue 16): out-of-range ids are clamped into [0, V)
    got = to_np(kernels.embedding(ids, table).sync_on(stream))
    np.testing.assert_array_equal(got, [table_h[1], table_h[3], table_h[0]])
    with pytest.raises(DTypeError, match=r"embedding.*float32"):
        kernels.embedding(table, table)
    with pytest.raises(ShapeError, match=r"embedding.*\(12,\)"):
        kernels.embedding(ids, table.reshape(12))
    with pytest.raises(ShapeError, match=r"embedding.*\(3, 4\).*\(3, 3\)"):
        kernels.embedding(ids, table, out=api.zeros((3, 4)).sync_on(stream))


# ----------------------------------------------------------------------------- gemm


def _gemm64(a: np.ndarray, b: np.ndarray, bias: np.ndarray | None, act: str | None,
            alpha: float = 1.0, beta: float = 0.0, c: np.ndarray | None = None) -> np.ndarray:
    v = alpha * np.matmul(f64(a), f64(b))
    if beta:
        assert c is not None
        v = v + beta * f64(c)
    if bias is not None:
        v = v + f64(bias)
    if act == "relu":
        v = np.maximum(v, 0)
    elif act == "gelu":
        v = _gelu64(v)
    elif act == "silu":
        v = v / (1 + np.exp(-v))
    return v


GEMM_CASES = [  # a shape, b shape, bias, activation
    ((1, 1), (1, 1), False, None),
    ((7, 5), (5, 127), True, "relu"),
    ((33, 127), (127, 5), True, "gelu"),
    ((7, 1000), (1000, 33), False, "silu"),
    ((2, 3, 33, 17), (17, 40), True, None),  # leading batch dims, shared b
    ((3, 7, 64), (3, 64, 24), True, "gelu"),  # batched b
    ((1, 128), (128, 512), True, "relu"),  # decode-like (gemv / split-K)
]


@pytest.mark.parametrize("dtype", FLOATS)
def test_gemm_matches_float64(dtype: str, stream: deviceops.Stream) -> None:
    rng = np.random.default_rng()
    for ashape, bshape, has_bias, act in GEMM_CASES:
        k = ashape[-1]
        ah, bh = rand(rng, ashape, dtype), rand(rng, bshape, dtype, 1 / math.sqrt(k))
        if k == 1:  # one product: keep it out of float16's subnormals (0.1% rounding there)
            ah = (np.sign(ah) * rng.uniform(0.5, 2.0, ashape)).astype(ah.dtype)
            bh = (np.sign(bh) * rng.uniform(0.5, 2.0, bshape)).astype(bh.dtype)
        biash = rand(rng, (bshape[-1],), dtype) if has_bias else None
        a, b = dev_t(ah, stream), dev_t(bh, stream)
        bias = None if biash is None else dev_t(biash, stream)
        oshape = (*ashape[:-1], bshape[-1])
        out = poisoned(oshape, dtype, stream)
        assert kernels.gemm(a, b, out, bias=bias, activation=act).sync_on(stream) is out
        ref = _gemm64(ah, bh, biash, act)
        assert rel_err(to_np(out), ref) < REL[dtype], (ashape, bshape, act)
        # allocated output, same numbers
        got = kernels.gemm(a, b, bias=bias, activation=act).sync_on(stream)
        assert got.shape == oshape and got.dtype == npdt(dtype)
        assert rel_err(to_np(got), ref) < REL[dtype]


@pytest.mark.parametrize("dtype", FLOATS)
def test_gemm_alpha_beta_and_forms(dtype: str, stream: deviceops.Stream) -> None:
    rng = np.random.default_rng()
    ah, bh, ch = rand(rng, (7, 33), dtype), rand(rng, (33, 24), dtype), rand(rng, (7, 24), dtype)
    biash = rand(rng, (24,), dtype)
    a, b, bias = dev_t(ah, stream), dev_t(bh, stream), dev_t(biash, stream)
    out = dev_t(ch, stream)
    part = out.partition((4, 8))
    got = kernels.gemm(a, b, part, bias=bias, alpha=0.5, beta=-1.5).sync_on(stream)
    assert got is part  # the form given
    ref = _gemm64(ah, bh, biash, None, 0.5, -1.5, ch)
    assert rel_err(to_np(out), ref) < REL[dtype]
    # DeviceOp arguments (a and out), run first on the same stream
    o2 = kernels.gemm(api.from_host(ah), b, api.full((7, 24), float("nan"), dtype),
                      activation="relu").sync_on(stream)
    assert isinstance(o2, deviceops.Tensor)
    assert rel_err(to_np(o2), _gemm64(ah, bh, None, "relu")) < REL[dtype]
    # matmul
    m = kernels.matmul(a, b, poisoned((7, 24), dtype, stream).partition((7, 24))).sync_on(stream)
    assert isinstance(m, deviceops.Partition)
    assert rel_err(to_np(m.tensor), _gemm64(ah, bh, None, None)) < REL[dtype]


def test_gemm_tf32(stream: deviceops.Stream) -> None:
    rng = np.random.default_rng()
    ah, bh = rand(rng, (33, 200), "float32"), rand(rng, (200, 40), "float32")
    got = kernels.gemm(dev_t(ah, stream), dev_t(bh, stream), tf32=True).sync_on(stream)
    assert rel_err(to_np(got), _gemm64(ah, bh, None, None)) < REL["tf32"]


def test_gemm_errors_before_launch(stream: deviceops.Stream) -> None:
    a = api.zeros((3, 5)).sync_on(stream)
    b = api.zeros((6, 7)).sync_on(stream)
    b_ok = api.zeros((5, 7)).sync_on(stream)
    b16 = api.zeros((5, 7), "float16").sync_on(stream)
    ai, bi = api.zeros((3, 5), "int32").sync_on(stream), api.zeros((5, 7), "int32").sync_on(stream)
    o38, bias5 = api.zeros((3, 8)).sync_on(stream), api.zeros((5,)).sync_on(stream)
    b55 = api.zeros((5, 5)).sync_on(stream)
    t53 = api.zeros((5, 3)).sync_on(stream)
    seq = stream.seq
    with pytest.raises(ShapeError, match=r"gemm.*\(3, 5\).*\(6, 7\)"):
        kernels.gemm(a, b)
    with pytest.raises(ShapeError, match=r"matmul.*\(3, 5\).*\(6, 7\)"):
        kernels.matmul(a, b)
    with pytest.raises(DTypeError, match=r"gemm.*float16.*float32"):
        kernels.gemm(a, b16)
    with pytest.raises(DTypeError, match=r"gemm.*int32"):
        kernels.gemm(ai, bi)
    with pytest.raises(ShapeError, match=r"gemm.*\(3, 8\)"):
        kernels.gemm(a, b_ok, o38)
    with pytest.raises(ShapeError, match="bias"):
        kernels.gemm(a, b_ok, bias=bias5)
    with pytest.raises(ValueError, match="activation 'tanh'"):
        kernels.gemm(a, b_ok, activation="tanh")
    with pytest.raises(ValueError, match="beta"):
        kernels.gemm(a, b_ok, beta=1.0)
    with pytest.raises(ShapeError, match="shares memory"):
        kernels.gemm(a, b55, a)
    with pytest.raises(ShapeError, match="contiguous"):
        kernels.gemm(deviceops.Tensor(t53.array.T, t53.device), b_ok)
    assert stream.seq == seq
    # a deferred argument is checked once it exists, before the gemm launches
    out = poisoned((3, 7), "float32", stream)
    with pytest.raises(ShapeError, match=r"\(4, 5\)"):
        kernels.gemm(api.zeros((4, 5)), b_ok, out).sync_on(stream)
    assert np.isnan(to_np(out)).all()


def test_gemm_rejects_tensor_on_other_device(dev: deviceops.Device, stream: deviceops.Stream) -> None:
    if dev.is_cpu:
        pytest.skip("needs a second device kind: run on a GPU machine")
    a = api.zeros((3, 5)).sync_on(stream)
    other = deviceops.device("cpu").new_stream()
    b = api.zeros((5, 7)).sync_on(other)
    with pytest.raises(DeviceError, match="gemm"):
        kernels.gemm(a, b)


def test_gemm_in_graph_capture(stream: deviceops.Stream) -> None:
    rng = np.random.default_rng()
    dt = "float32"
    ah, bh, biash = rand(rng, (1, 128), dt), rand(rng, (128, 64), dt), rand(rng, (64,), dt)
    a, b, bias = dev_t(ah, stream), dev_t(bh, stream), dev_t(biash, stream)
    out = poisoned((1, 64), dt, stream)
    kernels.gemm(a, b, out, bias=bias, activation="relu").sync_on(stream)  # warm-up: workspace
    api.memcpy(out, poisoned((1, 64), dt, stream)).sync_on(stream)
    part = out.partition((1, 16))
    g = kernels.gemm(a, b, part, bias=bias, activation="relu").graph_on(stream)
    assert np.isnan(to_np(out)).all()  # capturing runs nothing
    assert g.take_output() is part
    for _ in range(3):
        ah = rand(rng, (1, 128), dt)
        g.update(api.memcpy(a, dev_t(ah, stream)))
        g.launch()
        g.synchronize()
        assert rel_err(to_np(out), _gemm64(ah, bh, biash, "relu")) < REL[dt]


def test_capture_needs_workspace_reserved(dev: deviceops.Device) -> None:
    stream = dev.new_stream()
    a = api.zeros((1, 128)).sync_on(stream)
    b = api.ones((128, 64)).sync_on(stream)
    out = poisoned((1, 64), "float32", stream)
    with pytest.raises(CaptureError, match=r"reserve_workspace\(stream, 2048\)"):
        kernels.gemm(a, b, out).graph_on(stream)
    with pytest.raises(CaptureError, match="out="):  # allocating inside a capture
        kernels.gemm(a, b).graph_on(stream)
    kernels.reserve_workspace(stream, 2048)
    g = kernels.gemm(a, b, out, alpha=2.0).graph_on(stream)
    ah = np.random.default_rng().standard_normal((1, 128)).astype(np.float32)
    g.update(api.memcpy(a, dev_t(ah, stream)))
    g.launch()
    g.synchronize()
    # every output is the same sum of 128 terms, which can nearly cancel: the error is bounded
    # against the sum of their magnitudes (float32 accumulation), not the sum itself
    err = np.abs(to_np(out) - 2.0 * f64(ah) @ np.ones((128, 64))).max()
    assert err <= 1e-5 * 2.0 * np.abs(f64(ah)).sum(), err


# ----------------------------------------------------------------------------- attention


def _attn64(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool, scale: float | None) -> np.ndarray:
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    sc = 1 / math.sqrt(d) if scale is None else scale
    out = np.zeros((b, hq, lq, d))
    for bi in range(b):
        for h in range(hq):
            kh = h // (hq // hkv)
            for i in range(lq):
                n = lk if not causal else min(lk, max(0, i + lk - lq + 1))
                if n == 0:
                    continue
                s = f64(k[bi, kh, :n]) @ f64(q[bi, h, i]) * sc
                p = np.exp(s - s.max())
                out[bi, h, i] = p @ f64(v[bi, kh, :n]) / p.sum()
    return out


ATTN_CASES = [  # q shape, kv shape (one head dim, so a GPU run compiles few variants)
    ((1, 1, 1, 64), (1, 1, 1, 64)),
    ((1, 2, 3, 64), (1, 2, 5, 64)),
    ((2, 4, 5, 64), (2, 2, 9, 64)),  # GQA, Lq < Lk
    ((1, 4, 1, 64), (1, 1, 33, 64)),  # MQA decode
    ((1, 2, 17, 64), (1, 2, 40, 64)),  # long enough for the tensor-core path on sm_90
    ((1, 2, 9, 64), (1, 2, 3, 64)),  # Lq > Lk: causal rows that see no key are zeros
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_matches_float64(dtype: str, causal: bool, stream: deviceops.Stream) -> None:
    rng = np.random.default_rng()
    for qs, kvs in ATTN_CASES:
        qh, kh, vh = rand(rng, qs, dtype), rand(rng, kvs, dtype), rand(rng, kvs, dtype)
        q, k, v = dev_t(qh, stream), dev_t(kh, stream), dev_t(vh, stream)
        out = poisoned(qs, dtype, stream)
        assert kernels.flash_attention(q, k, v, causal=causal, out=out).sync_on(stream) is out
        assert rel_err(to_np(out), _attn64(qh, kh, vh, causal, None)) < REL[dtype], (qs, kvs)
    # allocated output, explicit scale, DeviceOp query
    got = kernels.flash_attention(api.from_host(qh), k, v, causal=causal, scale=0.3).sync_on(stream)
    assert got.shape == qs and got.dtype == npdt(dtype)
    assert rel_err(to_np(got), _attn64(qh, kh, vh, causal, 0.3)) < REL[dtype]


def test_flash_attention_errors_before_launch(stream: deviceops.Stream) -> None:
    q = api.zeros((1, 3, 4, 16), "float16").sync_on(stream)
    kv = api.zeros((1, 2, 4, 16), "float16").sync_on(stream)
    f = api.zeros((1, 2, 4, 16), "int32").sync_on(stream)  # (float32 is supported)
    h = api.zeros((1, 2, 4, 12), "float16").sync_on(stream)
    obf = api.zeros((1, 2, 4, 16), "bfloat16").sync_on(stream)
    seq = stream.seq
    with pytest.raises(ShapeError, match=r"flash_attention.*Hq=3, Hkv=2.*\(1, 3, 4, 16\)"):
        kernels.flash_attention(q, kv, kv)
    with pytest.raises(DTypeError, match=r"flash_attention.*float32"):
        kernels.flash_attention(f, f, f)
    with pytest.raises(ShapeError, match="head dim"):
        kernels.flash_attention(h, h, h)
    with pytest.raises(DTypeError, match="out dtype"):
        kernels.flash_attention(kv, kv, kv, out=obf)
    with pytest.raises(ShapeError, match="shares memory"):
        kernels.flash_attention(kv, kv, kv, out=kv)
    with pytest.raises(ValueError, match="scale"):
        kernels.flash_attention(kv, kv, kv, scale=float("inf"))
    assert stream.seq == seq


def test_flash_attention_decode_in_graph_capture(stream: deviceops.Stream) -> None:
    rng = np.random.default_rng()
    qs, kvs = (1, 4, 1, 64), (1, 1, 300, 64)
    qh, kh, vh = rand(rng, qs, "float16"), rand(rng, kvs, "float16"), rand(rng, kvs, "float16")
    q, k, v = dev_t(qh, stream), dev_t(kh, stream), dev_t(vh, stream)
    out = poisoned(qs, "float16", stream)
    with pytest.raises(CaptureError, match="reserve_workspace"):
        kernels.flash_attention(q, k, v, causal=True, out=out).graph_on(stream)
    kernels.flash_attention(q, k, v, causal=True, out=out).sync_on(stream)  # warm-up
    part = out.partition((1, 1, 1, 64))
    g = kernels.flash_attention(q, k, v, causal=True, out=part).graph_on(stream)
    assert g.take_output() is part
    for _ in range(2):
        qh = rand(rng, qs, "float16")
        g.update(api.memcpy(q, dev_t(qh, stream)))
        g.launch()
        g.synchronize()
        assert rel_err(to_np(out), _attn64(qh, kh, vh, True, None)) < REL["float16"]
