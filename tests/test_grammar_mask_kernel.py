"""``mask_logits`` (a grammar's allowed-token bitmask applied to the logits) against its NumPy
reference and a bit-by-bit oracle, on odd vocabulary sizes (a last word partly used), with
rows that do not ask (left untouched) and bitmasks whose top bit is set (negative int32
words). The GPU test (``gpu``) runs ``logits.cu``'s kernel on float32/float16/bfloat16."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import deviceops
import deviceops.kernels as kernels
from deviceops import api
from deviceops.kernels.runtime._cpu import use_reference
from deviceops.kernels.sampling import MASK_BIT, mask_logits_reference


def _case(b: int, v: int, seed: int, dtype: str = "float32") -> dict[str, np.ndarray]:
    import ml_dtypes

    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((b, v)) * 3).astype(np.float32)
    host = logits.astype(np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else dtype)
    w = -(-v // 32)
    bits = rng.random((b, w * 32)) < 0.3
    bits[:, 31::32] = True  # every word's top bit: negative int32 words
    words = np.packbits(bits.reshape(b, w, 4, 8), axis=-1, bitorder="little")
    mask = words.reshape(b, w * 4).view("<i4").astype(np.int32)
    mode = np.array([(MASK_BIT if i % 3 else 0) | (i % 4 & 3) for i in range(b)], np.int32)
    return {"logits": host, "mask": mask, "mode": mode, "bits": bits[:, :v]}


def _oracle(c: dict[str, np.ndarray]) -> np.ndarray:
    """Bit by bit, in plain Python: the token's bit of its word, least significant first."""
    out = c["logits"].astype(np.float64)
    b, v = out.shape
    for r in range(b):
        if not int(c["mode"][r]) & MASK_BIT:
            continue
        for t in range(v):
            word = int(c["mask"][r, t // 32]) & 0xFFFFFFFF
            if not (word >> (t % 32)) & 1:
                out[r, t] = -np.inf
    return out


def _run(c: dict[str, np.ndarray], stream: Any) -> np.ndarray:
    lt = api.from_host(c["logits"]).sync_on(stream)
    out = kernels.mask_logits(lt, api.from_host(c["mask"]), api.from_host(c["mode"])
                              ).sync_on(stream)
    assert out is lt
    return lt.to_host().sync_on(stream)


@pytest.mark.parametrize("reference", [True, False], ids=["float64", "float32"])
@pytest.mark.parametrize(("b", "v"), [(5, 37), (3, 1031), (4, 7), (3, 64), (2, 265)])
def test_mask_logits_matches_the_oracle_on_cpu(reference: bool, b: int, v: int) -> None:
    c = _case(b, v, seed=v + b)
    s = deviceops.device("cpu").new_stream()
    with use_reference(reference):
        got = _run(c, s)
    want = _oracle(c)
    np.testing.assert_array_equal(got.astype(np.float64), want)
    np.testing.assert_array_equal(mask_logits_reference(c["logits"], c["mask"], c["mode"]),
                                  want.astype(np.float32))
    asked = (c["mode"] & MASK_BIT) != 0
    assert asked.any() and (~asked).any()
    # rows that asked: -inf exactly where the bit is 0, the logit itself elsewhere
    for r in np.nonzero(asked)[0]:
        assert np.isneginf(got[r][~c["bits"][r]]).all()
        np.testing.assert_array_equal(got[r][c["bits"][r]], c["logits"][r][c["bits"][r]])
    np.testing.assert_array_equal(got[~asked], c["logits"][~asked])  # not touched


def test_a_masked_row_samples_only_allowed_tokens() -> None:
    """Greedy and sampled draws after the mask land on allowed tokens only."""
    b, v = 4, 101
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((b, v)).astype(np.float32) * 4
    allowed = np.zeros((b, v), bool)
    for r in range(b):
        allowed[r, rng.choice(v, 3, replace=False)] = True
    w = -(-v // 32)
    bits = np.zeros((b, w * 32), bool)
    bits[:, :v] = allowed
    mask = np.packbits(bits.reshape(b, w, 4, 8), axis=-1, bitorder="little").reshape(
        b, w * 4).view("<i4").astype(np.int32)
    s = deviceops.device("cpu").new_stream()
    for temp in (0.0, 1.0):
        for seed in range(5):
            lt = api.from_host(logits).sync_on(s)
            kernels.mask_logits(lt, api.from_host(mask),
                                api.from_host(np.full(b, MASK_BIT, np.int32))).sync_on(s)
            tok = kernels.sample(lt, api.from_host(np.full(b, temp, np.float32)),
                                 api.from_host(np.zeros(b, np.int32)),
                                 api.from_host(np.ones(b, np.float32)),
                                 api.from_host(np.full(b, seed, np.int64)),
                                 api.from_host(np.zeros(b, np.int64))).sync_on(s)
            got = tok.to_host().sync_on(s)
            assert all(allowed[r, int(got[r])] for r in range(b)), (temp, seed, got)


def test_bad_bitmasks_are_refused_before_launch() -> None:
    s = deviceops.device("cpu").new_stream()
    lg = api.zeros((2, 33), "float32").sync_on(s)
    mode = api.zeros((2,), "int32").sync_on(s)
    with pytest.raises(deviceops.ShapeError, match=r"bitmask has shape \(2, 1\), expected \(2, 2\)"):
        kernels.mask_logits(lg, api.zeros((2, 1), "int32").sync_on(s), mode)
    with pytest.raises(deviceops.DTypeError, match="bitmask"):
        kernels.mask_logits(lg, api.zeros((2, 2), "int64").sync_on(s), mode)
    with pytest.raises(deviceops.ShapeError, match="mode"):
        kernels.mask_logits(lg, api.zeros((2, 2), "int32").sync_on(s),
                            api.zeros((3,), "int32").sync_on(s))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(("b", "v"), [(6, 49157), (5, 1031), (4, 7), (3, 151936)])
def test_mask_logits_matches_the_oracle_on_cuda(dtype: str, b: int, v: int) -> None:
    c = _case(b, v, seed=v + b, dtype=dtype)
    s = deviceops.device(0).new_stream()
    got = _run(c, s).astype(np.float64)
    want = mask_logits_reference(c["logits"], c["mask"], c["mode"]).astype(np.float64)
    np.testing.assert_array_equal(got, want)  # -inf or the logit itself: no rounding
