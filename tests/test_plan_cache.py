"""The kernel plan cache (kernels/runtime/_plan.py): hits, keys, and no stale answer.

A launcher's argument check runs once per (launcher statics, tensor signatures, alias
pattern); these tests pin what must NOT be served from the cache.
"""

from __future__ import annotations

import numpy as np
import pytest

import deviceops
from deviceops import DTypeError, ShapeError, Tensor, api, kernels
from deviceops.kernels.runtime import _plan


@pytest.fixture
def s() -> deviceops.Stream:
    return deviceops.device("cpu").new_stream()


def test_repeated_calls_hit(s: deviceops.Stream) -> None:
    x = api.ones((3, 40)).sync_on(s)
    w = api.ones((40,)).sync_on(s)
    o = api.zeros((3, 40)).sync_on(s)
    _plan.clear()
    for _ in range(5):
        kernels.rms_norm(x, w, eps=1e-5, out=o).sync_on(s)
    st = _plan.stats()
    assert st["misses"] == 1 and st["hits"] == 4
    np.testing.assert_allclose(api.to_host(o).sync_on(s), 1.0, rtol=1e-5)


def test_closed_over_parameter_is_part_of_the_key(s: deviceops.Stream) -> None:
    x = api.ones((2, 7)).sync_on(s)
    a = kernels.argmax(x).sync_on(s)
    b = kernels.argmax(x, dtype="int64").sync_on(s)
    assert str(a.dtype) == "int32" and str(b.dtype) == "int64"


def test_alias_pattern_is_part_of_the_key(s: deviceops.Stream) -> None:
    a = api.ones((4, 4)).sync_on(s)
    b = api.ones((4, 4)).sync_on(s)
    c = api.zeros((4, 4)).sync_on(s)
    kernels.gemm(a, b, out=c).sync_on(s)  # cached: distinct storages
    with pytest.raises(ShapeError, match="shares memory"):
        kernels.gemm(a, b, out=a)


def test_contiguity_is_part_of_the_key(s: deviceops.Stream) -> None:
    x = api.ones((3, 8)).sync_on(s)
    o = api.zeros((3, 8)).sync_on(s)
    kernels.softmax(x, out=o).sync_on(s)
    nc = Tensor(np.ones((3, 16), np.float32)[:, ::2], deviceops.device("cpu"))
    assert nc.shape == (3, 8) and not nc.is_contiguous
    with pytest.raises(ShapeError, match="contiguous"):
        kernels.softmax(nc, out=o)


def test_a_failed_check_is_not_cached(s: deviceops.Stream) -> None:
    x = api.ones((3, 8)).sync_on(s)
    bad_w = api.ones((7,)).sync_on(s)
    for _ in range(2):
        with pytest.raises(ShapeError):
            kernels.rms_norm(x, bad_w)
    w16 = api.ones((8,), "float16").sync_on(s)
    for _ in range(2):
        with pytest.raises(DTypeError):
            kernels.rms_norm(x, w16)


def test_partition_args_are_checked_each_time(s: deviceops.Stream) -> None:
    x = api.ones((4, 8)).sync_on(s)
    o = api.zeros((4, 8)).sync_on(s)
    _plan.clear()
    kernels.softmax(x.partition((2, 8)), out=o).sync_on(s)
    assert _plan.stats()["entries"] == 0
    with pytest.raises(ShapeError):
        kernels.softmax(x.partition((2, 8)), out=api.zeros((4, 9)).sync_on(s)).sync_on(s)


def test_deferred_args_are_planned_once_their_values_are_known(s: deviceops.Stream) -> None:
    """A DeviceOp argument's output is a fresh storage each call: the plan is keyed by the
    alias pattern as positions, so a repeated chain hits it (checked once, as for Tensors),
    and a misfit is still refused before anything of the op runs."""
    o = api.zeros((4, 8)).sync_on(s)
    _plan.clear()
    for _ in range(3):
        got = kernels.softmax(api.ones((4, 8)), out=o).sync_on(s)
        np.testing.assert_allclose(got.to_host().sync_on(s), np.full((4, 8), 1 / 8), rtol=1e-6)
    st = _plan.stats()
    assert st["entries"] == 1 and st["misses"] == 1 and st["hits"] == 2
    with pytest.raises(ShapeError):
        kernels.softmax(api.ones((4, 9)), out=o).sync_on(s)
    np.testing.assert_allclose(o.to_host().sync_on(s), np.full((4, 8), 1 / 8), rtol=1e-6)
    assert _plan.stats()["entries"] == 1  # a failed check is not cached


