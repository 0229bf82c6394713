"""Awaiting DeviceOps and DeviceFutures under asyncio and trio (anyio's plugin).

Every test marked ``anyio`` runs twice: once under asyncio, once under trio.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from typing import Any

import anyio
import numpy as np
import pytest

import deviceops
from deviceops import api, kernels
from deviceops.kernels.testing import slow_copy
from deviceops.scheduling import SingleStream

from .conftest import to_np

pytestmark = pytest.mark.anyio


def _delay(dev: deviceops.Device) -> float:
    # Long enough that a stray host pause (a full GC with torch and CuPy loaded
    # takes tens of ms) cannot outlast the op the test means to interrupt.
    return 0.2


async def test_await_op_gives_output(dev: deviceops.Device) -> None:
    x = await api.full((3, 5), 2.0)
    assert isinstance(x, deviceops.Tensor)
    y = await kernels.add(x, x)
    np.testing.assert_array_equal(to_np(y), 4.0)


async def test_await_schedule_and_future(dev: deviceops.Device) -> None:
    fut = api.arange(10).schedule()
    assert isinstance(fut, deviceops.DeviceFuture)
    t = await fut
    np.testing.assert_array_equal(to_np(t), np.arange(10))
    # A future can be awaited again and read synchronously: the same output.
    assert (await fut) is t
    assert fut.result() is t
    assert fut.done()
    assert fut.exception() is None


async def test_await_with_explicit_policy(dev: deviceops.Device) -> None:
    s = dev.new_stream()
    t = await api.ones((4,)).schedule(SingleStream(s))
    assert fut_stream_is(t, s)


def fut_stream_is(t: deviceops.Tensor, s: deviceops.Stream) -> bool:
    w = t._storage.write
    return w is not None and w[0] is s


async def test_then_chain_awaited(dev: deviceops.Device) -> None:
    x = api.full((64,), 1.5)
    op = x.then(lambda t: kernels.mul(t, t, out=t)).then(lambda t: kernels.add(t, t))
    np.testing.assert_allclose(to_np(await op), 4.5)


async def test_error_while_enqueueing_reaches_awaiter(dev: deviceops.Device) -> None:
    def boom(_: Any) -> deviceops.DeviceOp[Any]:
        raise KeyError("from the closure")

    with pytest.raises(KeyError, match="from the closure"):
        await api.ones((2,)).then(boom)


async def test_shape_error_reaches_awaiter_before_launch(dev: deviceops.Device) -> None:
    a = api.ones((2, 3)).sync()
    b = api.ones((3, 2)).sync()
    with pytest.raises(deviceops.ShapeError, match=r"\(2, 3\).*\(3, 2\)"):
        await kernels.add(a, b)


async def test_device_error_reaches_awaiter(dev: deviceops.Device) -> None:
    """A failure reported by the stream (cpu: a task raising) reaches the task."""
    if not dev.is_cpu:
        pytest.skip("a device-side fault would poison the CUDA context; tested on the cpu backend")

    def bad_task() -> None:
        raise FloatingPointError("device fault")

    from deviceops.graphs import host_task

    with pytest.raises(deviceops.DeviceError) as info:
        await host_task(bad_task, "faulty")
    assert isinstance(info.value.__cause__, FloatingPointError)
    # The policy's streams stay usable afterwards.
    np.testing.assert_array_equal(to_np(await api.ones((3,))), 1.0)


async def test_future_from_failed_enqueue(dev: deviceops.Device) -> None:
    def boom(_: Any) -> deviceops.DeviceOp[Any]:
        raise ValueError("nope")

    fut = api.ones((2,)).then(boom).schedule()
    assert fut.done()
    assert isinstance(fut.exception(), ValueError)
    with pytest.raises(ValueError, match="nope"):
        await fut


def _gated(s: deviceops.Stream) -> threading.Event:
    """Hold ``s`` shut until the returned event is set (a host task waits on it, 30 s at
    most): work enqueued after it cannot complete before the test opens the gate."""
    from deviceops.graphs import host_task

    gate = threading.Event()
    host_task(lambda: gate.wait(30), "gate").async_on(s)
    return gate


async def test_cancel_scope_returns_promptly_and_work_completes(dev: deviceops.Device) -> None:
    """Cancelling an await returns while its work is still pending (event order: the stream
    is held shut behind a gate until after the await returned), and the work completes."""
    s = dev.new_stream()
    n = 4096
    src = api.full((n,), 7.0).sync_on(s)
    dst = api.zeros((n,)).sync_on(s)
    slow_copy(dst, src, 0.0).sync_on(s)  # warm-up: compile the kernel outside the window
    api.memcpy(dst, api.zeros((n,))).sync_on(s)
    gate = _gated(s)
    try:
        with anyio.move_on_after(0.01) as scope:
            await slow_copy(dst, src, 0.0).schedule(SingleStream(s))
        assert scope.cancelled_caught
        assert not s.query(), "the await returned only after its work completed"
    finally:
        gate.set()
    # The enqueued copy still completes, and the stream is usable after it.
    y = kernels.add(dst, dst).sync_on(s)
    np.testing.assert_array_equal(to_np(y), 14.0)


async def test_fail_after_raises_timeout_promptly(dev: deviceops.Device) -> None:
    s = dev.new_stream()
    src = api.full((256,), 3.0).sync_on(s)
    dst = api.zeros((256,)).sync_on(s)
    slow_copy(dst, src, 0.0).sync_on(s)  # warm-up (compile)
    api.memcpy(dst, api.zeros((256,))).sync_on(s)
    gate = _gated(s)
    try:
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.01):
                await slow_copy(dst, src, 0.0).schedule(SingleStream(s))
        assert not s.query(), "the timeout came only after the work completed"
    finally:
        gate.set()
    s.synchronize()
    np.testing.assert_array_equal(to_np(dst), 3.0)


async def test_cancelled_work_keeps_its_memory(dev: deviceops.Device) -> None:
    """A dropped tensor still used by cancelled, in-flight work is not reused early."""
    s = dev.new_stream()
    n = 1 << 16
    src = api.full((n,), 5.0).sync_on(s)
    dst = api.zeros((n,)).sync_on(s)
    keep = dst.array  # the memory under test; the Tensor itself is dropped below
    with anyio.move_on_after(0.005):
        await slow_copy(dst, src, _delay(dev)).schedule(SingleStream(s))
    del src, dst
    # Allocate and fill fresh tensors of the same size on another stream while
    # the copy is still in flight: none may land on the copy's memory.
    other = dev.new_stream()
    fresh = [api.full((n,), -1.0).sync_on(other) for _ in range(4)]
    s.synchronize()
    host = keep.get() if hasattr(keep, "get") else keep
    np.testing.assert_array_equal(host, 5.0)
    for f in fresh:
        np.testing.assert_array_equal(to_np(f), -1.0)


async def test_asyncio_task_cancel(dev: deviceops.Device, anyio_backend: str) -> None:
    if anyio_backend != "asyncio":
        pytest.skip("asyncio Task.cancel(); trio has no tasks to cancel (cancel scopes tested above)")
    s = dev.new_stream()
    src = api.full((128,), 2.0).sync_on(s)
    dst = api.zeros((128,)).sync_on(s)
    slow_copy(dst, src, 0.0).sync_on(s)  # warm-up (compile)
    api.memcpy(dst, api.zeros((128,))).sync_on(s)
    gate = _gated(s)

    async def waiter() -> deviceops.Tensor:
        return await slow_copy(dst, src, 0.0).schedule(SingleStream(s))

    try:
        task = asyncio.ensure_future(waiter())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not s.query(), "the cancelled task ended only after its work completed"
    finally:
        gate.set()
    s.synchronize()
    np.testing.assert_array_equal(to_np(dst), 2.0)


async def test_many_concurrent_awaits_with_ticker(dev: deviceops.Device) -> None:
    """Load: many awaited ops from one loop, all correct, and the loop keeps running while
    they are pending, shown by event order rather than a time bound: every stream the awaits
    use is held shut by a host task that only the loop's own 1 ms ticker opens (after
    ``OPEN_AFTER`` ticks), so no await can complete before the ticker has ticked, and a loop
    blocked inside an await would never open it (the gate's 30 s timeout then fails the
    test). The worst gap is printed; the 5 ms bar is ``benchmarks/await_latency.py``'s."""
    from deviceops.graphs import host_task
    from deviceops.scheduling import StreamPoolRoundRobin

    count = 300 if dev.is_cpu else 10_000
    open_after = 20
    pool = StreamPoolRoundRobin(dev, num_streams=4)
    xs = [api.full((16,), float(i)).sync() for i in range(64)]
    kernels.add(xs[0], xs[0]).sync()  # compile/load the kernel outside the ticker window
    gate = threading.Event()
    by_timeout: list[bool] = []
    for st in pool.streams:  # each stream waits at the gate before any awaited op
        host_task(lambda: by_timeout.append(not gate.wait(30)), "gate").async_on(st)
    ticks: list[float] = []
    ticks_at_done: list[int] = []
    done = anyio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await anyio.sleep(0.001)
            now = time.perf_counter()
            ticks.append(now - last)
            last = now
            if len(ticks) == open_after:
                gate.set()

    outs: list[Any] = [None] * count

    async def one(i: int) -> None:
        # No blocking host read in here: it would stall the loop by itself.
        outs[i] = await kernels.add(xs[i % 64], xs[i % 64])
        ticks_at_done.append(len(ticks))

    # As a latency-sensitive server would after start-up: move the existing heap
    # (torch, cupy, pytest) out of the cyclic GC's reach, so a full collection
    # does not pause the loop for a walk over it. New objects are still collected.
    gc.collect()
    gc.freeze()
    try:
        with deviceops.using(pool):
            await _spawn_all(ticker, one, count, done)
    finally:
        gate.set()
        gc.unfreeze()
    assert by_timeout == [False] * len(pool.streams), "the ticker never opened the gate"
    assert len(ticks_at_done) == count and min(ticks_at_done) >= open_after, (
        "an await completed before the loop's ticker opened its stream")
    assert [float(to_np_nosync(t)[0]) for t in outs] == [2.0 * (i % 64) for i in range(count)]
    assert {t._storage.write[0] for t in outs} <= set(pool.streams)  # all behind the gates
    print(f"ticker worst gap {max(ticks) * 1e3:.2f} ms over {len(ticks)} ticks, {count} awaits")


