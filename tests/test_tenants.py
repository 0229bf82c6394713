"""Tenants (issue 48): stream priorities, the bound on queued work, pools over devices.

Priorities are checked on the ``cpu`` backend by the order in which streams' tasks run (a
less urgent stream holds its next task back while a more urgent one has a task ready);
the bound by the state of the op that must wait (it is not executed until the tenant's
oldest op completes). No test reads a clock: blocked work is held by ``threading.Event``
gates and released by the test.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import anyio
import numpy as np
import pytest

import deviceops
from deviceops import SchedulingError, api, kernels
from deviceops.graphs import host_task
from deviceops.scheduling import PRIORITIES, Tenant, TenantPool, priority_level

from .conftest import to_np

CPU = deviceops.device("cpu")


def _fresh(op: deviceops.DeviceOp[Any]) -> bool:
    return "(fresh)" in repr(op)


def _stop(s: deviceops.Stream) -> threading.Event:
    """Hold ``s`` at a host task until the returned gate is set."""
    gate = threading.Event()
    s.launch_host_func(gate.wait)
    return gate


# -- stream priorities ---------------------------------------------------------------------

def test_stream_priority_range_and_clamping(dev: deviceops.Device) -> None:
    least, greatest = dev.stream_priorities
    assert greatest <= least
    assert dev.new_stream().priority == least == 0
    assert dev.new_stream(priority=-1000).priority == greatest
    assert dev.new_stream(priority=7).priority == least
    with pytest.raises(TypeError, match="priority must be an int"):
        dev.new_stream(priority="high")  # type: ignore[arg-type]
    assert CPU.stream_priorities == (0, -5)


@pytest.mark.gpu
def test_cuda_stream_carries_its_priority() -> None:
    dev = deviceops.device(0)
    least, greatest = dev.stream_priorities
    s = dev.new_stream(priority=greatest)
    assert s.priority == greatest and s.native.priority == greatest
    assert dev.new_stream().native.priority == least


def test_yielding_streams(dev: deviceops.Device) -> None:
    assert not dev.new_stream().yields
    assert dev.new_stream(0, yields=True).yields
    with pytest.raises(TypeError, match="yields must be a bool"):
        dev.new_stream(0, yields=1)  # type: ignore[arg-type]
    assert Tenant("bg", priority="low", device=dev, streams=2).streams[1].yields
    assert not any(s.yields for s in Tenant("fg", priority="high", device=dev).streams)
    assert not any(s.yields for s in Tenant("mid", device=dev).streams)  # "normal"
    mine = dev.new_stream(0)
    assert not Tenant("own", priority="low", streams=[mine]).streams[0].yields  # as given


@pytest.mark.gpu
def test_gemm_on_a_yielding_stream_equals_the_persistent_grid() -> None:
    """More tiles than SMs (the persistent grid walks several a block; yielding: one each):
    the same products, equal to a float64 reference, outputs poisoned first."""
    dev = deviceops.device(0)
    rng = np.random.default_rng()
    for m, n, k in ((2048 + 64, 4096 + 8, 520), (3000, 2056, 1000)):
        ah = rng.standard_normal((m, k), dtype=np.float32).astype(np.float16)
        bh = (rng.standard_normal((k, n), dtype=np.float32) / np.sqrt(k)).astype(np.float16)
        want = ah.astype(np.float64) @ bh.astype(np.float64)
        a, b = api.from_host(ah).sync(), api.from_host(bh).sync()
        got = []
        for yields in (False, True):
            s = dev.new_stream(0, yields=yields)
            out = api.full((m, n), float("nan"), "float16").sync_on(s)
            kernels.gemm(a, b, out=out).sync_on(s)
            got.append(to_np(out).astype(np.float64))
        np.testing.assert_allclose(got[1], want, rtol=2e-2, atol=2e-2)
        np.testing.assert_array_equal(got[0], got[1])  # same tiles, same sums: bit-equal


def test_priority_levels() -> None:
    assert priority_level(CPU, "high") == -5
    assert priority_level(CPU, "low") == 0
    assert priority_level(CPU, "normal") == -2  # half way, rounded toward the least urgent
    assert priority_level(CPU, -99) == -5 and priority_level(CPU, 3) == 0
    assert PRIORITIES == ("high", "normal", "low")
    with pytest.raises(ValueError, match="one of"):
        priority_level(CPU, "urgent")
    with pytest.raises(TypeError):
        priority_level(CPU, 1.5)  # type: ignore[arg-type]


def test_cpu_more_urgent_stream_runs_its_ready_tasks_first() -> None:
    low, high = CPU.new_stream(), CPU.new_stream(priority=-5)
    order: list[str] = []
    gate = _stop(low)
    for i in range(3):
        low.launch_host_func(lambda i=i: order.append(f"low{i}"))
    hold = _stop(high)  # the urgent stream has tasks ready (held) when the gate opens
    for i in range(3):
        high.launch_host_func(lambda i=i: order.append(f"high{i}"))
    gate.set()
    hold.set()
    low.synchronize()
    high.synchronize()
    assert order == ["high0", "high1", "high2", "low0", "low1", "low2"]


def test_cpu_equal_priorities_do_not_hold_each_other() -> None:
    a, b = CPU.new_stream(priority=-5), CPU.new_stream(priority=-5)
    gate = _stop(a)
    done = threading.Event()
    b.launch_host_func(done.set)
    b.synchronize()  # b ran while a, as urgent, had a task held
    assert done.is_set() and not a.query()
    gate.set()
    a.synchronize()


def test_cpu_urgent_stream_waiting_on_a_less_urgent_one_does_not_deadlock() -> None:
    low, high = CPU.new_stream(), CPU.new_stream(priority=-5)
    order: list[str] = []
    gate = _stop(low)
    low.launch_host_func(lambda: order.append("low"))
    high.wait_event(low.record_event())  # high is blocked on low: it holds nothing back
    high.launch_host_func(lambda: order.append("high"))
    gate.set()
    high.synchronize()
    assert order == ["low", "high"]


def test_cpu_idle_urgent_stream_holds_nothing_back() -> None:
    high = CPU.new_stream(priority=-5)
    high.synchronize()
    x = api.ones((8,)).sync_on(CPU.new_stream())
    np.testing.assert_array_equal(to_np(x), 1.0)


# -- tenants ---------------------------------------------------------------------------------

def test_tenant_validation() -> None:
    with pytest.raises(SchedulingError, match="max_queued"):
        Tenant("a", device=CPU, max_queued=0)
    with pytest.raises(SchedulingError, match="streams must be >= 1"):
        Tenant("a", device=CPU, streams=0)
    with pytest.raises(SchedulingError, match="at least one stream"):
        Tenant("a", streams=())
    with pytest.raises(SchedulingError, match="max_queued"):
        Tenant("a", device=CPU, max_queued=True)  # type: ignore[arg-type]
    with pytest.raises(SchedulingError, match=r"every stream must live on cpu$"):
        Tenant("a", streams=[CPU.new_stream(), deviceops.device("cpu:1").new_stream()])
    assert Tenant("here").device is deviceops.default_device()
    with pytest.raises(ValueError, match="one of"):
        Tenant("a", device=CPU, priority="urgent")
    t = Tenant("named", device=CPU, priority="high", streams=2)
    assert t.priority == -5 and all(s.priority == -5 for s in t.streams) and len(t.streams) == 2
    assert t.device is CPU and "named" in repr(t)


class _Ev:
    """A stand-in completion event: done or not, or a query that fails (a device error)."""

    def __init__(self, done: bool = False, fails: bool = False) -> None:
        self.done, self.fails = done, fails

    def query(self) -> bool:
        if self.fails:
            raise RuntimeError("the device reported a failure")
        return self.done


def test_backlog_waits_for_the_oldest_and_drops_completed_or_failed_events() -> None:
    from deviceops.scheduling._tenants import _prune

    t = Tenant("t", device=CPU, max_queued=2)
    s = t.streams[0]
    old, new = _Ev(), _Ev()
    t.enqueued(s, old)  # type: ignore[arg-type]
    assert t.backlog() is None
    t.enqueued(s, new)  # type: ignore[arg-type]
    assert t.backlog() is old and t.in_flight == 2
    old.fails = True  # a failed op counts as complete: its future reports it
    assert t.backlog() is None and t.in_flight == 1
    evs: Any = deque([_Ev(True), _Ev(fails=True), _Ev(), _Ev(True), _Ev()])
    _prune(evs)  # the done head and the failed one, then one done behind a lagging head
    assert [e.done for e in evs] == [False, False]
    evs = deque([_Ev(), _Ev(fails=True)])
    _prune(evs)
    assert len(evs) == 1 and not evs[0].fails


def test_pool_balances_each_priority_over_the_devices() -> None:
    c0, c1 = deviceops.device("cpu"), deviceops.device("cpu:1")
    pool = TenantPool([c0, c1])
    low = pool.tenant("bg", priority="low")
    assert low.device is c0  # (all empty: the first listed)
    assert pool.tenant("h1", priority="high").device is c1  # fewest tenants in all
    assert pool.tenant("h2", priority="high").device is c0  # fewest of its priority first


def test_tenant_runs_ops_on_its_own_streams(dev: deviceops.Device) -> None:
    t = Tenant("solo", device=dev, streams=2, priority="high")
    with deviceops.using(t):
        a = api.ones((4,)).schedule()
        b = api.ones((4,)).schedule()
        c = api.full((4,), 3.0).sync()
    assert {a.stream, b.stream} == set(t.streams)
    np.testing.assert_array_equal(to_np(c), 3.0)
    a.result()
    b.result()
    assert t.in_flight == 0


def test_tenant_schedule_blocks_the_thread_at_its_bound() -> None:
    t = Tenant("bounded", device=CPU, max_queued=2)
    gate = _stop(t.streams[0])
    f1, f2 = api.ones((2,)).schedule(t), api.ones((2,)).schedule(t)
    assert t.in_flight == 2
    order: list[str] = []
    waiting = threading.Event()
    real = t.backlog

    def backlog() -> Any:
        ev = real()
        if ev is not None:
            waiting.set()
        return ev

    t.backlog = backlog  # type: ignore[method-assign]
    third = api.full((2,), 3.0)
    box: list[Any] = []

    def submit() -> None:
        box.append(third.schedule(t))
        order.append("scheduled")

    th = threading.Thread(target=submit)
    th.start()
    waiting.wait()  # the thread found the tenant full
    assert _fresh(third) and not box
    order.append("released")
    gate.set()
    th.join()
    assert order == ["released", "scheduled"]
    np.testing.assert_array_equal(to_np(box[0].result()), 3.0)
    f1.result()
    f2.result()


@pytest.mark.anyio
async def test_await_waits_for_room_without_blocking_the_loop() -> None:
    t = Tenant("big", device=CPU, max_queued=2)
    other = Tenant("small", device=CPU, priority="high")
    gate = _stop(t.streams[0])
    held = [api.ones((2,)).schedule(t), api.ones((2,)).schedule(t)]
    third = api.full((2,), 3.0)
    got: list[Any] = []

    async def submit() -> None:
        with deviceops.using(t):
            got.append(await third)

    async with anyio.create_task_group() as tg:
        tg.start_soon(submit)
        await anyio.wait_all_tasks_blocked()
        assert _fresh(third) and not got  # waiting for the tenant's oldest op, not enqueued
        with deviceops.using(other):  # the loop runs on: another tenant's await completes
            y = await api.full((2,), 5.0)
            host = await y.to_host()
        np.testing.assert_array_equal(host, 5.0)
        assert _fresh(third) and not got and t.in_flight == 2
        gate.set()
    np.testing.assert_array_equal(to_np(got[0]), 3.0)
    for f in held:
        await f
    assert t.in_flight == 0


@pytest.mark.anyio
async def test_cancelling_an_await_waiting_for_room_spends_the_op() -> None:
    t = Tenant("c", device=CPU, max_queued=1)
    gate = _stop(t.streams[0])
    first = api.ones((2,)).schedule(t)
    op = api.ones((2,))

    async def submit() -> None:
        with deviceops.using(t):
            await op

    async with anyio.create_task_group() as tg:
        tg.start_soon(submit)
        await anyio.wait_all_tasks_blocked()
        assert _fresh(op)
        tg.cancel_scope.cancel()
    assert not _fresh(op)  # spent: no "never executed" warning (the autouse fixture checks)
    assert t.in_flight == 1
    gate.set()
    await first
    assert t.in_flight == 0


@pytest.mark.anyio
async def test_small_tenant_overtakes_a_big_tenants_queue() -> None:
    """A big tenant has queued work on a least-urgent stream; a high-priority tenant's op
    submitted afterwards runs before the big tenant's queued ops (cpu emulation)."""
    pool = TenantPool([CPU], max_queued=3)
    big = pool.tenant("big", priority="low")
    small = pool.tenant("small", priority="high")
    order: list[str] = []
    gate = _stop(big.streams[0])
    with deviceops.using(big):
        futs = [host_task(lambda i=i: order.append(f"big{i}")).schedule() for i in range(3)]
    assert big.in_flight == 3
    with deviceops.using(small):
        hold = _stop(small.streams[0])  # the small op is ready when the big stream is let go
        fut = host_task(lambda: order.append("small")).schedule()
        gate.set()
        hold.set()
        await fut
    for f in futs:
        await f
    assert order == ["small", "big0", "big1", "big2"]


