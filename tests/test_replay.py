"""Bound launches and kernel specs, the parts that need no GPU (kernels/runtime/_replay.py,
kernels/runtime/_spec.py): what a recording maps to, when a record is stale, recorder hygiene, and
the plan key (statics, signatures, aliasing). tests/test_replay_gpu.py checks replays
against fresh executions on a GPU."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import deviceops
from deviceops import ShapeError, api, kernels
from deviceops.extend import set_launch_recorder
from deviceops.kernels.runtime import _driver, _plan, _replay


@pytest.fixture
def s() -> deviceops.Stream:
    return deviceops.device("cpu").new_stream()


def test_record_maps_storages_to_argument_positions(s: deviceops.Stream) -> None:
    a, b = api.ones((4,)).sync_on(s), api.zeros((4,)).sync_on(s)
    view = b.reshape(2, 2)  # the same storage as b
    args = (a, b, None, view)
    sets = [([a._storage], [b._storage]), ([view._storage], [b._storage])]
    rec = _replay.record([("call",)], sets, args)
    assert rec is not None
    assert rec.rpos == (0, 1) and rec.wpos == (1,)  # the view maps to b's position
    assert rec.extra_r == () and rec.extra_w == ()


def test_nothing_launched_or_declared_is_not_a_record(s: deviceops.Stream) -> None:
    a = api.ones((4,)).sync_on(s)
    assert _replay.record([], [([a._storage], [])], (a,)) is None
    assert _replay.record([("call",)], [], (a,)) is None


def test_a_workspace_is_held_weakly_and_a_dead_one_makes_the_record_stale(
        s: deviceops.Stream) -> None:
    a = api.ones((4,)).sync_on(s)
    ws = api.zeros((64,)).sync_on(s)  # stands for the stream's workspace
    rec = _replay.record([("call",)], [([a._storage], [ws._storage])], (a,))
    assert rec is not None and rec.wpos == () and len(rec.extra_w) == 1
    assert rec.extra_w[0]() is ws._storage
    del ws
    gc.collect()
    assert rec.run(s, (a,), 0) is False  # stale: returns before any driver call


def test_recorders_do_not_nest_and_are_reset_after_an_error() -> None:
    with pytest.raises(ValueError), _replay.recording():
        assert _driver.recorder is not None
        raise ValueError("body failed")
    assert _driver.recorder is None
    prev = set_launch_recorder(None)
    assert prev is None
    with _replay.recording(), pytest.raises(RuntimeError, match="do not nest"), _replay.recording():
        pass


def test_statics_are_part_of_the_plan_key(s: deviceops.Stream) -> None:
    x = api.from_host(np.linspace(-1, 1, 24, dtype=np.float32).reshape(3, 8)).sync_on(s)
    w = api.ones((8,)).sync_on(s)
    o = api.zeros((3, 8)).sync_on(s)
    _plan.clear()
    kernels.rms_norm(x, w, eps=1e-6, out=o).sync_on(s)
    a = api.to_host(o).sync_on(s)
    kernels.rms_norm(x, w, eps=0.5, out=o).sync_on(s)
    b = api.to_host(o).sync_on(s)
    assert _plan.stats()["misses"] == 2 and not np.allclose(a, b)
    kernels.rms_norm(x, w, eps=0.5, out=o).sync_on(s)
    assert _plan.stats()["hits"] == 1


def test_one_spec_serving_two_launchers_names_the_one_called(s: deviceops.Stream) -> None:
    a, b = api.ones((3, 4)).sync_on(s), api.ones((5, 6)).sync_on(s)
    with pytest.raises(ShapeError, match=r"^matmul: "):
        kernels.matmul(a, b)
    with pytest.raises(ShapeError, match=r"^gemm: "):
        kernels.gemm(a, b)


def test_unhashable_static_still_works_uncached(s: deviceops.Stream) -> None:
    from deviceops.kernels.norms.op import _RMS_NORM

    x, w = api.ones((2, 4)).sync_on(s), api.ones((4,)).sync_on(s)
    out = _RMS_NORM.op((x, w, None), ([1e-6],)).sync_on(s)  # a list: not hashable
    np.testing.assert_allclose(api.to_host(out).sync_on(s), 1.0, rtol=1e-5)


class _FakeKernelFn:
    """Stands in for a launcher in the PDL launch path: what ``_launch_ex`` reads."""

    _fptr = 1234
    name = "fake_kernel"
    device_index = 3


def _fake_launch_ex(monkeypatch: pytest.MonkeyPatch, results: list[int]) -> list[tuple[int, int]]:
    calls: list[tuple[int, int]] = []

    def fake(cfg_addr: int, fptr: int, params: int, extra: object) -> int:
        calls.append((fptr, params))
        return results.pop(0)

    monkeypatch.setattr(_driver, "_cu_launch_ex", fake)
    return calls


def test_pdl_launch_retries_once_on_the_kernels_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A PDL launch from a thread whose current context is another device's (CUresult 201)
    makes the kernel's device current, retries once, and gives the thread its device back."""
    import sys
    import types

    seen: list[int] = []
    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(
        setDevice=seen.append, getDevice=lambda: 0)))  # fmt: skip
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    calls = _fake_launch_ex(monkeypatch, [201, 0])
    cfg = _driver._pdl_config((2, 1, 1), (128, 1, 1), 0, 4096)
    assert cfg[0].shared_mem == 4096 and cfg[0].grid_x == 2
    _driver._launch_ex(_FakeKernelFn(), cfg, 99)  # type: ignore[arg-type]
    assert calls == [(1234, 99), (1234, 99)] and seen == [3, 0]


