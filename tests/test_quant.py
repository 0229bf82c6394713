"""The quant family on the cpu backend: every GGUF format's NumPy dequantization equals
``gguf.quants.dequantize`` exactly; ``qmatmul`` (float32 path, and the reference mode) and
``dequantize`` match the float64 reference on odd shapes with fresh random blocks; wrong
formats, shapes and dtypes are refused before anything runs, naming the fix."""

from __future__ import annotations

import numpy as np
import pytest

import deviceops
from deviceops import DTypeError, ShapeError, api, kernels
from deviceops.kernels import quant
from deviceops.kernels.quant._cpu import dequantize_blocks
from deviceops.kernels.runtime._cpu import use_reference

from .quant_blocks import ALL_FORMATS, random_blocks, random_packed

pytestmark = pytest.mark.skipif(not deviceops.default_device().is_cpu, reason="cpu-backend semantics")


def _kdims(fmt: str) -> tuple[int, ...]:
    return (256, 768) if quant.get_format(fmt).block == 256 else (32, 96, 544)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("quantize", [True, False])
def test_numpy_dequant_equals_gguf(fmt: str, quantize: bool) -> None:
    import gguf

    rng = np.random.default_rng(hash((fmt, quantize)) % 2**32)
    for k in _kdims(fmt):
        b = random_blocks(rng, fmt, 7, k, quantize=quantize)
        ref = gguf.quants.dequantize(b, gguf.GGMLQuantizationType[fmt])
        got = dequantize_blocks(b, quant.get_format(fmt))
        assert got.shape == (7, k)
        np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_pack_round_trip(fmt: str) -> None:
    rng = np.random.default_rng(1)
    k = _kdims(fmt)[-1]
    b = random_blocks(rng, fmt, 5, k)
    p = quant.pack(b, fmt)
    assert p.dtype == np.int32 and p.shape == (5, quant.packed_words(quant.get_format(fmt), k))
    assert p.shape[1] * 4 % 16 == 0
    np.testing.assert_array_equal(quant.unpack(p, fmt, k), b)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("m", [1, 3, 17, 40])
