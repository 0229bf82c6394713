"""Stream and event semantics, on the cpu backend always and on CUDA when present."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import deviceops
from deviceops import api, kernels
from deviceops.kernels.testing import slow_copy

from .conftest import overlapped, to_np, traced


def _devices() -> list[str]:
    return ["cpu", "cuda"] if deviceops.cuda_available() else ["cpu"]


@pytest.fixture(params=_devices())
def anydev(request: pytest.FixtureRequest) -> deviceops.Device:
    return deviceops.device(request.param)


def test_event_completes_in_order(anydev: deviceops.Device) -> None:
    s = anydev.new_stream()
    src = api.ones((1024,)).sync_on(s)
    dst = api.zeros((1024,)).sync_on(s)
    slow_copy(dst, src, 0.05).async_on(s)
    ev = s.record_event()
    assert not ev.query(), "event after a 50 ms op cannot be complete at once"
    ev.synchronize()
    assert ev.query() and s.query()
    np.testing.assert_array_equal(to_np(dst), 1.0)


def test_events_dropped_in_a_reference_cycle_stay_usable(anydev: deviceops.Device) -> None:
    """Regression: an event freed by the cyclic GC is recycled intact.

    An exception traceback holding the awaiting frame puts the event in a
    reference cycle; on cuda the recycled handle used to be already destroyed
    by the wrapped CuPy event's own finalizer, and the next ``record_event``
    failed with "context is destroyed".
    """
    import gc

    s = anydev.new_stream()
    for _ in range(8):
        ev = s.record_event()
        holder: list[object] = [ev]
        holder.append(holder)  # a cycle: only the cyclic collector frees it
        del ev, holder
    gc.collect()
    other = anydev.new_stream()
    x = api.full((64,), 2.0).sync_on(other)  # records events from the pool
    y = kernels.add(x, x).sync_on(other)
    ev = other.record_event()
    ev.synchronize()
    assert ev.query()
    np.testing.assert_array_equal(to_np(y), 4.0)


def test_record_event_is_reused_when_nothing_new(anydev: deviceops.Device) -> None:
    s = anydev.new_stream()
    api.ones((4,)).async_on(s)
    assert s.record_event() is s.record_event()
    api.ones((4,)).async_on(s)
    e1 = s.record_event()
    assert e1.seq == s.seq
    s.synchronize()


def test_cross_stream_wait_event_orders_work(anydev: deviceops.Device) -> None:
    a, b = anydev.new_stream(), anydev.new_stream()
    src = api.full((4096,), 7.0).sync_on(a)
    mid = api.zeros((4096,)).sync_on(a)
    out = api.zeros((4096,)).sync_on(b)
    slow_copy(mid, src, 0.05).async_on(a)
    b.wait_event(a.record_event())
    # raw enqueue on b without hazard tracking: only the explicit wait orders it
    ma, oa = mid.array, out.array
    if anydev.is_cpu:
        b.enqueue(lambda: np.copyto(oa, ma), "copy")  # type: ignore[attr-defined]
    else:
        with b.native:  # type: ignore[attr-defined]
            oa[...] = ma
    b.synchronize()
    np.testing.assert_array_equal(to_np(out), 7.0)


def test_host_func_runs_in_stream_order(anydev: deviceops.Device) -> None:
    s = anydev.new_stream()
    src = api.full((256,), 3.0).sync_on(s)
    dst = api.zeros((256,)).sync_on(s)
    seen: list[float] = []
    slow_copy(dst, src, 0.02).async_on(s)
    arr = dst.array
    done = threading.Event()

    def cb() -> None:
        seen.append(float(arr[0]) if anydev.is_cpu else -1.0)
        done.set()

    s.launch_host_func(cb)
    assert done.wait(5)
    if anydev.is_cpu:
        assert seen == [3.0]
    s.synchronize()


def test_event_when_complete_callback(anydev: deviceops.Device) -> None:
    s = anydev.new_stream()
    src = api.ones((16,)).sync_on(s)
    dst = api.zeros((16,)).sync_on(s)
    slow_copy(dst, src, 0.02).async_on(s)
    fired = threading.Event()
    s.record_event().when_complete(fired.set)
    assert fired.wait(5)


def test_cpu_error_is_sticky_until_synchronize() -> None:
    dev = deviceops.device("cpu")
    s = dev.new_stream()

    def bad() -> None:
        raise RuntimeError("kernel blew up")

    s.enqueue(bad, "bad_kernel")  # type: ignore[attr-defined]
    ev = s.record_event()
    with pytest.raises(deviceops.LaunchError, match="bad_kernel failed on cpu") as info:
        s.synchronize()
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(deviceops.LaunchError):
        ev.synchronize()
    s.synchronize()  # cleared
    assert api.ones((2,)).sync_on(s).shape == (2,)


def test_cpu_streams_run_concurrently() -> None:
    dev = deviceops.device("cpu")
    a, b = dev.new_stream(), dev.new_stream()
    t = [api.ones((8,)).sync_on(a) for _ in range(4)]
    with deviceops.trace() as tr:
        slow_copy(t[1], t[0], 0.2).async_on(a)
        slow_copy(t[3], t[2], 0.2).async_on(b)
        a.synchronize()
        b.synchronize()
    recs = traced(tr, "slow_copy")
    assert {r.stream for r in recs} == {a.id, b.id}
    assert overlapped(recs), f"two ops on two streams ran one after the other: {recs}"


def test_device_errors_and_lookup() -> None:
    assert deviceops.device("cpu") is deviceops.device("cpu")
    assert str(deviceops.device("cpu")) == "cpu"
    with pytest.raises(ValueError, match="not a device"):
        deviceops.device("tpu")
    if not deviceops.cuda_available():
        with pytest.raises(deviceops.DeviceError, match="no usable CUDA GPU"):
            deviceops.device(0)


def test_default_device_env_forces_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import deviceops._device as d

    monkeypatch.setattr(d, "_default", None)
    monkeypatch.setenv("DEVICEOPS_DEVICE", "cpu")
    assert deviceops.default_device() is deviceops.device("cpu")
    monkeypatch.setattr(d, "_default", None)


def test_kernels_run_on_explicit_stream(anydev: deviceops.Device) -> None:
    s = anydev.new_stream()
    x = api.ones((10,)).sync_on(s)
    y = kernels.add(x, x).sync_on(s)
    np.testing.assert_array_equal(to_np(y), 2.0)
