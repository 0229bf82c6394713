"""Several devices: placement, refusal, copies, cross-device ordering, overlap, graphs.

Every test runs on two backends: two emulated cpu devices (``cpu:0``, ``cpu:1``; always,
so CI covers it) and two CUDA GPUs (marked ``gpu``; skipped, with the reason, on machines
with fewer than two).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import deviceops
from deviceops import DeviceError, api, kernels
from deviceops.kernels.testing import slow_copy
from deviceops.scheduling import (
    MultiDeviceRoundRobin,
    SchedulingPolicy,
    SingleStream,
    StreamPoolRoundRobin,
)

from .conftest import overlapped, to_np, traced


def _gpu_count() -> int:
    if not deviceops.cuda_available():
        return 0
    return deviceops.device(0).backend.device_count()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def pair(request: pytest.FixtureRequest) -> tuple[deviceops.Device, deviceops.Device]:
    """Two distinct devices of one backend."""
    if request.param == "cpu":
        return deviceops.device("cpu:0"), deviceops.device("cpu:1")
    if _gpu_count() < 2:
        pytest.skip(f"needs two CUDA GPUs; this machine has {_gpu_count()}")
    return deviceops.device(0), deviceops.device(1)


def _delay(d: deviceops.Device) -> float:
    return 0.15 if d.is_cpu else 0.03


def _current_cuda_device() -> int:
    import cupy

    return int(cupy.cuda.runtime.getDevice())


def test_cpu_devices_are_distinct_and_named() -> None:
    assert deviceops.device("cpu") is deviceops.device("cpu:0")
    c1 = deviceops.device("cpu:1")
    assert c1 is not deviceops.device("cpu") and c1 is deviceops.device("cpu:1")
    assert (str(c1), c1.index, c1.kind, repr(c1)) == ("cpu:1", 1, "cpu", "deviceops.device('cpu:1')")
    with pytest.raises(ValueError, match="cpu:N"):
        deviceops.device("cpu:x")


def test_tensors_live_on_their_stream_device(pair: Any) -> None:
    _, d1 = pair
    s1 = d1.new_stream()
    t = api.full((5, 3), 2.0).sync_on(s1)
    assert t.device is d1 and s1.device is d1
    u = kernels.add(t, t).sync_on(s1)
    assert u.device is d1
    np.testing.assert_array_equal(to_np(u), 4.0)


def test_other_device_tensor_is_refused_before_launch(pair: Any) -> None:
    d0, d1 = pair
    t1 = api.ones((4, 4)).sync_on(d1.new_stream())
    s0 = d0.new_stream()
    seq = s0.seq
    with pytest.raises(deviceops.DeviceError) as err:
        kernels.gemm(t1, t1).sync_on(s0)
    msg = str(err.value)
    assert "gemm" in msg and str(d0) in msg and str(d1) in msg and "api.to_device" in msg
    assert s0.seq == seq  # nothing was enqueued


def test_mixed_inputs_refused_under_multi_device_policy(pair: Any) -> None:
    d0, d1 = pair
    a = api.ones((8,)).sync_on(d0.new_stream())
    b = api.ones((8,)).sync_on(d1.new_stream())
    pol = MultiDeviceRoundRobin([d0, d1])
    seqs = [s.seq for s in pol.streams]
    with deviceops.using(pol), pytest.raises(deviceops.DeviceError) as err:
        kernels.add(kernels.mul(a, a), b).sync()
    msg = str(err.value)
    assert "add" in msg and str(d0) in msg and str(d1) in msg and "api.to_device" in msg
    assert [s.seq for s in pol.streams] == seqs  # refused before anything was enqueued


def test_placement_follows_the_data(pair: Any) -> None:
    d0, d1 = pair
    rng = np.random.default_rng(7)
    x = rng.standard_normal((24, 24)).astype(np.float32) / 5
    xs = [api.from_host(x).sync_on(d.new_stream()) for d in (d0, d1)]
    pol = MultiDeviceRoundRobin([d0, d1])
    for want, xt in ((d1, xs[1]), (d0, xs[0]), (d1, xs[1])):
        op: Any = xt
        for _ in range(3):
            op = kernels.gemm(op, xt)
        with deviceops.using(pol):
            out = op.sync()
        assert out.device is want
        ref = np.linalg.matrix_power(x.astype(np.float64), 4)
        np.testing.assert_allclose(to_np(out), ref, rtol=1e-3, atol=1e-4)


def test_ops_without_inputs_spread_over_devices(pair: Any) -> None:
    d0, d1 = pair
    pol = MultiDeviceRoundRobin([d0, d1], streams_per_device=1)
    with deviceops.using(pol):
        outs = deviceops.zip(*[api.full((4,), float(i)) for i in range(4)]).sync()
    assert {o.device for o in outs} == {d0, d1}
    for i, o in enumerate(outs):
        np.testing.assert_array_equal(to_np(o), float(i))


def test_zip_branches_on_two_devices_overlap(pair: Any) -> None:
    d0, d1 = pair
    delay = _delay(d0)
    srcs, dsts = [], []
    for i, d in enumerate((d0, d1)):
        s = d.new_stream()
        srcs.append(api.full((1024,), float(i + 1)).sync_on(s))
        dsts.append(api.zeros((1024,)).sync_on(s))
    ops = [slow_copy(dst, src, delay) for dst, src in zip(dsts, srcs, strict=True)]
    pol = MultiDeviceRoundRobin([d0, d1], streams_per_device=1)
    slow_copy(api.zeros((4,)).sync_on(d0.new_stream()), api.zeros((4,)).sync_on(d0.new_stream()),
              0.0).sync_on(d0.new_stream())  # warm (compile) outside the timing
    slow_copy(api.zeros((4,)).sync_on(d1.new_stream()), api.zeros((4,)).sync_on(d1.new_stream()),
              0.0).sync_on(d1.new_stream())
    with deviceops.using(pol), deviceops.trace() as t:
        out = deviceops.zip(*ops).sync()
    assert [o.device for o in out] == [d0, d1]
    for i, o in enumerate(out):
        np.testing.assert_array_equal(to_np(o), float(i + 1))
    recs = traced(t, "slow_copy")  # device start/end of each branch
    assert sorted(r.device for r in recs) == sorted([str(d0), str(d1)]), recs
    assert overlapped(recs), f"the branches on {d0} and {d1} ran one after the other: {recs}"


def test_to_device_orders_after_the_source_writer(pair: Any) -> None:
    d0, d1 = pair
    s0, s1 = d0.new_stream(), d1.new_stream()
    src = api.full((4096,), 7.0).sync_on(s0)
    dst0 = api.zeros((4096,)).sync_on(s0)
    slow_copy(dst0, src, _delay(d0)).async_on(s0)  # dst0 becomes 7 only after the delay
    moved = api.to_device(dst0, d1).sync_on(s1)
    assert moved.device is d1
    np.testing.assert_array_equal(to_np(moved), 7.0)


def test_to_device_source_not_reused_before_the_copy_read_it(pair: Any) -> None:
    d0, d1 = pair
    s0, s1 = d0.new_stream(), d1.new_stream()
    n = 1 << 16
    src = api.full((n,), 3.0).sync_on(s0)
    busy_src = api.full((n,), 1.0).sync_on(s1)
    busy_dst = api.zeros((n,)).sync_on(s1)
    slow_copy(busy_dst, busy_src, _delay(d1)).async_on(s1)  # the copy below waits behind this
    moved = api.to_device(src, d1).async_on(s1)
    del src  # its memory must stay untouched until the copy on s1 has read it
    for _ in range(4):
        api.full((n,), -1.0).sync_on(s0)
    np.testing.assert_array_equal(to_np(moved), 3.0)


def test_to_device_values_and_dtypes(pair: Any) -> None:
    d0, d1 = pair
    rng = np.random.default_rng(3)
    for dt in (np.float32, np.float16, np.int32, np.int64):
        host = (rng.standard_normal((37, 5)) * 100).astype(dt)
        t = api.from_host(host).sync_on(d0.new_stream())
        there = api.to_device(t, d1).sync()  # the default policy's stream: a transfer stream
        back = api.to_device(there, d0).sync_on(d0.new_stream())
        assert there.device is d1 and back.device is d0 and there.dtype == host.dtype
        np.testing.assert_array_equal(to_np(there), host)
        np.testing.assert_array_equal(to_np(back), host)


def test_graph_captures_and_replays_on_the_second_device(pair: Any) -> None:
    d0, d1 = pair
    s1 = d1.new_stream()
    x = api.full((64,), 1.0).sync_on(s1)
    y = api.zeros((64,)).sync_on(s1)
    g = kernels.add(x, x, out=y).graph_on(s1)
    assert g.stream.device is d1
    for v in (2.0, 5.0):
        g.update(api.memcpy(x, api.full((64,), v)))
        g.launch()
        g.synchronize()
        np.testing.assert_array_equal(to_np(y), 2 * v)
    with deviceops.using(MultiDeviceRoundRobin([d0, d1])):
        g.launch_op().sync()  # placed on the graph's device
    np.testing.assert_array_equal(to_np(y), 10.0)


def test_graph_of_one_device_refused_on_another(pair: Any) -> None:
    d0, d1 = pair
    s1 = d1.new_stream()
    x = api.full((8,), 1.0).sync_on(s1)
    g = kernels.add(x, x, out=x).graph_on(s1)
    with pytest.raises(deviceops.DeviceError, match=f"{d1}.*{d0}"):
        g.launch_op().sync_on(d0.new_stream())


def test_ops_from_another_thread_and_default_policy_elsewhere(pair: Any) -> None:
    _, d1 = pair
    results: dict[str, Any] = {}

    def worker() -> None:
        try:
            with deviceops.using(StreamPoolRoundRobin(d1, 2)):
                t = api.full((16,), 2.0).sync()
                results["out"] = kernels.mul(t, t).sync()
        except BaseException as exc:  # reported by the assertion below
            results["err"] = exc

    th = threading.Thread(target=worker)
    th.start()
    th.join()
    assert "err" not in results, results.get("err")
    assert results["out"].device is d1
    np.testing.assert_array_equal(to_np(results["out"]), 4.0)


@pytest.mark.gpu
def test_cuda_ops_do_not_leak_the_current_device() -> None:
    if _gpu_count() < 2:
        pytest.skip(f"needs two CUDA GPUs; this machine has {_gpu_count()}")
    import cupy

    d1 = deviceops.device(1)
    s1 = d1.new_stream()
    with cupy.cuda.Device(0):
        before = _current_cuda_device()
        a = api.randn((256, 256), deviceops.float16).sync_on(s1)
        b = kernels.gemm(a, a).sync_on(s1)
        c = kernels.add(b, b).sync_on(s1)
        moved = api.to_device(c, 0).sync_on(s1)
        g = kernels.add(a, a, out=b).graph_on(s1)
        g.launch()
        g.synchronize()
        assert _current_cuda_device() == before == 0
    assert moved.device is deviceops.device(0)
    np.testing.assert_allclose(to_np(moved), to_np(c))
    assert b.array.device.id == 1


@pytest.mark.anyio
async def test_await_on_the_second_device(pair: Any) -> None:
    d0, d1 = pair
    with deviceops.using(SingleStream(d1.new_stream())):
        t = await api.full((8,), 3.0)
        u = await kernels.add(t, t)
    assert u.device is d1
    np.testing.assert_array_equal(to_np(u), 6.0)
    with deviceops.using(MultiDeviceRoundRobin([d0, d1])):
        v = await kernels.mul(u, u)  # placed on u's device
    assert v.device is d1
    np.testing.assert_array_equal(to_np(v), 36.0)


def test_multi_device_policy_checks_its_arguments() -> None:
    with pytest.raises(deviceops.SchedulingError, match="twice"):
        MultiDeviceRoundRobin(["cpu:1", "cpu:1"])
    a = api.ones((4,)).sync_on(deviceops.device("cpu:2").new_stream())
    with deviceops.using(MultiDeviceRoundRobin(["cpu:0", "cpu:1"])), \
            pytest.raises(deviceops.DeviceError, match=r"cpu:2.*does not cover"):
        kernels.add(a, a).sync()


def test_zip_over_devices_enqueues_branches_in_turn(pair: Any) -> None:
    """Each device gets work from the first op on: the branches' ops are enqueued in turn,
    not one whole branch after the other."""
    d0, d1 = pair
    order: list[str] = []
    ts = [api.full((4,), 1.0).sync_on(d.new_stream()) for d in (d0, d1)]

    def chain(name: str, t: deviceops.Tensor) -> deviceops.DeviceOp[Any]:
        op: Any = t
        for i in range(3):
            op = kernels.add(op, t).inspect(lambda _, tag=f"{name}{i}": order.append(tag))
        return op

    with deviceops.using(MultiDeviceRoundRobin([d0, d1])):
        a, b = deviceops.zip(chain("a", ts[0]), chain("b", ts[1])).sync()
    assert (a.device, b.device) == (d0, d1)
    assert order == ["a0", "b0", "a1", "b1", "a2", "b2"]
    np.testing.assert_array_equal(to_np(a), 4.0)
    np.testing.assert_array_equal(to_np(b), 4.0)


def test_zip_first_branch_on_the_other_device(pair: Any) -> None:
    """The first branch runs on its data's device also when that is not the zip's home
    stream's device, in either order of the branches."""
    d0, d1 = pair
    ts = {d: api.full((8,), 2.0 if d is d0 else 3.0).sync_on(d.new_stream()) for d in (d0, d1)}
    for first, second in ((d1, d0), (d0, d1)):
        with deviceops.using(MultiDeviceRoundRobin([d0, d1])):
            a, b = deviceops.zip(kernels.add(ts[first], ts[first]),
                                 kernels.mul(ts[second], ts[second])).sync()
        assert (a.device, b.device) == (first, second)
        np.testing.assert_array_equal(to_np(a), 2 * (2.0 if first is d0 else 3.0))
        np.testing.assert_array_equal(to_np(b), (2.0 if second is d0 else 3.0) ** 2)