@pytest.mark.parametrize("first_use", [False, True], ids=["warm", "first_use"])
async def test_back_pressure_caps_awaits_in_flight_per_stream(
    dev: deviceops.Device, first_use: bool, request: pytest.FixtureRequest
) -> None:
    """With the stream held busy, at most ``max_in_flight`` awaited ops are enqueued on it.

    The rest wait in the loop's admission queue (so the loop never blocks in a
    full driver queue), all complete with correct results, and the cap lifts.
    ``first_use``: the process compiles programs and the op was never seen warm, so each
    await is enqueued off the loop's thread (what a GPU's first use of a kernel does); the
    cap holds for those too.
    """
    from deviceops import _async, _offload
    from deviceops._backend import program_loads

    if first_use:
        saved = list(program_loads)
        program_loads[1] = 1
        _offload.reset()

        def restore() -> None:
            program_loads[:] = saved
            _offload.reset()

        request.addfinalizer(restore)

    cap, count = 8, 60
    s = dev.new_stream()
    pol = SingleStream(s)
    src = api.full((256,), 1.0).sync_on(s)
    dst = api.zeros((256,)).sync_on(s)
    slow_copy(dst, src, 0.0).sync_on(s)  # compile outside the measured window
    xs = [api.full((4,), float(i)).sync_on(s) for i in range(count)]
    zs = [api.full((4,), 1.0).sync_on(s) for i in range(count)]
    # compile saxpy before the stream is held: a first use compiles and loads its module off
    # the loop, and a module load waits for the held stream (the gate would open only at its
    # 30 s timeout)
    kernels.saxpy(zs[0], 0.0, xs[0]).sync_on(s)
    before = deviceops.configure_await()
    deviceops.configure_await(max_in_flight=cap)
    peak = 0
    started = 0
    done = anyio.Event()
    gate = threading.Event()

    async def watch() -> None:
        # the stream is held shut (event order, not a time window) until every await has
        # started and the cap is reached; then it opens and the queue drains
        nonlocal peak
        while not done.is_set():
            sl = _async._current()[1]
            depth = sl.depth.get(s.id, 0)
            peak = max(peak, depth)
            if started == count and depth >= cap:
                gate.set()
            await anyio.sleep(0)

    outs: list[Any] = [None] * count

    async def one(i: int) -> None:
        nonlocal started
        started += 1
        with deviceops.scheduling.using(pol):  # `await op` enqueues on the current policy
            outs[i] = await kernels.saxpy(zs[i], 2.0, xs[i])  # in place: no allocation

    from deviceops.graphs import host_task

    try:
        host_task(lambda: gate.wait(30), "gate").async_on(s)  # hold the stream shut
        async with anyio.create_task_group() as outer:
            outer.start_soon(watch)
            async with anyio.create_task_group() as tg:
                for i in range(count):
                    tg.start_soon(one, i)
            done.set()
        sl = _async._current()[1]
        assert not sl.pressured and s.id not in sl.depth, "back-pressure did not lift"
    finally:
        gate.set()
        deviceops.configure_await(**before)
    # Exactly the cap: reached while the stream is held, never passed.
    assert peak == cap, f"peak {peak} awaited ops in flight on one stream, cap {cap}"
    for i, t in enumerate(outs):
        assert t is zs[i]
        np.testing.assert_array_equal(to_np_nosync(t), 1.0 + 2.0 * i)


