"""Flash attention: argument checks, the NumPy reference, and the CUDA kernels.

CPU tests (run everywhere) check ``attention_check`` and ``attention_reference`` against a
straightforward float64 softmax(QK^T)V. GPU tests (``@pytest.mark.gpu``) run the kernels on
fresh random inputs and odd shapes against the float64 reference, outputs poisoned with NaN
first; tolerances on ||out - ref|| / ||ref||: float32 1e-5, float16 2e-3, bfloat16 1e-2.
The op-level tests (``kernels.flash_attention``) run on the default device: the cpu backend
in CI, the CUDA kernels on a GPU machine (kv_len, paged KV, float32, graph replay).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import deviceops
from deviceops import _env, api, kernels
from deviceops._errors import DTypeError, ShapeError
from deviceops.kernels import attention as attn
from deviceops.kernels.attention import AttentionOverride
from deviceops.kernels.gemm import GemmOverride
from deviceops.kernels.runtime import _override, overrides, plan_cache

from .conftest import to_np

# Optional split-KV variant under test, in benchmarks/attention.py's syntax (min_steps=N /
# target=N / warps=N / cluster=N / bulk=N), so a device run can validate a variant before it
# becomes the default.
_KNOBS = {"min_steps": "split_min_steps", "target": "split_blocks_per_sm", "warps": "split_warps",
          "cluster": "cluster", "bulk": "bulk_stages"}
_variant: dict[str, Any] = {}
for _tok in _env.get("DEVICEOPS_ATTN_VARIANT").split():
    _k, _, _v = _tok.partition("=")
    if _k not in _KNOBS:
        raise ValueError(f"DEVICEOPS_ATTN_VARIANT: unknown knob {_tok!r}; use {sorted(_KNOBS)}")
    _variant[_KNOBS[_k]] = int(_v)


def _attn(**fields: Any) -> Any:
    """The variant under test with ``fields`` replaced, installed for a ``with`` block."""
    cur = _override.active(AttentionOverride)  # nested blocks add to the enclosing one
    if cur is not None:
        return overrides(dataclasses.replace(cur, **fields))
    return overrides(AttentionOverride(**{**_variant, **fields}))


@pytest.fixture(autouse=True)
def _attn_variant() -> Any:
    """Every test of this module runs under the variant (the overrides are restored after)."""
    with _attn():
        yield

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
TOL = {F32: 1e-5, F16: 2e-3, BF16: 1e-2}


def naive(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    causal: bool,
    scale: float | None,
    kv_len: np.ndarray | None = None,
) -> np.ndarray:
    """float64 softmax(scale q k^T) v, row by row (the definition, no tricks but the max).

    With ``kv_len``, row ``b`` sees only its first ``min(kv_len[b], Lk)`` keys (as if the
    cache were that long).
    """
    b, hq, lq, d = q.shape
    hkv = k.shape[1]
    sc = 1 / math.sqrt(d) if scale is None else scale
    out = np.zeros((b, hq, lq, d))
    for bi in range(b):
        lk = k.shape[2] if kv_len is None else max(0, min(int(kv_len[bi]), k.shape[2]))
        for h in range(hq):
            kh = h // (hq // hkv)
            kk = k[bi, kh, :lk].astype(np.float64)
            vv = v[bi, kh, :lk].astype(np.float64)
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
    attn.attention_check(s, np.float32, s, np.float32, s, np.float32)  # float32 is supported
    with pytest.raises(DTypeError, match="not supported") as ei:
        attn.attention_check(s, np.float64, s, np.float64, s, np.float64)
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


def test_plan_splitkv() -> None:
    plan = attn.plan_splitkv
    # GQA 32/8 D128 on 132 SMs: one wave of 4 blocks per SM at most, never just past it
    assert plan(8, 32, 8, 1, 32768, 128, n_sm=132, split=True) == (4, 1, 8)  # 512 blocks
    assert plan(32, 32, 8, 1, 4096, 128, n_sm=132, split=True) == (4, 1, 2)
    assert plan(1, 32, 8, 1, 4096, 128, n_sm=132, split=True)[2] == attn.MAX_SPLITS
    # SmolLM2 9/3 heads of 64: the 3 heads of a kv head served by one block of 3 heads
    assert plan(1, 9, 3, 1, 256, 64, n_sm=132, split=True) == (3, 1, 1)  # <= 4 steps: no split
    assert plan(1, 9, 3, 1, 257, 64, n_sm=132, split=True)[2] > 1
    assert plan(1, 24, 2, 1, 4096, 128, n_sm=132, split=True)[:2] == (6, 2)  # g = 12: 6 + 6
    assert plan(1, 40, 2, 1, 4096, 128, n_sm=132, split=True)[:2] == (7, 3)  # g = 20: 7 + 7 + 6
    assert [plan(1, g, 1, 1, 64, 64, n_sm=132, split=True)[0] for g in range(1, 10)] == [
        1, 2, 3, 4, 5, 6, 7, 8, 5]
    assert plan(8, 32, 8, 1, 32768, 128, n_sm=132, split=False)[2] == 1  # no workspace
    assert plan(8, 32, 8, 9, 32768, 128, n_sm=132, split=True)[2] == 1  # prefill
    rng = np.random.default_rng()
    for _ in range(200):
        hkv = int(rng.integers(1, 9))
        b, g, lq = int(rng.integers(1, 65)), int(rng.integers(1, 13)), int(rng.integers(1, 9))
        lk, d = int(rng.integers(1, 70000)), int(rng.choice([32, 64, 128, 256]))
        gt, nh, ns = plan(b, g * hkv, hkv, lq, lk, d, n_sm=132, split=True)
        base = b * hkv * lq * nh
        assert gt <= 8 and gt * nh >= g > gt * (nh - 1) and 1 <= ns <= attn.MAX_SPLITS
        assert ns == 1 or base * ns <= attn.SPLIT_BLOCKS_PER_SM * 132


def test_plan_splitkv_knobs() -> None:
    """The split target and threshold the benchmarks sweep (via AttentionOverride) reach the plan."""
    plan = attn.plan_splitkv
    assert plan(1, 9, 3, 1, 256, 64, n_sm=132, split=True)[2] == 1  # 4 block steps: no split
    assert plan(1, 9, 3, 1, 256, 64, n_sm=132, split=True, min_steps=0)[2] > 1
    full = plan(8, 32, 8, 1, 32768, 128, n_sm=132, split=True)[2]
    half = plan(8, 32, 8, 1, 32768, 128, n_sm=132, split=True, blocks_per_sm=2)[2]
    assert (full, half) == (8, 4)


def test_kernel_overrides_scoped() -> None:
    """overrides() installs frozen, validated per-family objects for its block and restores the
    previous ones, nested or on error; the production launchers take no experiment keywords."""
    import dataclasses


    base = dict(_override.installed)
    with overrides(AttentionOverride(path="splitkv")):
        ov = _override.active(AttentionOverride)
        assert ov is not None and ov.path == "splitkv"
        with overrides(GemmOverride(path="sm80", splits=3)):
            assert _override.active(AttentionOverride) is ov
            assert _override.active(GemmOverride) == GemmOverride(path="sm80", splits=3)
        assert _override.active(GemmOverride) is None and _override.active(AttentionOverride) is ov
        with pytest.raises(RuntimeError), overrides(AttentionOverride(split_min_steps=0)):
            raise RuntimeError
        assert _override.active(AttentionOverride) is ov
    assert _override.installed == base
    with pytest.raises(ValueError, match="path"):
        AttentionOverride(path="sm91")
    with pytest.raises(ValueError, match="path"):
        GemmOverride(path="tma:3")  # no mini-language: typed fields
    with pytest.raises(TypeError, match="sm90_config"):
        AttentionOverride(sm90_config=[64, 4, 4])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        overrides("splitkv").__enter__()  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ov.path = None  # type: ignore[misc,union-attr]
    assert hash(AttentionOverride()) == hash(AttentionOverride())  # part of the plan-cache keys


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
    with _attn(path="splitkv" if force_splitkv else None):
        attn.flash_attention_cuda(
            dq, dk, dv, out, causal=causal, scale=scale, workspace=ws, stream=stream
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
    (1, 24, 2, 3, 129, 96, True),  # g = 12 (two head chunks of 6), Lq = 3
    (2, 4, 4, 8, 513, 128, True),
    (3, 9, 3, 1, 1537, 64, False),  # SmolLM2: g = 3, 3 heads a block
    (2, 10, 2, 2, 300, 64, True),  # g = 5
    (1, 14, 2, 1, 2049, 128, False),  # g = 7
    (2, 40, 2, 1, 999, 64, False),  # g = 20: head chunks of 7, 7, 6
]


class SplitSpy:
    """Records the grid of every split-KV launch (grid ``(blocks, n_split, batch)``): the
    plan a test meant to exercise is asserted on what was launched."""

    def __init__(self) -> None:
        self.grids: list[tuple[int, ...]] = []

    def wrap(self, orig: Any) -> Any:
        def launcher_for(device_id: int) -> Any:
            real = orig(device_id)

            def go(fn: Any, grid: Any, *rest: Any, **kw: Any) -> Any:
                self.grids.append(tuple(int(x) for x in grid))
                return real(fn, grid, *rest, **kw)

            return go

        return launcher_for

    def take_n_split(self) -> int:
        """``n_split`` of the last call's split kernel (its first launch), then forget."""
        assert self.grids, "no split-KV launch was recorded"
        n = self.grids[0][1]
        self.grids.clear()
        return n