def test_zip_branch_on_an_uncovered_device_is_named(pair: Any) -> None:
    """A branch whose data lives on a device the policy does not cover is refused, naming
    that branch (not another one)."""
    d0, d1 = pair
    x1 = api.full((8,), 1.0).sync_on(d1.new_stream())
    x0 = api.full((8,), 1.0).sync_on(d0.new_stream())
    with deviceops.using(MultiDeviceRoundRobin([d0])), pytest.raises(DeviceError) as err:
        deviceops.zip(kernels.gemm(x1.reshape((2, 4)), x1.reshape((4, 2))),
                      kernels.mul(x0, x0)).sync()
    msg = str(err.value)
    assert msg.startswith("gemm:") and str(d1) in msg and "mul" not in msg, msg


def test_zip_under_a_custom_policy_spanning_devices(pair: Any) -> None:
    """A user policy that spans devices but implements only ``next_stream`` (no data
    placement): every branch of a zip runs, each on the stream the policy gave it."""
    d0, d1 = pair
    streams = [d0.new_stream(), d1.new_stream()]

    class Alternate(SchedulingPolicy):
        spans_devices = True

        def __init__(self) -> None:
            self.n = 0

        def next_stream(self) -> deviceops.Stream:
            self.n += 1
            return streams[self.n % 2]

    with deviceops.using(Alternate()):
        outs = deviceops.zip(*[api.full((4,), float(i)) for i in range(3)]).sync()
    assert len(outs) == 3
    assert {o.device for o in outs} == {d0, d1}
    for i, o in enumerate(outs):
        np.testing.assert_array_equal(to_np(o), float(i))