async def _spawn_all(ticker: Any, one: Any, count: int, done: anyio.Event) -> None:
    async with anyio.create_task_group() as outer:
        outer.start_soon(ticker)
        async with anyio.create_task_group() as tg:
            for i in range(count):  # spawned 100 per loop pass, as requests arrive at a server
                tg.start_soon(one, i)
                if i % 100 == 99:
                    await anyio.sleep(0)
        done.set()


def to_np_nosync(t: deviceops.Tensor) -> Any:
    """Host copy of an awaited (hence complete) tensor without another sync."""
    a = t.array
    return a.get() if hasattr(a, "get") else a


async def test_await_inside_then_closure_is_refused(dev: deviceops.Device) -> None:
    async def inner() -> None:
        await api.ones((1,))

    def closure(t: deviceops.Tensor) -> deviceops.DeviceOp[Any]:
        coro = inner()
        try:
            coro.send(None)
        finally:
            coro.close()
        return deviceops.value(t)

    with pytest.raises(deviceops.NestedExecutionError, match="then"):
        await api.ones((1,)).then(closure)


async def test_future_awaitable_from_another_loop(dev: deviceops.Device) -> None:
    """DeviceFutures are not bound to a loop: one scheduled outside any loop works here."""
    result: list[deviceops.DeviceFuture[Any]] = []
    th = threading.Thread(target=lambda: result.append(api.full((4,), 9.0).schedule()))
    th.start()
    th.join()
    t = await result[0]
    np.testing.assert_array_equal(to_np(t), 9.0)


