"""CUDA-graph capture, update and replay (recorded and replayed on the cpu backend)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import deviceops
from deviceops import api, kernels
from deviceops.graphs import host_task
from deviceops.scheduling import StreamPoolRoundRobin

from .conftest import to_np


def test_capture_runs_nothing_until_launch(stream: deviceops.Stream) -> None:
    x = api.zeros((32,)).sync_on(stream)
    one = api.ones((32,)).sync_on(stream)
    g = kernels.add(x, one, out=x).graph_on(stream)
    np.testing.assert_array_equal(to_np(x), 0.0)
    for _ in range(5):
        g.launch()
    g.synchronize()
    np.testing.assert_array_equal(to_np(x), 5.0)
    assert g.take_output() is x
    with pytest.raises(deviceops.SchedulingError, match="already taken"):
        g.take_output()


def _step(inp: deviceops.Tensor, w: deviceops.Tensor, tmp: deviceops.Tensor,
          out: deviceops.Tensor) -> deviceops.DeviceOp[Any]:
    # out = (inp * w + inp) * inp
    return kernels.mul(inp, w, out=tmp).then(
        lambda t: kernels.add(t, inp, out=t)).then(lambda t: kernels.mul(t, inp, out=out))


def test_replay_matches_eager_over_100_updates(dev: deviceops.Device) -> None:
    rng = np.random.default_rng()
    s = dev.new_stream()
    shape = (37, 129)
    inp = api.zeros(shape).sync_on(s)
    w = api.from_host(rng.standard_normal(shape).astype(np.float32)).sync_on(s)
    tmp = api.empty(shape).sync_on(s)
    out = api.empty(shape).sync_on(s)
    g = _step(inp, w, tmp, out).graph_on(s)
    wh = to_np(w).astype(np.float64)
    for _ in range(100):
        xh = rng.standard_normal(shape).astype(np.float32)
        new = api.from_host(xh).sync_on(s)
        api.memcpy(out, api.full(shape, np.nan).sync_on(s)).sync_on(s)  # poison
        g.update(api.memcpy(inp, new))
        g.launch()
        g.synchronize()
        ref = (xh * wh + xh) * xh
        np.testing.assert_allclose(to_np(out), ref, rtol=1e-5, atol=1e-5)


def test_launch_op_is_awaitable_and_syncable(dev: deviceops.Device) -> None:
    s = dev.new_stream()
    x = api.zeros((8,)).sync_on(s)
    one = api.ones((8,)).sync_on(s)
    g = kernels.add(x, one, out=x).graph_on(s)
    out = g.launch_op().sync()
    assert out is x
    g.launch_op().then(lambda t: kernels.add(t, t, out=t)).sync()
    np.testing.assert_array_equal(to_np(x), 4.0)


@pytest.mark.anyio
async def test_launch_op_await(dev: deviceops.Device) -> None:
    s = dev.new_stream()
    x = api.zeros((8,)).sync_on(s)
    one = api.ones((8,)).sync_on(s)
    g = kernels.add(x, one, out=x).graph_on(s)
    for _ in range(3):
        await g.launch_op()
    np.testing.assert_array_equal(to_np(x), 3.0)


def test_zip_inside_capture_is_parallel_branches(dev: deviceops.Device) -> None:
    s = dev.new_stream()
    xs = [api.full((64,), float(i)).sync_on(s) for i in range(4)]
    outs = [api.empty((64,)).sync_on(s) for _ in range(4)]
    with deviceops.using(StreamPoolRoundRobin(dev, 4)):
        op = deviceops.zip(*[kernels.mul(x, x, out=o) for x, o in zip(xs, outs, strict=True)])
        g = op.graph_on(s)
    assert len({m.id for m in g._state.members}) > 1, "branches should have been captured on other streams"
    assert all(m.capture is None for m in g._state.members)
    g.launch()
    g.synchronize()
    for i, o in enumerate(outs):
        np.testing.assert_array_equal(to_np(o), float(i * i))


def test_allocation_inside_capture_is_refused_and_library_recovers(dev: deviceops.Device) -> None:
    s = dev.new_stream()
    x = api.ones((4,)).sync_on(s)
    with pytest.raises(deviceops.CaptureError, match=r"add allocates a tensor of shape \(4,\).*allocate it before"):
        kernels.add(x, x).graph_on(s)
    assert s.capture is None
    y = kernels.add(x, x).sync_on(s)  # the stream still works
    np.testing.assert_array_equal(to_np(y), 2.0)


def test_failed_capture_ends_and_frees(dev: deviceops.Device) -> None:
    s = dev.new_stream()
    x = api.ones((4,)).sync_on(s)

    def boom(_: Any) -> deviceops.DeviceOp[Any]:
        raise RuntimeError("user error mid-capture")

    with pytest.raises(RuntimeError, match="mid-capture") as info:
        kernels.add(x, x, out=x).then(boom).graph_on(s)
    assert any("capture was ended" in n for n in getattr(info.value, "__notes__", []))
    assert s.capture is None
    g = kernels.add(x, x, out=x).graph_on(s)
    g.launch()
    g.synchronize()
    np.testing.assert_array_equal(to_np(x), 2.0)


def test_sync_inside_capture_is_refused(dev: deviceops.Device) -> None:
    s = dev.new_stream()
    x = api.ones((4,)).sync_on(s)

    def nested(t: deviceops.Tensor) -> deviceops.DeviceOp[Any]:
        inner = deviceops.value(1)
        inner._state = 2
        inner.sync()
        return deviceops.value(t)

    with pytest.raises(deviceops.NestedExecutionError, match="graph capture"):
        kernels.add(x, x, out=x).then(nested).graph_on(s)
    assert s.capture is None


def test_host_callback_fires_on_every_replay(dev: deviceops.Device) -> None:
    s = dev.new_stream()
    x = api.ones((4,)).sync_on(s)
    hits: list[int] = []
    lock = threading.Lock()

    def cb() -> None:
        with lock:
            hits.append(1)

    g = kernels.add(x, x, out=x).then(lambda t: host_task(cb).map(lambda _: t)).graph_on(s)
    assert hits == []
    for _ in range(7):
        g.launch()
    g.synchronize()
    assert len(hits) == 7


def test_graph_keeps_tensors_alive(dev: deviceops.Device) -> None:
    s = dev.new_stream()
    x = api.ones((1024,)).sync_on(s)
    y = api.zeros((1024,)).sync_on(s)
    g = kernels.add(x, x, out=y).graph_on(s)
    del x
    import gc

    gc.collect()
    g.launch()
    g.synchronize()
    np.testing.assert_array_equal(to_np(y), 2.0)


def test_launch_is_ordered_after_other_streams(dev: deviceops.Device) -> None:
    from deviceops.kernels.testing import slow_copy

    a, b = dev.new_stream(), dev.new_stream()
    inp = api.zeros((256,)).sync_on(a)
    out = api.zeros((256,)).sync_on(a)
    g = kernels.add(inp, inp, out=out).graph_on(a)
    src = api.full((256,), 4.0).sync_on(b)
    slow_copy(inp, src, 0.01 if dev.is_cpu else 0.001).async_on(b)   # writer on another stream
    g.launch()
    g.synchronize()
    np.testing.assert_array_equal(to_np(out), 8.0)


@pytest.mark.gpu
def test_streams_outlive_a_collected_cycle_of_graph_streams_and_tensors() -> None:
    """A graph, its stream and the tensors it used, dropped together as cyclic garbage, then an
    allocation's sweep of parked memory: the streams it records events on are still alive.

    (Regression: the collector ran CuPy's stream finalizer, destroying the CUDA stream, before a
    tensor's finalizer parked its memory on that stream; the next sweep used it and crashed.)
    """
    import gc

    from deviceops._tensor import parked_count, sweep

    dev = deviceops.device(0)

    def build() -> None:
        scope: dict[str, Any] = {}
        stream = dev.new_stream()
        w = api.from_host(np.ones((64, 32), np.float32)).sync_on(stream)
        a, b = deviceops.zip(api.full((1024,), 3.0), api.arange(1024, dtype=deviceops.float32)).sync()  # two streams
        token = api.zeros((1, 64)).sync_on(stream)
        out = api.zeros((1, 32)).sync_on(stream)
        kernels.gemm(token, w, out=out).sync_on(stream)
        g = kernels.gemm(token, w, out=out).graph_on(stream)
        g.update(api.memcpy(token, api.ones((1, 64))))
        g.launch()
        g.synchronize()
        kernels.add(a, b).sync_on(stream)  # a and b read on a stream that did not make them
        scope.update(stream=stream, w=w, a=a, b=b, token=token, out=out, g=g, scope=scope)

    build()
    gc.collect()
    assert parked_count() > 0  # memory waits on streams that are now otherwise unreferenced
    sweep()
    s = dev.new_stream()
    y = kernels.add(api.ones((8,)), api.ones((8,))).sync_on(s)
    np.testing.assert_array_equal(to_np(y), np.full(8, 2.0, np.float32))