@pytest.fixture
def split_spy(monkeypatch: pytest.MonkeyPatch) -> SplitSpy:
    from deviceops.kernels.attention import _cuda as _attention_cuda

    spy = SplitSpy()
    monkeypatch.setattr(_attention_cuda, "launcher_for", spy.wrap(_attention_cuda.launcher_for))
    plan_cache.clear()  # plans built now, with the spy
    return spy


def force_split(b: int, hq: int, hkv: int, lq: int, lk: int, d: int, f32: bool = False) -> Any:
    """The overrides that make the planner split whenever it can: no minimum cache length
    (``split_min_steps=0``, what ``plan_splitkv`` reads) and, where the warp
    planner would keep a short cache whole (``splitkv_warps`` says no split), 4-warp blocks,
    which may split."""
    _, may = attn.splitkv_warps(b, hq, hkv, lq, lk, d, f32=f32, n_sm=132)
    kw: dict[str, Any] = {"split_min_steps": 0}
    if not may:
        kw["split_warps"] = 4
    return _attn(**kw)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES_DEC, ids=str)
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("ws", [True, False], ids=["split", "nosplit"])
def test_gpu_decode(shape: tuple[int, ...], dtype: np.dtype, ws: bool, split_spy: SplitSpy) -> None:
    b, hq, hkv, lq, lk, d, c = shape
    causal = bool(c)
    rng = np.random.default_rng()
    q, k, v = (
        rand(rng, (b, hq, lq, d), dtype),
        rand(rng, (b, hkv, lk, d), dtype),
        rand(rng, (b, hkv, lk, d), dtype),
    )
    if ws:  # split whenever possible (short caches are not split by default)
        with force_split(b, hq, hkv, lq, lk, d):
            out = _run_gpu(q, k, v, causal, workspace=True)
        n_split = split_spy.take_n_split()
        assert n_split > 1 if lk > 1 else n_split == 1, (shape, n_split)  # one key: one split
    else:
        out = _run_gpu(q, k, v, causal, workspace=False)
        assert split_spy.take_n_split() == 1
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