def test_add_done_callback_and_timeout(dev: deviceops.Device) -> None:
    s = dev.new_stream()
    src = api.full((64,), 1.0).sync_on(s)
    dst = api.zeros((64,)).sync_on(s)
    fut = slow_copy(dst, src, _delay(dev)).schedule(SingleStream(s))
    assert not fut.done()
    with pytest.raises(TimeoutError):
        fut.result(timeout=0.001)
    called = threading.Event()
    seen: list[deviceops.DeviceFuture[Any]] = []

    def cb(f: deviceops.DeviceFuture[Any]) -> None:
        seen.append(f)
        called.set()

    fut.add_done_callback(cb)
    assert called.wait(10)
    assert seen == [fut]
    assert fut.result(timeout=10) is dst
    fut.add_done_callback(cb)  # already done: called at once
    assert len(seen) == 2


def test_await_outside_a_loop_is_a_clear_error(dev: deviceops.Device) -> None:
    coro = api.ones((1,)).__await__()
    with pytest.raises(RuntimeError, match="running asyncio or trio event loop"):
        next(coro)


def test_configure_await_validates() -> None:
    before = deviceops.configure_await()
    try:
        assert deviceops.configure_await(spin_us=5)["spin_us"] == pytest.approx(5)
        with pytest.raises(ValueError, match="spin_us"):
            deviceops.configure_await(spin_us=-1)
        with pytest.raises(ValueError, match="slice_ms"):
            deviceops.configure_await(slice_ms=0)
        with pytest.raises(ValueError, match="max_in_flight"):
            deviceops.configure_await(max_in_flight=1)
        assert deviceops.configure_await(max_in_flight=64)["max_in_flight"] == 64
    finally:
        deviceops.configure_await(**before)