@pytest.mark.anyio
async def test_failed_op_frees_the_tenant_and_reports_its_error() -> None:
    t = Tenant("f", device=CPU, max_queued=1)

    def boom() -> None:
        raise RuntimeError("boom")

    with deviceops.using(t):
        with pytest.raises(deviceops.DeviceError, match="boom"):
            await host_task(boom, "boom")
        x = await api.full((2,), 2.0)  # room again, and the stream is usable
    np.testing.assert_array_equal(to_np(x), 2.0)


def test_tenant_zip_branches_use_its_branch_streams() -> None:
    pool = TenantPool([CPU], streams_per_priority=3)
    t = pool.tenant("z", priority="high")
    with deviceops.using(t):
        a, b, c = deviceops.zip(api.ones((2,)), api.ones((2,)), api.ones((2,))).sync()
    writers = [x._storage.write[0] for x in (a, b, c)]
    assert writers[0] is t.streams[0]  # the home branch stays on the tenant's own stream
    assert all(s in t.branch_streams for s in writers) and len(t.branch_streams) == 3
    assert all(s.priority == -5 for s in t.branch_streams)
    np.testing.assert_array_equal(to_np(kernels.add(a, c).sync_on(t.streams[0])), 2.0)


def test_pool_shares_streams_per_priority_and_spreads_over_devices() -> None:
    c0, c1 = deviceops.device("cpu"), deviceops.device("cpu:1")
    pool = TenantPool([c0, c1], streams_per_priority=2, max_queued=3)
    smalls = [pool.tenant(f"s{i}", priority="high") for i in range(8)]
    bigs = [pool.tenant(f"b{i}", priority="low", max_queued=1) for i in range(2)]
    assert [t.device for t in smalls].count(c0) == 4 and [t.device for t in smalls].count(c1) == 4
    assert {t.device for t in bigs} == {c0, c1}
    homes = {t.streams[0] for t in smalls}
    assert len(homes) == 4 and all(s.priority == -5 for s in homes)  # 2 a device, shared
    assert all(t.max_queued == 3 for t in smalls) and all(t.max_queued == 1 for t in bigs)
    assert all(t.streams[0].priority == 0 for t in bigs)
    # background (least urgent) streams yield SMs between tiles; the others do not
    assert all(s.yields for t in bigs for s in t.branch_streams)
    assert not any(s.yields for t in smalls for s in t.branch_streams)
    pinned = pool.tenant("p", device="cpu:1")
    assert pinned.device is c1
    with pytest.raises(SchedulingError, match="not one of"):
        pool.tenant("x", device="cpu:2")
    # each tenant's work lands on its device
    for t in (*smalls[:2], *bigs):
        with deviceops.using(t):
            x = api.ones((3,)).sync()
        assert x.device is t.device
    with pytest.raises(SchedulingError, match="at least one device"):
        TenantPool([])
    with pytest.raises(SchedulingError, match="named twice"):
        TenantPool(["cpu", "cpu"])


@pytest.mark.anyio
async def test_many_tenants_each_get_their_own_results(dev: deviceops.Device) -> None:
    pool = TenantPool([dev], max_queued=2)
    tenants = [pool.tenant(f"t{i}", priority="high" if i % 4 else "low") for i in range(12)]
    results: dict[int, list[float]] = {}

    async def job(i: int) -> None:
        with deviceops.using(tenants[i]):
            x = await api.full((16, 16), float(i))
            for _ in range(3):
                x = await kernels.add(x, x)
            results[i] = [float(v) for v in (await x.to_host()).ravel()[:2]]

    async with anyio.create_task_group() as tg:
        for i in range(12):
            tg.start_soon(job, i)
    assert results == {i: [8.0 * i, 8.0 * i] for i in range(12)}
    assert all(t.in_flight == 0 for t in tenants)