def test_pdl_launch_failure_names_kernel_device_and_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_launch_ex(monkeypatch, [700])
    cfg = _driver._pdl_config((1, 1, 1), (32, 1, 1), 0)
    with pytest.raises(deviceops.DriverError, match=r"fake_kernel.*cuda:3.*CUresult 700.*DEVICEOPS_PDL=0"):
        _driver._launch_ex(_FakeKernelFn(), cfg, 5)  # type: ignore[arg-type]


def test_pdl_configs_are_cached_per_shared_memory_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two launches that differ only in dynamic shared memory get two launch configs."""
    _fake_launch_ex(monkeypatch, [0, 0])
    monkeypatch.setattr(_driver, "_configs", {})
    entry = (77, None, None)
    _driver.launch_packed_pdl(_FakeKernelFn(), (1, 1, 1), (32, 1, 1), 0, 0, entry)
    _driver.launch_packed_pdl(_FakeKernelFn(), (1, 1, 1), (32, 1, 1), 65536, 0, entry)
    sizes = sorted(cfg[0].shared_mem for cfg in _driver._configs.values())
    assert sizes == [0, 65536]


def test_launcher_for_follows_the_pdl_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_driver, "_pdl_devices", {5: False, 6: True})
    assert _driver.launcher_for(5) is _driver.launch_plain
    assert _driver.launcher_for(6) is _driver.launch_pdl
    seen: list[tuple[object, ...]] = []

    class Ln:
        def __call__(self, *a: object) -> None:
            seen.append(a)

    _driver.launch_plain(Ln(), (1, 1, 1), (32, 1, 1), (1, 2), 9, 128)  # type: ignore[arg-type]
    assert seen == [((1, 1, 1), (32, 1, 1), (1, 2), 9, 128)]


def test_plain_launch_retry_on_the_kernels_device_then_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """``retry_or_raise``: an invalid-context failure makes the kernel's device current,
    launches again and gives the thread its device back; a second failure, or any other error,
    raises DriverError naming the kernel."""
    import sys
    import types

    seen: list[int] = []
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(
        runtime=types.SimpleNamespace(setDevice=seen.append, getDevice=lambda: 0))))  # fmt: skip
    launches: list[int] = []
    monkeypatch.setattr(_driver, "_cu_launch", lambda fptr, *rest: launches.append(fptr))
    exc = RuntimeError("invalid context")
    exc.status = 201  # type: ignore[attr-defined]
    _driver.retry_or_raise(_FakeKernelFn(), exc, (1, 1, 1), (32, 1, 1), 0, 0, 0)
    assert seen == [3, 0] and launches == [1234]
    other = RuntimeError("launch out of resources")
    with pytest.raises(deviceops.DriverError, match=r"fake_kernel.*cuda:3.*out of resources"):
        _driver.retry_or_raise(_FakeKernelFn(), other, (1, 1, 1), (32, 1, 1), 0, 0, 0)
