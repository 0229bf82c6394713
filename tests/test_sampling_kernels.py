"""``penalize`` and ``logprobs`` (the sampling family's OpenAI features) against their float64
references, on odd shapes, with poisoned outputs.

The cpu tests run both cpu modes (the float64 reference and the float32 path); the GPU tests
(``gpu``) run the CUDA kernels (``logits.cu``) on vocabularies that take several strides per
thread, float32/float16/bfloat16 logits, ties, rows that ask for nothing (their memory must
stay poisoned: the kernels return at once for them) and ``k`` = 0, 5, 20 and ``k > V``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import deviceops
import deviceops.kernels as kernels
from deviceops import api
from deviceops.kernels.runtime._cpu import use_reference
from deviceops.kernels.sampling import logprobs_reference, penalize_reference

POISON = -7.25e30


def _case(b: int, v: int, seed: int, dtype: str = "float32") -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((b, v)) * 3).astype(np.float32)
    logits[:, 1] = logits[:, 2]  # a tie (the lower id comes first)
    import ml_dtypes

    host = logits.astype(np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else dtype)
    mode = (np.arange(b) % 4).astype(np.int32)  # 0 nothing, 1 adjust, 2 logprobs, 3 both
    return {
        "logits": host,
        "counts": rng.integers(0, 4, (b, v)).astype(np.int32),
        "bias": np.where(rng.random((b, v)) < 0.1, rng.uniform(-100, 100, (b, v)), 0).astype(
            np.float32),
        "presence": rng.uniform(-2, 2, b).astype(np.float32),
        "frequency": rng.uniform(-2, 2, b).astype(np.float32),
        "mode": mode,
        "tokens": rng.integers(0, v, b).astype(np.int32),
    }


def _run(c: dict[str, np.ndarray], k: int, stream: Any) -> tuple[np.ndarray, ...]:
    up = {n: api.from_host(a).sync_on(stream) for n, a in c.items()}
    b = c["logits"].shape[0]
    vals = api.from_host(np.full((b, k + 1), POISON, np.float32)).sync_on(stream)
    ids = api.from_host(np.full((b, k), -99, np.int32)).sync_on(stream)
    kernels.penalize(up["logits"], up["counts"], up["bias"], up["presence"], up["frequency"],
                     up["mode"]).sync_on(stream)
    kernels.logprobs(up["logits"], up["tokens"], up["mode"], up["counts"], k=k, out=vals,
                     ids_out=ids).sync_on(stream)
    return tuple(t.to_host().sync_on(stream) for t in (up["logits"], up["counts"], vals, ids))


def _want(c: dict[str, np.ndarray], k: int) -> tuple[np.ndarray, ...]:
    pen = penalize_reference(c["logits"], c["counts"], c["bias"], c["presence"],
                             c["frequency"], c["mode"])
    counts = c["counts"].copy()
    b = pen.shape[0]
    vals = np.full((b, k + 1), POISON, np.float32)
    ids = np.full((b, k), -99, np.int32)
    logprobs_reference(pen, c["tokens"], c["mode"], counts, vals, ids)
    return pen, counts, vals, ids


def _check(got: tuple[np.ndarray, ...], want: tuple[np.ndarray, ...], tol: float,
           mode: np.ndarray) -> None:
    pen, counts, vals, ids = got
    wpen, wcounts, wvals, wids = want
    np.testing.assert_allclose(pen.astype(np.float64), wpen.astype(np.float64), rtol=tol,
                               atol=tol)
    np.testing.assert_array_equal(counts, wcounts)
    asked = (mode & 2) != 0
    assert (vals[~asked] == POISON).all() and (ids[~asked] == -99).all()  # not written
    np.testing.assert_allclose(vals[asked], wvals[asked], rtol=tol, atol=tol)
    np.testing.assert_array_equal(ids[asked], wids[asked])


@pytest.mark.parametrize("reference", [True, False], ids=["float64", "float32"])
@pytest.mark.parametrize(("b", "v", "k"), [(4, 37, 5), (5, 1031, 20), (3, 7, 20), (4, 11, 0)])
def test_penalize_and_logprobs_match_the_reference_on_cpu(reference: bool, b: int, v: int,
                                                          k: int) -> None:
    c = _case(b, v, seed=v + k)
    s = deviceops.device("cpu").new_stream()
    with use_reference(reference):
        got = _run(c, k, s)
    _check(got, _want(c, k), 1e-5, c["mode"])
    vals, ids = got[2], got[3]
    for r in np.nonzero(c["mode"] & 2)[0]:  # the top is sorted, -inf/-1 past the vocabulary
        top = vals[r, 1:]
        assert (np.diff(top[np.isfinite(top)]) <= 0).all()
        assert (ids[r, v:] == -1).all() and np.isneginf(top[v:]).all()


def test_penalize_is_openai_formula() -> None:
    """One row by hand: bias added, presence once for a seen token, frequency per count."""
    logits = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    counts = np.array([[0, 1, 3, 0]], np.int32)
    bias = np.array([[0.0, 0.0, 0.0, -10.0]], np.float32)
    s = deviceops.device("cpu").new_stream()
    lt = api.from_host(logits).sync_on(s)
    kernels.penalize(lt, api.from_host(counts), api.from_host(bias),
                     api.from_host(np.array([0.5], np.float32)),
                     api.from_host(np.array([0.25], np.float32)),
                     api.from_host(np.array([1], np.int32))).sync_on(s)
    np.testing.assert_allclose(lt.to_host().sync_on(s), [[1.0, 2 - 0.75, 3 - 1.25, -6.0]])


def test_bad_arguments_are_refused_before_launch() -> None:
    s = deviceops.device("cpu").new_stream()
    lg = api.zeros((2, 5), "float32").sync_on(s)
    i32 = api.zeros((2,), "int32").sync_on(s)
    cnt = api.zeros((2, 5), "int32").sync_on(s)
    f32 = api.zeros((2,), "float32").sync_on(s)
    with pytest.raises(deviceops.ShapeError, match="counts"):
        kernels.penalize(lg, api.zeros((2, 4), "int32").sync_on(s), lg, f32, f32, i32)
    with pytest.raises(deviceops.DTypeError, match="bias"):
        kernels.penalize(lg, cnt, cnt, f32, f32, i32)
    with pytest.raises(ValueError, match="k="):
        kernels.logprobs(lg, i32, i32, cnt, k=21)
    with pytest.raises(deviceops.ShapeError, match="out"):
        kernels.logprobs(lg, i32, i32, cnt, k=3, out=api.zeros((2, 3), "float32").sync_on(s))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(("b", "v", "k"), [(6, 49157, 20), (5, 1031, 5), (4, 7, 20), (4, 300, 0)])
def test_penalize_and_logprobs_match_the_reference_on_cuda(dtype: str, b: int, v: int,
                                                           k: int) -> None:
    c = _case(b, v, seed=v + k, dtype=dtype)
    s = deviceops.device(0).new_stream()
    got = _run(c, k, s)
    want = _want(c, k)
    # the penalised logits are rounded to the dtype: one unit of its last place
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
    pen = got[0].astype(np.float64)
    np.testing.assert_allclose(pen, want[0].astype(np.float64), rtol=tol, atol=tol)
    # log-probabilities of the device's own penalised logits (float64 oracle over them)
    c2 = dict(c, logits=got[0])
    _check(got, _want_logprobs_only(c2, k, want[1]), 1e-4, c["mode"])


def _want_logprobs_only(c: dict[str, np.ndarray], k: int, counts: np.ndarray
                        ) -> tuple[np.ndarray, ...]:
    b = c["logits"].shape[0]
    vals = np.full((b, k + 1), POISON, np.float32)
    ids = np.full((b, k), -99, np.int32)
    cnt = c["counts"].copy()
    logprobs_reference(c["logits"], c["tokens"], c["mode"], cnt, vals, ids)
    assert (cnt == counts).all()
    return c["logits"], counts, vals, ids