def test_qmatmul_matches_reference(fmt: str, dtype: str, m: int) -> None:
    rng = np.random.default_rng(m)
    n, k = 37, _kdims(fmt)[-1]
    w = random_packed(rng, fmt, n, k, quantize=False)
    x = rng.standard_normal((m, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    xt, wt = api.from_host(x, dtype).sync(), api.from_host(w).sync()
    bt = api.from_host(bias, dtype).sync()
    xh = xt.to_host().sync()
    ref = quant.qmatmul_reference(xh, w, fmt, bias=bt.to_host().sync(), out_dtype=np.float64)
    tol = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
    scale = np.abs(ref).max()
    got = kernels.qmatmul(xt, wt, fmt=fmt, bias=bt).sync().to_host().sync().astype(np.float64)
    np.testing.assert_allclose(got, ref, atol=tol * scale, rtol=tol)
    with use_reference():
        got_ref = kernels.qmatmul(xt, wt, fmt=fmt, bias=bt).sync().to_host().sync().astype(np.float64)
    np.testing.assert_allclose(got_ref, ref, atol=tol * scale, rtol=tol)


def test_qmatmul_out_col_writes_only_its_columns() -> None:
    rng = np.random.default_rng(3)
    k = 64
    wa, wb = random_packed(rng, "Q4_1", 5, k), random_packed(rng, "Q8_0", 3, k)
    x = api.from_host(rng.standard_normal((2, k)).astype(np.float32)).sync()
    out = api.full((2, 10), np.nan, "float32").sync()
    kernels.qmatmul(x, api.from_host(wa).sync(), out, fmt="Q4_1").sync()
    kernels.qmatmul(x, api.from_host(wb).sync(), out, fmt="Q8_0", out_col=5).sync()
    got = out.to_host().sync()
    xh = x.to_host().sync()
    np.testing.assert_allclose(got[:, :5], quant.qmatmul_reference(xh, wa, "Q4_1"), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[:, 5:8], quant.qmatmul_reference(xh, wb, "Q8_0"), rtol=1e-5, atol=1e-5)
    assert np.isnan(got[:, 8:]).all()


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_dequantize_rows_and_ids(fmt: str) -> None:
    rng = np.random.default_rng(4)
    n, k = 11, _kdims(fmt)[0]
    w = random_packed(rng, fmt, n, k, quantize=False)
    wt = api.from_host(w).sync()
    ref = quant.dequantize_reference(w, fmt, k)
    full = kernels.dequantize(wt, fmt=fmt, k=k, dtype="float32").sync().to_host().sync()
    np.testing.assert_array_equal(full, ref.astype(np.float32))
    ids = np.array([[3, 0], [10, 99]], np.int32)  # 99: clamped to the last row
    rows = kernels.dequantize(wt, api.from_host(ids).sync(), fmt=fmt, k=k).sync().to_host().sync()
    assert rows.shape == (2, 2, k) and rows.dtype == np.float16
    np.testing.assert_array_equal(rows, ref[np.clip(ids, 0, n - 1)].astype(np.float16))
    with use_reference():
        rr = kernels.dequantize(wt, api.from_host(ids).sync(), fmt=fmt, k=k).sync().to_host().sync()
    np.testing.assert_array_equal(rr, rows)


def test_errors_name_the_problem() -> None:
    rng = np.random.default_rng(5)
    w = api.from_host(random_packed(rng, "Q4_K", 4, 256)).sync()
    x = api.from_host(rng.standard_normal((2, 256)).astype(np.float16)).sync()
    with pytest.raises(ValueError, match="unknown quantized format 'Q3_K'"):
        kernels.qmatmul(x, w, fmt="Q3_K")
    x_bad_k = api.from_host(np.zeros((2, 96), np.float16)).sync()
    with pytest.raises(ShapeError, match="K=96 is not a positive multiple of Q4_K's block of 256"):
        kernels.qmatmul(x_bad_k, w, fmt="Q4_K")
    with pytest.raises(ShapeError, match=r"must be \(N, 68\)"):
        kernels.qmatmul(x, w, fmt="Q8_0")  # a Q4_K weight read as Q8_0: 256 columns need 68 words
    with pytest.raises(DTypeError, match="int32 packed layout"):
        kernels.qmatmul(x, api.from_host(np.zeros((4, 36), np.float32)).sync(), fmt="Q4_K")
    with pytest.raises(DTypeError, match="x has dtype int32"):
        kernels.qmatmul(api.from_host(np.zeros((2, 256), np.int32)).sync(), w, fmt="Q4_K")
    with pytest.raises(ShapeError, match=r"needs \(M=2, >= 7\)"):
        kernels.qmatmul(x, w, api.zeros((2, 6), "float16").sync(), fmt="Q4_K", out_col=3)
    with pytest.raises(DTypeError, match="out has dtype float32"):
        kernels.qmatmul(x, w, api.zeros((2, 4), "float32").sync(), fmt="Q4_K")
    with pytest.raises(ShapeError, match="bias has shape"):
        kernels.qmatmul(x, w, fmt="Q4_K", bias=api.zeros((5,), "float16").sync())
    with pytest.raises(ShapeError, match="out_col=2 writes into columns of a given out"):
        kernels.qmatmul(x, w, fmt="Q4_K", out_col=2)
    with pytest.raises(ValueError, match="out_col=-1"):
        kernels.qmatmul(x, w, fmt="Q4_K", out_col=-1)
    with pytest.raises(DTypeError, match="ids have dtype float32"):
        kernels.dequantize(w, api.zeros((3,), "float32").sync(), fmt="Q4_K", k=256)
    with pytest.raises(ValueError, match="whole Q4_1 blocks"):
        quant.pack(np.zeros((2, 30), np.uint8), "Q4_1")