# -- copies out of a tensor run on its device, under every policy ------------------------------
def _policies(d0: deviceops.Device, d1: deviceops.Device) -> list[SchedulingPolicy]:
    return [StreamPoolRoundRobin(d0, 2), SingleStream(d0.new_stream()),
            MultiDeviceRoundRobin([d0, d1]), MultiDeviceRoundRobin([d0])]


def test_to_host_of_another_devices_tensor_runs_there_after_its_writer(pair: Any) -> None:
    """``t.to_host()`` of a tensor on d1 works under a policy of d0, of both, or covering
    d0 only, and reads the value its (slow, still running) writer leaves."""
    d0, d1 = pair
    s1 = d1.new_stream()
    for i, policy in enumerate(_policies(d0, d1)):
        src = api.full((4096,), float(i + 2)).sync_on(s1)
        t = api.zeros((4096,)).sync_on(s1)
        slow_copy(t, src, _delay(d1)).async_on(s1)  # t holds i + 2 only after the delay
        with deviceops.using(policy):
            got = t.to_host().sync()
        np.testing.assert_array_equal(got, float(i + 2))
        with deviceops.using(policy):
            host = t.to_host().schedule().result()
        np.testing.assert_array_equal(host, float(i + 2))


def test_copies_out_pick_the_policys_stream_of_the_source_device(pair: Any) -> None:
    d0, d1 = pair
    t = api.full((16,), 3.0).sync_on(d1.new_stream())
    both = MultiDeviceRoundRobin([d0, d1])
    with deviceops.using(both), deviceops.trace() as tr:
        t.to_host().sync()
    ids = {s.id for s in both.streams if s.device is d1}
    assert all(r.stream in ids for r in traced(tr, "to_host"))
    with deviceops.using(SingleStream(d0.new_stream())), deviceops.trace() as tr:
        t.to_host().sync()  # the policy has no stream on d1: the device's own
    assert all(r.stream == d1.own_stream().id for r in traced(tr, "to_host"))
    assert d1.own_stream() is d1.own_stream()