# ----------------------------------------------------------------------------- kv_len, paged KV


def ref64(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    causal: bool,
    scale: float | None = None,
    kv_len: np.ndarray | None = None,
    block_table: np.ndarray | None = None,
) -> np.ndarray:
    """The reference on float64 copies of the inputs (no rounding of the result)."""
    f = np.float64
    return attn.attention_reference(
        q.astype(f), k.astype(f), v.astype(f), causal=causal, scale=scale, kv_len=kv_len,
        block_table=block_table,
    )  # fmt: skip


def poison_tail(x: np.ndarray, kv_len: np.ndarray) -> np.ndarray:
    """Copy of a (B, H, L, D) cache with NaN in every row at or past kv_len[b]."""
    x = x.copy()
    for b, n in enumerate(kv_len):
        x[b, :, max(0, int(n)) :] = np.nan
    return x


def test_check_kv_len_and_block_table_errors() -> None:
    q, kv = (2, 4, 1, 64), (2, 2, 9, 64)
    i32 = np.int32
    attn.attention_check(q, F16, kv, F16, kv, F16, kv_len_shape=(2,), kv_len_dtype=i32)
    with pytest.raises(ShapeError, match=r"kv_len must have shape \(B,\) = \(2,\).*got \(3,\)"):
        attn.attention_check(q, F16, kv, F16, kv, F16, kv_len_shape=(3,), kv_len_dtype=i32)
    with pytest.raises(ShapeError, match="kv_len"):
        attn.attention_check(q, F16, kv, F16, kv, F16, kv_len_shape=(2, 1), kv_len_dtype=i32)
    with pytest.raises(DTypeError, match=r"kv_len must be int32 \(got int64"):
        attn.attention_check(q, F16, kv, F16, kv, F16, kv_len_shape=(2,), kv_len_dtype=np.int64)
    pool = (7, 2, 16, 64)  # (num_blocks, Hkv, block_size, D): its first dim is not B
    attn.attention_check(q, F16, pool, F16, pool, F16, kv_len_shape=(2,), kv_len_dtype=i32,
                         block_table_shape=(2, 3), block_table_dtype=i32)  # fmt: skip
    with pytest.raises(ShapeError, match="needs kv_len"):
        attn.attention_check(q, F16, pool, F16, pool, F16, block_table_shape=(2, 3),
                             block_table_dtype=i32)  # fmt: skip
    with pytest.raises(ShapeError, match="block_table must be"):
        attn.attention_check(q, F16, pool, F16, pool, F16, kv_len_shape=(2,), kv_len_dtype=i32,
                             block_table_shape=(3, 3), block_table_dtype=i32)  # fmt: skip
    with pytest.raises(DTypeError, match="block_table must be int32"):
        attn.attention_check(q, F16, pool, F16, pool, F16, kv_len_shape=(2,), kv_len_dtype=i32,
                             block_table_shape=(2, 3), block_table_dtype=np.int64)  # fmt: skip
    with pytest.raises(ShapeError, match="batch sizes differ"):  # unpaged: k's batch is B
        attn.attention_check(q, F16, pool, F16, pool, F16, kv_len_shape=(2,), kv_len_dtype=i32)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize(
    ("hq", "hkv", "lq", "lk", "d"), [(9, 3, 1, 37, 64), (4, 2, 5, 23, 32), (2, 1, 11, 30, 128)]
)
def test_reference_kv_len_matches_naive(
    causal: bool, dtype: np.dtype, hq: int, hkv: int, lq: int, lk: int, d: int
) -> None:
    rng = np.random.default_rng()
    b = 6
    # 1 and Lk, random, 0 (no key: zeros), past Lk (clamped), below Lq (causal: empty rows)
    kv_len = np.array([1, lk, int(rng.integers(1, lk)), 0, lk + 5, max(1, lq - 2)], np.int32)
    q = rand(rng, (b, hq, lq, d), dtype)
    k = poison_tail(rand(rng, (b, hkv, lk, d), dtype), kv_len)
    v = poison_tail(rand(rng, (b, hkv, lk, d), dtype), kv_len)
    out = attn.attention_reference(q, k, v, causal=causal, kv_len=kv_len)
    assert out.dtype == dtype and out.shape == q.shape
    assert np.isfinite(out.astype(np.float64)).all()  # NaN past kv_len is never read
    want = naive(q, k, v, causal, None, kv_len)
    assert rel_err(out, want) < {F32: 1e-6, F16: 1e-3, BF16: 8e-3}[dtype]
    assert (out[3].astype(np.float64) == 0).all()  # kv_len 0
    if causal:  # row 5: kv_len = Lq - 2 (or 1): the first Lq - kv_len queries see nothing
        n_empty = lq - int(kv_len[5])
        assert (out[5, :, :n_empty].astype(np.float64) == 0).all()
    # kv_len = Lk is the same as no kv_len
    np.testing.assert_array_equal(
        out[1:2], attn.attention_reference(q[1:2], k[1:2], v[1:2], causal=causal)
    )


