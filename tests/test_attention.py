"""Flash attention: argument checks, the NumPy reference, and the CUDA kernels.

CPU tests (run everywhere) check ``attention_check`` and ``attention_reference`` against a
straightforward float64 softmax(QK^T)V. GPU tests (``@pytest.mark.gpu``) run the kernels on
fresh random inputs and odd shapes against the float64 reference, outputs poisoned with NaN
first; tolerances on ||out - ref|| / ||ref||: float16 2e-3, bfloat16 1e-2 (METHOD.md).
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from deviceops._errors import DTypeError, ShapeError
from deviceops.kernels import _attention as attn

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
TOL = {F16: 2e-3, BF16: 1e-2}


def naive(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool, scale: float | None
) -> np.ndarray:
    """float64 softmax(scale q k^T) v, row by row (the definition, no tricks but the max)."""
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    sc = 1 / math.sqrt(d) if scale is None else scale
    out = np.zeros((b, hq, lq, d))
    for bi in range(b):
        for h in range(hq):
            kh = h // (hq // hkv)
            kk = k[bi, kh].astype(np.float64)
            vv = v[bi, kh].astype(np.float64)
            for i in range(lq):
                s = kk @ q[bi, h, i].astype(np.float64) * sc
                n_vis = lk if not causal else min(lk, max(0, i + (lk - lq) + 1))
                if n_vis == 0:
                    continue
                s = s[:n_vis]
                p = np.exp(s - s.max())
                out[bi, h, i] = p @ vv[:n_vis] / p.sum()
    return out


def rand(
    rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype, amp: float = 1.0
) -> np.ndarray:
    return (rng.standard_normal(shape) * amp).astype(dtype)


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    o = out.astype(np.float64)
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(o - ref) / (den if den > 0 else 1.0))


# ----------------------------------------------------------------------------- checks


def test_check_ok_and_gqa() -> None:
    shp, dt = attn.attention_check((2, 8, 5, 64), F16, (2, 2, 9, 64), F16, (2, 2, 9, 64), F16)
    assert shp == (2, 8, 5, 64) and dt == F16
    attn.attention_check((1, 4, 1, 128), BF16, (1, 1, 7, 128), BF16, (1, 1, 7, 128), BF16,
                         out_shape=(1, 4, 1, 128), out_dtype=BF16)  # fmt: skip


@pytest.mark.parametrize(
    ("q", "k", "v", "match"),
    [
        ((2, 8, 5), (2, 2, 9, 64), (2, 2, 9, 64), "4-D"),
        ((2, 8, 5, 64), (3, 2, 9, 64), (3, 2, 9, 64), "batch"),
        ((2, 8, 5, 64), (2, 3, 9, 64), (2, 3, 9, 64), "multiple of kv heads"),
        ((2, 8, 5, 64), (2, 2, 9, 32), (2, 2, 9, 32), "head dims differ"),
        ((2, 8, 5, 64), (2, 2, 9, 64), (2, 2, 8, 64), "k and v"),
        ((2, 8, 5, 60), (2, 2, 9, 60), (2, 2, 9, 60), "multiple of 8"),
        ((2, 8, 5, 512), (2, 2, 9, 512), (2, 2, 9, 512), "<= 256"),
        ((2, 8, 0, 64), (2, 2, 9, 64), (2, 2, 9, 64), ">= 1"),
    ],
)
def test_check_shape_errors(
    q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...], match: str
) -> None:
    with pytest.raises(ShapeError, match=match) as ei:
        attn.attention_check(q, F16, k, F16, v, F16)
    assert isinstance(ei.value, ValueError)
    assert str(q) in str(ei.value) or "got" in str(ei.value)


def test_check_dtype_errors() -> None:
    s = (1, 2, 3, 64)
    with pytest.raises(DTypeError, match="not supported") as ei:
        attn.attention_check(s, np.float32, s, np.float32, s, np.float32)
    assert isinstance(ei.value, TypeError)
    with pytest.raises(DTypeError, match="must match"):
        attn.attention_check(s, F16, s, BF16, s, F16)
    with pytest.raises(DTypeError, match="out dtype"):
        attn.attention_check(s, F16, s, F16, s, F16, out_dtype=BF16)
    with pytest.raises(ShapeError, match="out shape"):
        attn.attention_check(s, F16, s, F16, s, F16, out_shape=(1, 2, 3, 32))


def test_workspace_nbytes() -> None:
    assert attn.attention_workspace_nbytes((8, 32, 1, 128), (8, 8, 4096, 128), F16) > 0
    assert attn.attention_workspace_nbytes((8, 32, 4096, 128), (8, 8, 4096, 128), F16) == 0


# ----------------------------------------------------------------------------- reference


@pytest.mark.parametrize(
    ("b", "hq", "hkv", "lq", "lk", "d", "causal"),
    [
        (1, 1, 1, 1, 1, 8, False),
        (2, 4, 2, 7, 13, 32, True),  # GQA, Lq < Lk, causal bottom-right
        (1, 6, 1, 5, 5, 16, True),  # MQA
        (1, 2, 2, 9, 4, 24, True),  # Lq > Lk: first rows see no key -> zeros
        (2, 3, 3, 17, 31, 40, False),
        (1, 2, 1, 1, 33, 64, True),  # decode
    ],
)
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_reference_matches_naive(
    b: int, hq: int, hkv: int, lq: int, lk: int, d: int, causal: bool, dtype: np.dtype
) -> None:
    rng = np.random.default_rng()
    q, k, v = (
        rand(rng, (b, hq, lq, d), dtype),
        rand(rng, (b, hkv, lk, d), dtype),
        rand(rng, (b, hkv, lk, d), dtype),
    )
    ref = naive(q, k, v, causal, None)
    out = attn.attention_reference(q, k, v, causal=causal)
    assert out.dtype == dtype and out.shape == q.shape
    assert np.isfinite(out.astype(np.float64)).all()
    # only the final rounding to 16 bits differs
    assert rel_err(out, ref) < (1e-3 if dtype == F16 else 8e-3)
    if causal and lq > lk:
        assert (out[:, :, : lq - lk].astype(np.float64) == 0).all()


def test_reference_large_logits_and_scale() -> None:
    rng = np.random.default_rng()
    q = rand(rng, (1, 2, 6, 32), F16, 40.0)
    k = rand(rng, (1, 2, 11, 32), F16, 40.0)
    v = rand(rng, (1, 2, 11, 32), F16)
    for scale in (None, 0.5, 3.0):
        ref = naive(q, k, v, True, scale)
        out = attn.attention_reference(q, k, v, causal=True, scale=scale)
        assert np.isfinite(out.astype(np.float64)).all()
        assert rel_err(out, ref) < 1e-3


# ----------------------------------------------------------------------------- GPU


def _cupy() -> Any:
    return pytest.importorskip("cupy", reason="needs CuPy")


def _run_gpu(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool, scale: float | None = None,
    *, workspace: bool = True, force_splitkv: bool = False,
) -> np.ndarray:  # fmt: skip
    cp = _cupy()
    dq, dk, dv = (cp.asarray(x) for x in (q, k, v))  # CuPy 14 takes ml_dtypes.bfloat16
    out = cp.empty(q.shape, dtype=q.dtype)
    out.view(cp.uint16).fill(0x7E00 if q.dtype == F16 else 0x7FC0)  # NaN poison
    nbytes = attn.attention_workspace_nbytes(q.shape, k.shape, q.dtype)
    ws = cp.empty(max(nbytes, 1), dtype=cp.uint8) if workspace else None
    cp.cuda.Device().synchronize()  # inputs and poison (null stream) before the non-blocking stream
    stream = cp.cuda.Stream(non_blocking=True)
    attn.flash_attention_cuda(
        dq, dk, dv, out, causal=causal, scale=scale, workspace=ws, stream=stream,
        _force_splitkv=force_splitkv,
    )  # fmt: skip
    stream.synchronize()
    return cp.asnumpy(out)


SHAPES_FWD = [
    # (b, hq, hkv, lq, lk, d, causal)
    (1, 2, 2, 63, 63, 64, False),
    (1, 2, 2, 64, 64, 64, True),
    (2, 4, 2, 65, 65, 64, True),
    (1, 2, 1, 127, 129, 128, True),
    (1, 2, 2, 129, 127, 128, True),  # Lq > Lk
    (1, 4, 1, 1000, 1000, 128, True),
    (1, 2, 2, 300, 1000, 64, True),  # KV cache prefill chunk
    (2, 2, 2, 129, 65, 128, False),
    (1, 2, 2, 256, 256, 128, False),
    (1, 2, 2, 100, 257, 32, True),
    (1, 2, 1, 77, 130, 96, True),
    (1, 2, 2, 129, 200, 256, True),
    (1, 3, 3, 9, 1, 64, False),
    (1, 2, 2, 9, 1, 128, True),  # Lq > Lk = 1: only the last row sees a key
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES_FWD, ids=str)
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
def test_gpu_forward(shape: tuple[int, ...], dtype: np.dtype) -> None:
    b, hq, hkv, lq, lk, d, c = shape
    causal = bool(c)
    rng = np.random.default_rng()
    q, k, v = (
        rand(rng, (b, hq, lq, d), dtype),
        rand(rng, (b, hkv, lk, d), dtype),
        rand(rng, (b, hkv, lk, d), dtype),
    )
    out = _run_gpu(q, k, v, causal)
    assert np.isfinite(out.astype(np.float32)).all()
    ref = attn.attention_reference(q, k, v, causal=causal).astype(np.float64)
    ref64 = naive(q, k, v, causal, None) if lq * lk <= 70000 else ref
    assert rel_err(out, ref64) < TOL[dtype], rel_err(out, ref64)


SHAPES_DEC = [
    (8, 32, 8, 1, 4096, 128, False),
    (2, 8, 1, 1, 1000, 64, True),  # MQA
    (1, 4, 4, 1, 1, 128, False),
    (1, 4, 2, 1, 65, 32, False),
    (1, 16, 2, 1, 777, 256, True),  # g = 8
    (1, 24, 2, 3, 129, 96, True),  # g = 12 (two head chunks), Lq = 3
    (2, 4, 4, 8, 513, 128, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES_DEC, ids=str)
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("ws", [True, False], ids=["split", "nosplit"])
def test_gpu_decode(shape: tuple[int, ...], dtype: np.dtype, ws: bool) -> None:
    b, hq, hkv, lq, lk, d, c = shape
    causal = bool(c)
    rng = np.random.default_rng()
    q, k, v = (
        rand(rng, (b, hq, lq, d), dtype),
        rand(rng, (b, hkv, lk, d), dtype),
        rand(rng, (b, hkv, lk, d), dtype),
    )
    out = _run_gpu(q, k, v, causal, workspace=ws)
    assert np.isfinite(out.astype(np.float32)).all()
    ref = attn.attention_reference(q, k, v, causal=causal).astype(np.float64)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [(1, 4, 2, 65, 130, 64, True), (1, 2, 1, 33, 17, 40, True), (1, 2, 2, 50, 70, 128, False)],
    ids=str,
)
def test_gpu_portable_fallback(shape: tuple[int, ...]) -> None:
    b, hq, hkv, lq, lk, d, c = shape
    causal = bool(c)
    rng = np.random.default_rng()
    q, k, v = (
        rand(rng, (b, hq, lq, d), F16),
        rand(rng, (b, hkv, lk, d), F16),
        rand(rng, (b, hkv, lk, d), F16),
    )
    out = _run_gpu(q, k, v, causal, force_splitkv=True)
    ref = naive(q, k, v, causal, None)
    assert rel_err(out, ref) < TOL[F16]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("lq", [1, 200])
def test_gpu_large_logits(dtype: np.dtype, lq: int) -> None:
    rng = np.random.default_rng()
    q = rand(rng, (1, 2, lq, 64), dtype, 30.0)
    k = rand(rng, (1, 2, 300, 64), dtype, 30.0)
    v = rand(rng, (1, 2, 300, 64), dtype)
    out = _run_gpu(q, k, v, True, scale=1.0)
    assert np.isfinite(out.astype(np.float32)).all()
    ref = attn.attention_reference(q, k, v, causal=True, scale=1.0).astype(np.float64)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.gpu
def test_gpu_refuses_noncontiguous() -> None:
    cp = _cupy()
    q = cp.zeros((1, 2, 64, 128), dtype=cp.float16)[..., :64]
    k = cp.zeros((1, 2, 64, 64), dtype=cp.float16)
    out = cp.zeros((1, 2, 64, 64), dtype=cp.float16)
    with pytest.raises(ShapeError, match="contiguous"):
        attn.flash_attention_cuda(q, k, k, out, stream=cp.cuda.Stream())
    with pytest.raises(ShapeError):
        attn.flash_attention_cuda(k, k, k[:, :1, :32], out, stream=cp.cuda.Stream())


@pytest.mark.gpu
def test_gpu_graph_capture() -> None:
    """The launcher neither allocates nor synchronises: it captures into a CUDA graph."""
    cp = _cupy()
    rng = np.random.default_rng()
    q, k, v = (
        rand(rng, (1, 4, 1, 128), F16),
        rand(rng, (1, 2, 500, 128), F16),
        rand(rng, (1, 2, 500, 128), F16),
    )
    dq, dk, dv = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    q2, k2, v2 = (
        rand(rng, (1, 4, 300, 128), F16),
        rand(rng, (1, 2, 300, 128), F16),
        rand(rng, (1, 2, 300, 128), F16),
    )
    dq2, dk2, dv2 = cp.asarray(q2), cp.asarray(k2), cp.asarray(v2)
    out = cp.full(q.shape, cp.nan, dtype=cp.float16)
    out2 = cp.full(q2.shape, cp.nan, dtype=cp.float16)
    ws = cp.empty(attn.attention_workspace_nbytes(q.shape, k.shape, F16), dtype=cp.uint8)
    s = cp.cuda.Stream(non_blocking=True)
    # warm (compile) outside the capture
    attn.flash_attention_cuda(dq, dk, dv, out, workspace=ws, stream=s)
    attn.flash_attention_cuda(dq2, dk2, dv2, out2, causal=True, stream=s)
    s.synchronize()
    out.fill(cp.nan)
    out2.fill(cp.nan)
    cp.cuda.Device().synchronize()
    s.begin_capture()
    attn.flash_attention_cuda(dq, dk, dv, out, workspace=ws, stream=s)
    attn.flash_attention_cuda(dq2, dk2, dv2, out2, causal=True, stream=s)
    g = s.end_capture()
    g.launch(stream=s)
    s.synchronize()
    assert rel_err(cp.asnumpy(out), attn.attention_reference(q, k, v).astype(np.float64)) < 2e-3
    assert (
        rel_err(
            cp.asnumpy(out2), attn.attention_reference(q2, k2, v2, causal=True).astype(np.float64)
        )
        < 2e-3
    )


@pytest.mark.gpu
@pytest.mark.parametrize("lq", [1, 130])
def test_gpu_negative_scale(lq: int) -> None:
    """scale <= 0 takes the kernel's general softmax path (max after scaling)."""
    rng = np.random.default_rng()
    q = rand(rng, (1, 4, lq, 128), F16)
    k = rand(rng, (1, 2, 150, 128), F16)
    v = rand(rng, (1, 2, 150, 128), F16)
    out = _run_gpu(q, k, v, True, scale=-0.2)
    ref = naive(q, k, v, True, -0.2)
    assert np.isfinite(out.astype(np.float32)).all()
    assert rel_err(out, ref) < TOL[F16]