def test_deferred_alias_pattern_is_part_of_the_key(s: deviceops.Stream) -> None:
    """One DeviceOp's output passed twice (``shared``) and two outputs are two plans."""
    _plan.clear()
    twice = api.full((3, 3), 2.0).shared()
    got = kernels.gemm(twice, twice).sync_on(s).to_host().sync_on(s)
    np.testing.assert_array_equal(got, np.full((3, 3), 12.0, np.float32))
    got = kernels.gemm(api.full((3, 3), 2.0), api.full((3, 3), 3.0)).sync_on(s).to_host().sync_on(s)
    np.testing.assert_array_equal(got, np.full((3, 3), 18.0, np.float32))
    assert _plan.stats()["entries"] == 2


def test_a_deferred_partition_takes_the_general_path(s: deviceops.Stream) -> None:
    x = api.ones((4, 8)).sync_on(s)
    o = api.zeros((4, 8)).sync_on(s)
    _plan.clear()
    part = api.dup(x).map(lambda t: t.partition((2, 8)))
    got = kernels.softmax(part, out=o).sync_on(s)
    np.testing.assert_allclose(got.to_host().sync_on(s), np.full((4, 8), 1 / 8), rtol=1e-6)
    assert _plan.stats()["entries"] == 0


def test_cache_is_bounded(s: deviceops.Stream, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_plan, "LIMIT", 8)
    _plan.clear()
    for n in range(1, 20):
        kernels.softmax(api.ones((1, n)).sync_on(s)).sync_on(s)
    assert _plan.stats()["entries"] <= 8


def test_partition_tiling_cache_keeps_validating(s: deviceops.Stream) -> None:
    """Tensor.partition remembers validated (shape, tile) pairs; equal-comparing non-ints
    (256.0 == 256, True == 1) must still be refused after the int form was cached."""
    z = api.zeros((1024,)).sync_on(s)
    one = api.zeros((7,)).sync_on(s)
    assert z.partition((256,)).grid == (4,) and z.partition((256,)).grid == (4,)
    assert one.partition((1,)).grid == (7,)
    for bad, t in (((256.0,), z), ((True,), one), ((0,), z), ((256, 1), z)):
        with pytest.raises(ShapeError):
            t.partition(bad)


def test_the_key_includes_the_device() -> None:
    """One process drives several devices: the same launcher on tensors of the same
    signature on ``cpu:0`` and ``cpu:1`` makes two plans, each keyed ``(device, op, statics,
    signature)`` with its own device, and each device's call hits its own plan."""
    devs = [deviceops.device("cpu:0"), deviceops.device("cpu:1")]
    ts = []
    for d in devs:
        st = d.new_stream()
        ts.append((st, api.ones((2, 16)).sync_on(st), api.ones((16,)).sync_on(st)))
    _plan.clear()
    for st, x, w in ts:
        kernels.rms_norm(x, w, eps=1e-5).sync_on(st)
    keys = [k for k, _ in _plan.entries()]
    assert len(keys) == 2 and {k[0] for k in keys} == set(devs)
    assert all(k[1] is keys[0][1] and k[2] == (1e-5,) for k in keys)  # same op, same statics
    for st, x, w in ts:
        kernels.rms_norm(x, w, eps=1e-5).sync_on(st)
    assert _plan.stats() == {"hits": 2, "misses": 2, "entries": 2}
    # a plan of one device never serves a call on the other: its output lives on its device
    st1, x1, w1 = ts[1]
    out = kernels.rms_norm(x1, w1, eps=1e-5).sync_on(st1)
    assert out.device is devs[1]