def _paged(
    rng: np.random.Generator, k: np.ndarray, v: np.ndarray, kv_len: np.ndarray, bs: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scatter a (B, Hkv, S, D) cache into a shuffled block pool; (k_pool, v_pool, table)."""
    b, hkv, s, d = k.shape
    mb = -(-s // bs)
    nb = b * mb + 3
    perm = rng.permutation(nb)
    table = np.full((b, mb), -1, np.int32)  # unused entries: never read
    kp = np.full((nb, hkv, bs, d), np.nan, k.dtype)  # unused blocks / slots: NaN
    vp = np.full((nb, hkv, bs, d), np.nan, v.dtype)
    for bi in range(b):
        for n in range(-(-int(min(kv_len[bi], s)) // bs)):
            phys = int(perm[bi * mb + n])
            table[bi, n] = phys
            rows = min(bs, s - n * bs)
            kp[phys, :, :rows] = k[bi, :, n * bs : n * bs + rows]
            vp[phys, :, :rows] = v[bi, :, n * bs : n * bs + rows]
    return kp, vp, table


@pytest.mark.parametrize("bs", [1, 7, 16])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_paged_equals_contiguous(bs: int, causal: bool) -> None:
    rng = np.random.default_rng()
    b, hq, hkv, lq, s, d = 4, 6, 2, 3, 40, 32
    kv_len = np.array([1, s, 17, 0], np.int32)
    q = rand(rng, (b, hq, lq, d), F32)
    k = poison_tail(rand(rng, (b, hkv, s, d), F32), kv_len)
    v = poison_tail(rand(rng, (b, hkv, s, d), F32), kv_len)
    kp, vp, table = _paged(rng, k, v, kv_len, bs)
    got = attn.attention_reference(q, kp, vp, causal=causal, kv_len=kv_len, block_table=table)
    want = attn.attention_reference(q, k, v, causal=causal, kv_len=kv_len)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    bad = table.copy()
    bad[2, 0] = kp.shape[0]  # a block that is read, outside the pool
    with pytest.raises(IndexError, match=r"block_table\[2\] holds block"):
        attn.attention_reference(q, kp, vp, causal=causal, kv_len=kv_len, block_table=bad)


# -- the op on the default device (cpu backend in CI, CUDA kernels on a GPU) --


def _dev(h: np.ndarray, stream: deviceops.Stream) -> deviceops.Tensor:
    return api.from_host(h).sync_on(stream)


def _poisoned(shape: tuple[int, ...], dtype: np.dtype, stream: deviceops.Stream) -> Any:
    name = "bfloat16" if dtype == BF16 else str(dtype)
    return api.full(shape, float("nan"), name).sync_on(stream)


@pytest.mark.parametrize("dtype", [F32, F16], ids=["f32", "f16"])
@pytest.mark.parametrize(("lq", "causal"), [(1, True), (4, True), (20, True), (20, False)])
def test_op_kv_len(dtype: np.dtype, lq: int, causal: bool, stream: deviceops.Stream) -> None:
    rng = np.random.default_rng()
    b, hq, hkv, lk, d = 3, 9, 3, 150, 64
    kv_len = np.array([lk, max(lq, 1 if not causal else lq), int(rng.integers(lq, lk))], np.int32)
    qh = rand(rng, (b, hq, lq, d), dtype)
    kh = poison_tail(rand(rng, (b, hkv, lk, d), dtype), kv_len)
    vh = poison_tail(rand(rng, (b, hkv, lk, d), dtype), kv_len)
    q, k, v = _dev(qh, stream), _dev(kh, stream), _dev(vh, stream)
    out = _poisoned(qh.shape, dtype, stream)
    lens = _dev(kv_len, stream)
    got = kernels.flash_attention(q, k, v, causal=causal, out=out, kv_len=lens).sync_on(stream)
    assert got is out
    want = ref64(qh, kh, vh, causal, kv_len=kv_len)
    assert rel_err(to_np(out), want) < TOL[dtype]
    # kv_len as a DeviceOp, allocated output
    got2 = kernels.flash_attention(q, k, v, causal=causal, kv_len=api.from_host(kv_len)).sync_on(
        stream
    )
    assert rel_err(to_np(got2), want) < TOL[dtype]


def test_op_argument_errors_before_launch(stream: deviceops.Stream) -> None:
    q = api.zeros((2, 4, 1, 32), "float16").sync_on(stream)
    kv = api.zeros((2, 2, 9, 32), "float16").sync_on(stream)
    l64 = api.zeros((2,), "int64").sync_on(stream)
    l3 = api.zeros((3,), "int32").sync_on(stream)
    bt = api.zeros((2, 1), "int32").sync_on(stream)
    seq = stream.seq
    with pytest.raises(TypeError, match="causal must be a bool"):
        kernels.flash_attention(q, kv, kv, causal="no")
    with pytest.raises(TypeError, match="causal must be a bool"):
        kernels.flash_attention(q, kv, kv, causal=None)
    with pytest.raises(DTypeError, match="kv_len must be int32"):
        kernels.flash_attention(q, kv, kv, kv_len=l64)
    with pytest.raises(ShapeError, match="kv_len must have shape"):
        kernels.flash_attention(q, kv, kv, kv_len=l3)
    with pytest.raises(ShapeError, match="needs kv_len"):
        kernels.flash_attention(q, kv, kv, block_table=bt)
    assert stream.seq == seq
    # a DeviceOp kv_len is checked once it has executed, still before the kernel launch
    with pytest.raises(DTypeError, match="kv_len must be int32"):
        kernels.flash_attention(q, kv, kv, kv_len=api.zeros((2,), "int64")).sync_on(stream)
    kernels.flash_attention(q, kv, kv, causal=np.bool_(True)).sync_on(stream)  # numpy bool ok


def test_op_decode_graph_serves_every_length(stream: deviceops.Stream) -> None:
    """One captured decode op, replayed with kv_len (and q) updated in device memory."""
    rng = np.random.default_rng()
    b, hq, hkv, s, d = 2, 8, 2, 700, 64
    kh, vh = rand(rng, (b, hkv, s, d), F16), rand(rng, (b, hkv, s, d), F16)
    k, v = _dev(kh, stream), _dev(vh, stream)
    q = _dev(rand(rng, (b, hq, 1, d), F16), stream)
    lens = _dev(np.array([1, 1], np.int32), stream)
    out = _poisoned((b, hq, 1, d), F16, stream)
    kernels.flash_attention(q, k, v, causal=True, out=out, kv_len=lens).sync_on(stream)  # warm-up
    g = kernels.flash_attention(q, k, v, causal=True, out=out, kv_len=lens).graph_on(stream)
    for n0, n1 in ((1, 700), (5, 64), (300, 129), (699, 0)):
        kv_len = np.array([n0, n1], np.int32)
        qh = rand(rng, (b, hq, 1, d), F16)
        g.update(api.memcpy(q, _dev(qh, stream)))
        g.update(api.memcpy(lens, _dev(kv_len, stream)))
        g.launch()
        g.synchronize()
        assert rel_err(to_np(out), ref64(qh, kh, vh, True, kv_len=kv_len)) < TOL[F16], kv_len


@pytest.mark.parametrize("dtype", [F32, F16], ids=["f32", "f16"])
@pytest.mark.parametrize("lq", [1, 3, 12])
def test_op_paged(dtype: np.dtype, lq: int, stream: deviceops.Stream) -> None:
    rng = np.random.default_rng()
    b, hq, hkv, s, d, bs = 3, 4, 2, 90, 64, 16
    kv_len = np.array([s, lq, int(rng.integers(lq, s))], np.int32)
    qh = rand(rng, (b, hq, lq, d), dtype)
    kh, vh = rand(rng, (b, hkv, s, d), dtype), rand(rng, (b, hkv, s, d), dtype)
    kp, vp, table = _paged(rng, kh, vh, kv_len, bs)
    out = _poisoned(qh.shape, dtype, stream)
    kernels.flash_attention(
        _dev(qh, stream), _dev(kp, stream), _dev(vp, stream), causal=True, out=out,
        kv_len=_dev(kv_len, stream), block_table=_dev(table, stream),
    ).sync_on(stream)  # fmt: skip
    assert rel_err(to_np(out), ref64(qh, kh, vh, True, kv_len=kv_len)) < TOL[dtype]


# -- CUDA kernels directly --


def _nan_array(cp: Any, shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """A device array of ``dtype`` filled with NaN (the poison)."""
    out = cp.empty(shape, dtype=dtype)
    if dtype == F32:
        out.fill(cp.nan)
    else:
        out.view(cp.uint16).fill(0x7E00 if dtype == F16 else 0x7FC0)
    return out


def _run_gpu_kv(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool, kv_len: np.ndarray | None,
    block_table: np.ndarray | None = None, *, workspace: bool = True,
) -> np.ndarray:  # fmt: skip
    cp = _cupy()
    dq, dk, dv = (cp.asarray(x) for x in (q, k, v))
    out = _nan_array(cp, q.shape, q.dtype)
    dl = None if kv_len is None else cp.asarray(kv_len)
    dbt = None if block_table is None else cp.asarray(block_table)
    bts = None if block_table is None else block_table.shape
    nbytes = attn.attention_workspace_nbytes(q.shape, k.shape, q.dtype, block_table_shape=bts)
    ws = cp.empty(max(nbytes, 1), dtype=cp.uint8) if workspace else None
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    attn.flash_attention_cuda(dq, dk, dv, out, causal=causal, kv_len=dl, block_table=dbt,
                              workspace=ws, stream=stream)  # fmt: skip
    stream.synchronize()
    return cp.asnumpy(out)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize(("hq", "hkv"), [(9, 3), (32, 8)])
@pytest.mark.parametrize("lq", [1, 3, 8, 37])
def test_gpu_kv_len(dtype: np.dtype, d: int, hq: int, hkv: int, lq: int) -> None:
    """Decode (Lq <= 8, split and unsplit) and prefill (Lq > 8, causal, Lq <= kv_len <= Lk)."""
    with _attn(split_min_steps=0):  # split whenever a workspace is given
        _check_kv_len(dtype, d, hq, hkv, lq)


def _check_kv_len(dtype: np.dtype, d: int, hq: int, hkv: int, lq: int) -> None:
    rng = np.random.default_rng()
    b, lk = 4, 333
    lo = 1 if lq <= attn.DECODE_MAX_LQ else lq
    kv_len = np.array([lo, lk, int(rng.integers(lo, lk)), int(rng.integers(lo, lk))], np.int32)
    q = rand(rng, (b, hq, lq, d), dtype)
    k = poison_tail(rand(rng, (b, hkv, lk, d), dtype), kv_len)
    v = poison_tail(rand(rng, (b, hkv, lk, d), dtype), kv_len)
    for causal in (True, False):
        want = ref64(q, k, v, causal, kv_len=kv_len)
        for ws in (True, False) if lq <= attn.DECODE_MAX_LQ else (False,):
            out = _run_gpu_kv(q, k, v, causal, kv_len, workspace=ws)
            assert np.isfinite(out.astype(np.float64)).all(), (causal, ws)
            err = rel_err(out, want)
            assert err < TOL[dtype], (causal, ws, kv_len, err)


@pytest.mark.gpu
@pytest.mark.parametrize("warps", [8, 16])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize(("d", "hq", "hkv"), [(32, 9, 3), (64, 9, 3), (128, 32, 8), (128, 4, 4)])
@pytest.mark.parametrize("lq", [1, 3, 8])
def test_gpu_wide_blocks(warps: int, dtype: np.dtype, d: int, hq: int, hkv: int, lq: int) -> None:
    """8- and 16-warp split-KV blocks, split and unsplit, contiguous and paged caches."""
    rng = np.random.default_rng()
    b, lk = 3, 1111
    kv_len = np.array([lq, lk, int(rng.integers(lq, lk))], np.int32)
    q = rand(rng, (b, hq, lq, d), dtype)
    k = poison_tail(rand(rng, (b, hkv, lk, d), dtype), kv_len)
    v = poison_tail(rand(rng, (b, hkv, lk, d), dtype), kv_len)
    kp, vp, table = _paged(rng, k, v, kv_len, 16)
    for min_steps in (0, 1 << 20):  # split whenever possible / never
        with _attn(split_warps=warps,
                                   split_min_steps=min_steps):
            for causal in (True, False):
                want = ref64(q, k, v, causal, kv_len=kv_len)
                out = _run_gpu_kv(q, k, v, causal, kv_len)
                assert rel_err(out, want) < TOL[dtype], ("contiguous", min_steps, causal)
                out = _run_gpu_kv(q, kp, vp, causal, kv_len, table)
                assert rel_err(out, want) < TOL[dtype], ("paged", min_steps, causal)


def _ragged_decode_case(
    rng: np.random.Generator, hq: int, hkv: int, lq: int, lk: int, d: int, dtype: np.dtype,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """q, K, V and kv_len of 4 batch rows: valid keys lq (fewer than any split), 70 (just past
    one split granule), lk (full) and a random length; K/V poisoned past each row's keys."""
    b = 4
    kv_len = np.array([lq, 70, lk, int(rng.integers(lq, lk))], np.int32)
    q = rand(rng, (b, hq, lq, d), dtype)
    k = poison_tail(rand(rng, (b, hkv, lk, d), dtype), kv_len)
    v = poison_tail(rand(rng, (b, hkv, lk, d), dtype), kv_len)
    return q, k, v, kv_len


@pytest.mark.gpu
@pytest.mark.parametrize("cluster", [0, 2, 4, 8])
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize(("d", "hq", "hkv", "lq"),
                         [(64, 9, 3, 1), (128, 32, 8, 1), (32, 4, 4, 3), (128, 32, 8, 8)])
def test_gpu_cluster_merge(cluster: int, dtype: np.dtype, d: int, hq: int, hkv: int,
                           lq: int) -> None:
    """Split partials merged inside a thread-block cluster of 2, 4 or 8 blocks (sm_90), or
    through the workspace and the combine kernel (0): rows with fewer valid keys than splits,
    a full cache, contiguous and paged; equal results from run to run, bit for bit."""
    cp = _cupy()
    if cluster and cp.cuda.Device().compute_capability < "90":
        pytest.skip("thread-block clusters need sm_90")
    rng = np.random.default_rng()
    q, k, v, kv_len = _ragged_decode_case(rng, hq, hkv, lq, 1500, d, dtype)
    kp, vp, table = _paged(rng, k, v, kv_len, 16)
    with _attn(cluster=cluster, split_min_steps=0):
        for causal in (True, False):
            want = ref64(q, k, v, causal, kv_len=kv_len)
            out = _run_gpu_kv(q, k, v, causal, kv_len)
            assert rel_err(out, want) < TOL[dtype], ("contiguous", causal)
            again = _run_gpu_kv(q, k, v, causal, kv_len)
            assert np.array_equal(out.view(np.uint8), again.view(np.uint8)), "not deterministic"
            out = _run_gpu_kv(q, kp, vp, causal, kv_len, table)
            assert rel_err(out, want) < TOL[dtype], ("paged", causal)


@pytest.mark.gpu
@pytest.mark.parametrize(("warps", "stages"), [(4, 1), (4, 2), (4, 3), (8, 2), (16, 2), (16, 3)])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize(("d", "hq", "hkv"), [(32, 9, 3), (64, 9, 3), (128, 32, 8), (128, 5, 5)])
@pytest.mark.parametrize("lq", [1, 3, 8])
def test_gpu_bulk_ring(warps: int, stages: int, dtype: np.dtype, d: int, hq: int,
                       hkv: int, lq: int) -> None:
    """The bulk-copy K/V ring (``ATTN_BULK``): split and unsplit, cluster merge and combine
    kernel, rows whose valid keys end inside a warp's step or before a split's first step."""
    cp = _cupy()
    if cp.cuda.Device().compute_capability < "90":
        pytest.skip("cp.async.bulk needs sm_90")
    q, k, v, kv_len = _ragged_decode_case(np.random.default_rng(), hq, hkv, lq, 1111, d, dtype)
    for min_steps, cluster in ((0, 0), (0, 4), (1 << 20, None)):
        with _attn(bulk_stages=stages, split_warps=warps,
                                   split_min_steps=min_steps, cluster=cluster):
            for causal in (True, False):
                want = ref64(q, k, v, causal, kv_len=kv_len)
                out = _run_gpu_kv(q, k, v, causal, kv_len)
                assert rel_err(out, want) < TOL[dtype], (min_steps, cluster, causal)


@pytest.mark.gpu
def test_gpu_bulk_ring_refuses_oversized() -> None:
    """A ring that does not fit shared memory is refused before any launch, naming the fix."""
    cp = _cupy()
    if cp.cuda.Device().compute_capability < "90":
        pytest.skip("cp.async.bulk needs sm_90")
    rng = np.random.default_rng()
    q = rand(rng, (1, 32, 1, 128), F16)
    k = rand(rng, (1, 8, 4096, 128), F16)
    with (_attn(bulk_stages=4,
                                split_warps=16),
          pytest.raises(ValueError, match="use fewer stages or warps")):
        _run_gpu_kv(q, k, k, False, None)


def test_splitkv_bulk_rule() -> None:
    """The measured rule: the ring only above the bandwidth threshold and for
    long enough blocks; 16 warps where each block gets a long run of steps."""
    h100, h200 = 3.35e12 / 132, 4.8e12 / 132
    assert h100 < attn.BULK_MIN_BW_PER_SM <= h200

    def plan(b: int, hq: int, hkv: int, lk: int, d: int, bw: float) -> tuple[int, int, int]:
        warps, may = attn.splitkv_warps(b, hq, hkv, 1, lk, d, f32=False, n_sm=132)
        _, _, ns = attn.plan_splitkv(b, hq, hkv, 1, lk, d, n_sm=132, split=may, warps=warps)
        return attn.splitkv_bulk(b, hq, hkv, 1, lk, d, warps=warps, n_split=ns, may_split=may,
                                 n_sm=132, bw_per_sm=bw)

    # H100: never (the plan is returned unchanged).
    for b, lk in ((1, 32768), (8, 4096), (32, 32768)):
        warps, may = attn.splitkv_warps(b, 32, 8, 1, lk, 128, f32=False, n_sm=132)
        _, _, ns = attn.plan_splitkv(b, 32, 8, 1, lk, 128, n_sm=132, split=may, warps=warps)
        assert plan(b, 32, 8, lk, 128, h100) == (0, warps, ns)
    # H200, GQA 32/8 D128: short blocks stay on the register path ...
    assert plan(1, 32, 8, 1024, 128, h200)[0] == 0
    assert plan(1, 32, 8, 4096, 128, h200)[0] == 0
    assert plan(8, 32, 8, 1024, 128, h200)[0] == 0
    # ... long ones take the ring, on 16 warps where each block gets a long run.
    assert plan(1, 32, 8, 32768, 128, h200) == (attn.BULK_STAGES, 16, 16)
    assert plan(8, 32, 8, 4096, 128, h200) == (attn.BULK_STAGES, 16, 2)
    assert plan(8, 32, 8, 32768, 128, h200) == (attn.BULK_STAGES, 16, 2)
    assert plan(32, 32, 8, 1024, 128, h200) == (attn.BULK_STAGES, 8, 1)
    assert plan(32, 32, 8, 4096, 128, h200) == (attn.BULK_STAGES, 8, 1)
    assert plan(32, 32, 8, 32768, 128, h200) == (attn.BULK_STAGES, 16, 1)
    # SmolLM2 9/3 D64: only the longest blocks.
    assert plan(32, 9, 3, 2048, 64, h200) == (attn.BULK_STAGES, 16, 1)
    assert plan(32, 9, 3, 1024, 64, h200)[0] == 0
    assert plan(8, 9, 3, 2048, 64, h200)[0] == 0
    # Prefill-shaped queries never.
    assert attn.splitkv_bulk(1, 32, 8, 64, 32768, 128, warps=4, n_split=1, may_split=True,
                             n_sm=132, bw_per_sm=h200)[0] == 0
    assert attn.splitkv_bulk_smem(128, 16, 2, 4) == 1024 + 2 * 2 * 128 * 128 * 2


def test_splitkv_cluster_rule() -> None:
    """The measured rule: cluster merge on sm_90 for head dim <= 64 and a planned split of 2
    to 16 (rounded down to a power of two, at most 8), or longer when 8 blocks per row group
    still fill the SMs; forced sizes cap any split; never below sm_90, unsplit, or when off."""
    def c(n: int, cc: int = 90, d: int = 64, forced: int | None = None, groups: int = 0) -> tuple[int, int]:
        return attn.splitkv_cluster(n, cc, d, forced, groups=groups, n_sm=132)

    assert c(1) == (1, 1) and c(6, cc=80) == (1, 6) and c(6, forced=0) == (1, 6)
    assert c(2) == (2, 2) and c(3) == (2, 2) and c(5) == (4, 4) and c(8) == (8, 8)
    assert c(16) == (8, 8) and c(17) == (1, 17) and c(64) == (1, 64)
    assert c(22, groups=24) == (8, 8) and c(32, groups=3) == (1, 32)  # SmolLM2 B8 / B1 Lk2k
    assert c(22, groups=16) == (1, 22) and c(22, groups=17) == (8, 8)  # 8 x groups vs 132 SMs
    assert c(22, d=128, groups=64) == (1, 22)
    assert c(8, d=128) == (1, 8) and c(8, d=32) == (8, 8)
    assert c(64, forced=8) == (8, 8) and c(64, forced=2) == (2, 2) and c(3, forced=8) == (2, 2)
    assert c(8, d=128, forced=4) == (4, 4) and c(1, forced=8) == (1, 1)
    with pytest.raises(ValueError, match="cluster"):
        AttentionOverride(cluster=16)


def test_splitkv_warps_rule() -> None:
    """The measured rule (H100 sweep): wide unsplit blocks for batches that fill one wave,
    16-warp splits for few long rows, 8 warps for short caches; 4 otherwise and for float32."""
    def w(*args: int, **kw: Any) -> tuple[int, bool]:
        return attn.splitkv_warps(*args, n_sm=132, **{"f32": False, **kw})

    assert w(32, 9, 3, 1, 512, 64) == (16, False)  # SmolLM2 B32: 96 pairs
    assert w(32, 9, 3, 1, 2048, 64) == (16, False)
    assert w(32, 32, 8, 1, 1024, 128) == (8, False)  # GQA B32: 256 pairs
    assert w(8, 32, 8, 1, 1024, 128) == (4, True)  # GQA B8: 64 pairs split
    assert w(1, 32, 8, 1, 1024, 128) == (4, True)
    assert w(1, 32, 8, 1, 4096, 128) == (16, True)  # GQA B1 long cache
    assert w(1, 9, 3, 1, 1024, 64) == (4, True)  # too short for 16-warp steps per split
    assert w(1, 9, 3, 1, 256, 64) == (8, False)  # short cache
    assert w(1, 32, 8, 1, 4096, 128, f32=True) == (4, True)
    assert w(1, 32, 8, 20, 4096, 128) == (4, True)  # not decode
    assert w(64, 32, 8, 1, 4096, 128) == (4, True)  # 512 pairs: 4-warp blocks fill the GPU
    with pytest.raises(ValueError, match="16 warps per split-KV block cannot serve head dim 256"):
        w(1, 32, 8, 1, 4096, 256, forced=16)
    with pytest.raises(ValueError, match="float32=True"):
        w(1, 9, 3, 1, 512, 64, f32=True, forced=8)
    assert w(1, 9, 3, 1, 512, 64, forced=16) == (16, True)
    for args in [(32, 9, 3, 1, 512, 64), (1, 32, 8, 1, 32768, 128), (8, 64, 8, 1, 4096, 256)]:
        assert w(*args)[0] in (4, 8, 16)
        assert w(*args, f32=True) == (4, True)


def test_plan_splitkv_counts_wide_blocks() -> None:
    """A block of 16 warps counts as four of 4 warps against the split target."""
    p4 = attn.plan_splitkv(8, 32, 8, 1, 32768, 128, n_sm=132, split=True, warps=4)
    p16 = attn.plan_splitkv(8, 32, 8, 1, 32768, 128, n_sm=132, split=True, warps=16)
    assert p4 == (4, 1, 8) and p16 == (4, 1, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, F16], ids=["f32", "f16"])
