"""The kernels the BERT encoder added: ``split_qkv`` and the GEMM epilogue's ``gelu_erf``.

Each against float64 NumPy on odd shapes: on the cpu backend here, on CUDA in the tests
marked ``gpu`` (every dtype, unaligned views that force the narrow copy units, the GEMM
paths from GEMV-like to tiled). The attention an encoder runs (non-causal, ``kv_len`` as
the key-padding mask, head dim 32) is checked against an explicit mask.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import deviceops
from deviceops import DTypeError, ShapeError, api, kernels
from deviceops.kernels.runtime._cpu import erf_np

F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)


def _host(t: Any) -> np.ndarray:
    """A tensor (or an op producing one) on the host."""
    return np.asarray(api.to_host(t).sync())


def _split64(x: np.ndarray, hq: int, hkv: int) -> tuple[np.ndarray, ...]:
    """An independent split: head ``h`` of row ``(b, l)`` is ``x[b, l, h*D:(h+1)*D]``."""
    b, length, width = x.shape
    d = width // (hq + 2 * hkv)
    q = np.empty((b, hq, length, d))
    k = np.empty((b, hkv, length, d))
    v = np.empty((b, hkv, length, d))
    for h in range(hq + 2 * hkv):
        col = x[:, :, h * d:(h + 1) * d].astype(np.float64)
        if h < hq:
            q[:, h] = col
        elif h < hq + hkv:
            k[:, h - hq] = col
        else:
            v[:, h - hq - hkv] = col
    return q, k, v


@pytest.mark.parametrize(("b", "length", "hq", "hkv", "d"),
                         [(1, 1, 1, 1, 8), (3, 7, 4, 2, 8), (2, 13, 3, 3, 24), (5, 3, 6, 1, 40)])
def test_split_qkv_matches_float64(b: int, length: int, hq: int, hkv: int, d: int) -> None:
    rng = np.random.default_rng(b * 100 + length)
    x = rng.standard_normal((b, length, (hq + 2 * hkv) * d)).astype(np.float32)
    q, k, v = kernels.split_qkv(api.from_host(x), n_heads=hq, n_kv_heads=hkv).sync()
    assert q.shape == (b, hq, length, d) and k.shape == v.shape == (b, hkv, length, d)
    for got, want in zip((q, k, v), _split64(x, hq, hkv), strict=True):
        np.testing.assert_array_equal(_host(got), want.astype(np.float32))


def test_split_qkv_into_given_outputs_and_errors() -> None:
    x = api.from_host(np.arange(2 * 3 * 36, dtype=np.float32).reshape(2, 3, 36)).sync()
    q = api.zeros((2, 4, 3, 3)).sync()
    k = api.zeros((2, 4, 3, 3)).sync()
    v = api.zeros((2, 4, 3, 3)).sync()
    got = kernels.split_qkv(x, n_heads=4, q_out=q, k_out=k, v_out=v).sync()
    assert got == (q, k, v)
    want = _split64(_host(x), 4, 4)
    np.testing.assert_array_equal(_host(v), want[2])
    with pytest.raises(ShapeError, match=r"qkv has shape \(2, 3, 36\).*multiple of 14"):
        kernels.split_qkv(x, n_heads=4, n_kv_heads=5)
    with pytest.raises(ShapeError, match=r"k_out is \(2, 4, 3, 2\)"):
        kernels.split_qkv(x, n_heads=4, k_out=api.zeros((2, 4, 3, 2)).sync())
    with pytest.raises(DTypeError, match="v_out"):
        kernels.split_qkv(x, n_heads=4, v_out=api.zeros((2, 4, 3, 3), np.float16).sync())
    with pytest.raises(ShapeError, match="shares memory"):
        kernels.split_qkv(x, n_heads=4, q_out=q, k_out=q)
    with pytest.raises(ValueError, match="n_heads=0"):
        kernels.split_qkv(x, n_heads=0)


def test_erf_np_float32_path_is_close_to_math_erf() -> None:
    x = np.concatenate([np.linspace(-7, 7, 20001), [0.0, -0.0, 1e-30, -1e-30, 40.0, -40.0]])
    want = np.array([math.erf(v) for v in x])
    np.testing.assert_array_equal(erf_np(x), want)  # float64: math.erf itself
    err = np.abs(erf_np(x.astype(np.float32)).astype(np.float64) - want)
    assert err.max() < 6e-7, err.max()
    assert erf_np(np.float32([0.0]))[0] == 0.0 and erf_np(np.float32([40.0]))[0] == 1.0


def test_gelu_erf_np_float32_chunks_match_float64() -> None:
    from deviceops.kernels.runtime._cpu import gelu_erf_np

    x = np.random.default_rng(5).standard_normal((7, 5003)) * 4  # several chunks, odd tail
    want = _gelu_erf64(x)
    np.testing.assert_allclose(gelu_erf_np(x), want, rtol=1e-14, atol=1e-15)  # float64: exact
    got = gelu_erf_np(x.astype(np.float32))
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
    half = gelu_erf_np(x.astype(np.float16))
    assert half.dtype == np.float16
    np.testing.assert_allclose(half.astype(np.float64), want, rtol=2e-3, atol=2e-3)


def _gelu_erf64(v: np.ndarray) -> np.ndarray:
    return np.array([0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0))) for x in v.ravel()]
                    ).reshape(v.shape)


@pytest.mark.parametrize(("m", "k", "n", "bias"), [(1, 7, 5, True), (17, 33, 29, True),
                                                   (64, 96, 200, False)])
def test_gemm_gelu_erf_matches_float64(m: int, k: int, n: int, bias: bool) -> None:
    rng = np.random.default_rng(m + k + n)
    a = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) / math.sqrt(k)).astype(np.float32) * 2
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    got = _host(kernels.gemm(api.from_host(a), api.from_host(w), trans_b=True,
                             bias=None if b is None else api.from_host(b),
                             activation="gelu_erf"))
    pre = a.astype(np.float64) @ w.T.astype(np.float64) + (0 if b is None else b)
    want = _gelu_erf64(pre)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    # and it is not the tanh form (which differs by up to ~1e-3 around |x| ~ 2)
    tanh = _host(kernels.gemm(api.from_host(a), api.from_host(w), trans_b=True,
                              bias=None if b is None else api.from_host(b), activation="gelu"))
    if m * n > 100:
        assert np.abs(tanh - want).max() > 1e-4


def test_gemm_refuses_an_unknown_activation_naming_gelu_erf() -> None:
    a = api.zeros((2, 2)).sync()
    with pytest.raises(ValueError, match="gelu_erf"):
        kernels.gemm(a, a, activation="erf")


def _masked_attention64(q: np.ndarray, k: np.ndarray, v: np.ndarray, lens: np.ndarray
                        ) -> np.ndarray:
    """Non-causal attention with an explicit key-padding mask (float64)."""
    q, k, v = (t.astype(np.float64) for t in (q, k, v))
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1])
    mask = np.arange(k.shape[2])[None, None, None, :] >= lens[:, None, None, None]
    s = np.where(mask, -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v  # type: ignore[no-any-return]


def _attention_case(dtype: np.dtype[Any], b: int, h: int, length: int, d: int,
                    dev: deviceops.Device | None = None) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(length)
    q, k, v = (rng.standard_normal((b, h, length, d)).astype(dtype) for _ in range(3))
    lens = rng.integers(1, length + 1, b).astype(np.int32)
    lens[0] = length
    s = (dev or deviceops.default_device()).new_stream()
    out = kernels.flash_attention(*(api.from_host(t) for t in (q, k, v)), causal=False,
                                  kv_len=api.from_host(lens)).sync_on(s)
    got = np.asarray(out.to_host().sync_on(s)).astype(np.float64)
    return got, _masked_attention64(q, k, v, lens)


def test_encoder_attention_is_the_padding_mask_cpu() -> None:
    got, want = _attention_case(F32, 3, 2, 19, 32, deviceops.device("cpu"))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# -- CUDA ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_split_qkv_cuda(dtype: np.dtype[Any]) -> None:
    dev = deviceops.device(0)
    s = dev.new_stream()
    for b, length, hq, hkv, d in [(1, 1, 1, 1, 8), (3, 37, 12, 12, 32), (2, 5, 7, 1, 24),
                                  (4, 129, 4, 2, 64)]:
        x = np.random.default_rng(d).standard_normal((b, length, (hq + 2 * hkv) * d)).astype(dtype)
        q, k, v = kernels.split_qkv(api.from_host(x), n_heads=hq, n_kv_heads=hkv).sync_on(s)
        for got, want in zip((q, k, v), _split64(x, hq, hkv), strict=True):
            np.testing.assert_array_equal(np.asarray(got.to_host().sync_on(s)).astype(np.float64),
                                          want)
    # a view one element in: 2-byte copy units (every pointer only 2-byte aligned)
    if dtype != F32:
        flat = np.random.default_rng(1).standard_normal(1 + 2 * 3 * 3 * 8).astype(dtype)
        t = api.from_host(flat).sync_on(s)
        x3 = t[1:].reshape(2, 3, 24)
        q, k, v = kernels.split_qkv(x3, n_heads=1).sync_on(s)
        want = _split64(flat[1:].reshape(2, 3, 24), 1, 1)
        for got, w in zip((q, k, v), want, strict=True):
            np.testing.assert_array_equal(np.asarray(got.to_host().sync_on(s)).astype(np.float64), w)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_gemm_gelu_erf_cuda(dtype: np.dtype[Any]) -> None:
    dev = deviceops.device(0)
    s = dev.new_stream()
    tol = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 2e-2}[dtype.name]
    # rows from GEMV-like to tiled (the planner's paths), BERT's shapes among them
    for m, k, n in [(1, 384, 1536), (7, 96, 40), (256, 384, 1536), (1000, 72, 130)]:
        rng = np.random.default_rng(m)
        a = rng.standard_normal((m, k)).astype(dtype)
        w = (rng.standard_normal((n, k)) * 2 / math.sqrt(k)).astype(dtype)
        b = rng.standard_normal(n).astype(dtype)
        out = kernels.gemm(api.from_host(a), api.from_host(w), bias=api.from_host(b),
                           trans_b=True, activation="gelu_erf").sync_on(s)
        got = np.asarray(out.to_host().sync_on(s)).astype(np.float64)
        pre = a.astype(np.float64) @ w.astype(np.float64).T + b.astype(np.float64)
        want = 0.5 * pre * (1 + np.vectorize(math.erf)(pre / math.sqrt(2)))
        rel = np.linalg.norm(got - want) / max(np.linalg.norm(want), np.linalg.norm(pre))
        assert rel < tol, (m, k, n, rel)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_encoder_attention_is_the_padding_mask_cuda(dtype: np.dtype[Any]) -> None:
    tol = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 2e-2}[dtype.name]
    for b, h, length in [(3, 12, 19), (2, 12, 128), (5, 4, 9)]:
        got, want = _attention_case(dtype, b, h, length, 32, deviceops.device(0))
        assert np.abs(got - want).max() < tol * 10, (b, h, length)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < tol
