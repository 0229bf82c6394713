"""The quant family's CUDA kernels against the float64 reference (``gguf.quants.dequantize``,
then float64 math): every format's GEMV at M = 1, 3, 8, 17, 32 (and 45: two row tiles) on odd
N, K a multiple of the block, float16 and bfloat16 activations, a bias, outputs poisoned
(NaN) first and written at a column offset; the dequantization kernel (all rows, and ids).
Tolerance: float32 accumulation and one rounding of the output, relative to the output's
scale (fp16 2e-3, bf16 1.6e-2)."""

from __future__ import annotations

import numpy as np
import pytest

import deviceops
from deviceops import api, kernels
from deviceops.kernels import quant

from .quant_blocks import ALL_FORMATS, random_packed

pytestmark = pytest.mark.gpu

_TOL = {"float16": 2e-3, "bfloat16": 1.6e-2}


def _gpu() -> deviceops.Device:
    dev = deviceops.default_device()
    if dev.is_cpu:
        pytest.skip("needs a CUDA GPU")
    return dev


def _k(fmt: str) -> int:
    return 768 if quant.get_format(fmt).block == 256 else 608  # 3 super-blocks / 19 blocks


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m", [1, 3, 8, 17, 32, 45])
def test_qmatmul_gpu(fmt: str, dtype: str, m: int) -> None:
    _gpu()
    rng = np.random.default_rng(1000 + m)
    n, k, col = 333, _k(fmt), 5
    w = random_packed(rng, fmt, n, k, quantize=False)
    x = api.from_host(rng.standard_normal((m, k)).astype(np.float32), dtype).sync()
    bias = api.from_host(rng.standard_normal(n).astype(np.float32), dtype).sync()
    out = api.full((m, n + col + 2), np.nan, dtype).sync()
    kernels.qmatmul(x, api.from_host(w).sync(), out, fmt=fmt, bias=bias, out_col=col).sync()
    got = out.to_host().sync().astype(np.float64)
    ref = quant.qmatmul_reference(x.to_host().sync(), w, fmt, bias=bias.to_host().sync(),
                                  out_dtype=np.float64)
    tol = _TOL[dtype]
    np.testing.assert_allclose(got[:, col:col + n], ref, atol=tol * np.abs(ref).max(), rtol=tol)
    assert np.isnan(got[:, :col]).all() and np.isnan(got[:, col + n:]).all()


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_qmatmul_gpu_unaligned_x_and_quantized_data(fmt: str) -> None:
    """x at an 8-byte offset (the scalar-load path) and blocks quantized from real data."""
    _gpu()
    rng = np.random.default_rng(7)
    n, k = 129, _k(fmt)
    w = random_packed(rng, fmt, n, k)
    xbig = api.from_host(rng.standard_normal((3 * k + 4,)).astype(np.float32), "float16").sync()
    x = xbig[4:].reshape((3, k))
    got = kernels.qmatmul(x, api.from_host(w).sync(), fmt=fmt).sync().to_host().sync().astype(np.float64)
    ref = quant.qmatmul_reference(x.to_host().sync(), w, fmt, out_dtype=np.float64)
    np.testing.assert_allclose(got, ref, atol=2e-3 * np.abs(ref).max(), rtol=2e-3)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_dequantize_gpu(fmt: str, dtype: str) -> None:
    _gpu()
    rng = np.random.default_rng(11)
    n, k = 77, _k(fmt)
    w = random_packed(rng, fmt, n, k, quantize=False)
    wt = api.from_host(w).sync()
    ref = quant.dequantize_reference(w, fmt, k)
    out = api.full((n, k), np.nan, dtype).sync()
    got = kernels.dequantize(wt, out=out, fmt=fmt, k=k).sync().to_host().sync()
    np.testing.assert_allclose(got.astype(np.float64), ref, rtol=_TOL.get(dtype, 1e-6) / 2, atol=0)
    off = 8 // np.dtype(np.float32 if dtype == "float32" else np.float16).itemsize  # 8 bytes in
    obig = api.full((n * k + off,), np.nan, dtype).sync()
    kernels.dequantize(wt, out=obig[off:].reshape((n, k)), fmt=fmt, k=k).sync()  # scalar stores
    np.testing.assert_array_equal(obig.to_host().sync()[off:].reshape(n, k), got)
    ids = np.array([5, 0, 76, -3, 500], np.int64)
    rows = kernels.dequantize(wt, api.from_host(ids).sync(), fmt=fmt, k=k, dtype=dtype).sync()
    np.testing.assert_allclose(rows.to_host().sync().astype(np.float64), ref[np.clip(ids, 0, n - 1)],
                               rtol=_TOL.get(dtype, 1e-6) / 2, atol=0)