def test_gpu_kv_len_long_cache(dtype: np.dtype) -> None:
    """A long cache with few valid keys (most splits exit at once) and a full one."""
    rng = np.random.default_rng()
    b, hq, hkv, s, d = 3, 32, 8, 8192, 128
    kv_len = np.array([10, s, 4097], np.int32)
    q = rand(rng, (b, hq, 1, d), dtype)
    k = poison_tail(rand(rng, (b, hkv, s, d), dtype), kv_len)
    v = poison_tail(rand(rng, (b, hkv, s, d), dtype), kv_len)
    out = _run_gpu_kv(q, k, v, True, kv_len)
    assert rel_err(out, ref64(q, k, v, True, kv_len=kv_len)) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("lq", [1, 5, 40])
def test_gpu_float32_and_head_dims_without_kv_len(dtype: np.dtype, d: int, lq: int) -> None:
    rng = np.random.default_rng()
    q = rand(rng, (2, 9, lq, d), dtype)
    k, v = rand(rng, (2, 3, 201, d), dtype), rand(rng, (2, 3, 201, d), dtype)
    for causal in (True, False):
        out = _run_gpu_kv(q, k, v, causal, None)
        assert rel_err(out, ref64(q, k, v, causal)) < TOL[dtype], causal


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bs", [16, 7])
@pytest.mark.parametrize("lq", [1, 4, 20])
def test_gpu_paged(dtype: np.dtype, d: int, bs: int, lq: int, split_spy: SplitSpy) -> None:
    rng = np.random.default_rng()
    b, hq, hkv, s = 4, 32, 8, 300
    kv_len = np.array([lq, s, int(rng.integers(lq, s)), int(rng.integers(lq, s))], np.int32)
    q = rand(rng, (b, hq, lq, d), dtype)
    k, v = rand(rng, (b, hkv, s, d), dtype), rand(rng, (b, hkv, s, d), dtype)
    kp, vp, table = _paged(rng, k, v, kv_len, bs)
    # split whenever a workspace is given (decode); Lq > 8 is never split
    with force_split(b, hq, hkv, lq, s, d, f32=dtype == F32):
        for causal in (True, False):
            want = ref64(q, k, v, causal, kv_len=kv_len)
            for ws in (True, False):
                out = _run_gpu_kv(q, kp, vp, causal, kv_len, table, workspace=ws)
                assert rel_err(out, want) < TOL[dtype], (causal, ws)
                n_split = split_spy.take_n_split()
                split = ws and lq <= attn.DECODE_MAX_LQ
                assert n_split > 1 if split else n_split == 1, (causal, ws, n_split)