def test_memcpy_from_a_tensor_runs_on_its_device_compute_still_refuses(pair: Any) -> None:
    d0, d1 = pair
    s1 = d1.new_stream()
    src, dst = api.full((64,), 5.0).sync_on(s1), api.zeros((64,)).sync_on(s1)
    with deviceops.using(SingleStream(d0.new_stream())):
        out = api.memcpy(dst, src).sync()
        assert out is dst
        np.testing.assert_array_equal(dst.to_host().sync(), 5.0)
        other = api.full((64,), 1.0).sync()  # on d0
        with pytest.raises(DeviceError, match=r"api\.to_device"):
            api.memcpy(dst, other).sync()  # dst on d1, src on d0: one device per op
        with pytest.raises(DeviceError):
            kernels.add(src, src).sync()  # a compute op keeps refusing another device


@pytest.mark.anyio
async def test_await_to_host_of_another_devices_tensor(pair: Any, anyio_backend: str) -> None:
    d0, d1 = pair
    t = api.full((32,), 9.0).sync_on(d1.new_stream())
    with deviceops.using(StreamPoolRoundRobin(d0, 2)):
        np.testing.assert_array_equal(await t.to_host(), 9.0)


def test_convert_of_another_devices_tensor_is_refused(pair: Any) -> None:
    d0, d1 = pair
    t = api.full((8,), 1.0).sync_on(d1.new_stream())
    with pytest.raises(DeviceError, match="convert"):
        api.convert(t, deviceops.float16).sync_on(d0.new_stream())


def test_to_device_copies_on_a_stream_of_the_destination(pair: Any) -> None:
    d0, d1 = pair
    s0 = d0.new_stream()
    t = api.full((8,), 4.0).sync_on(s0)
    with deviceops.trace() as tr:
        moved = api.to_device(t, d1).sync_on(s0)
    assert moved.device is d1
    assert {r.device for r in traced(tr, "to_device")} == {str(d1)}
    np.testing.assert_array_equal(to_np(moved), 4.0)
