"""Issue 16, items 1, 3, 5, 6: no error lost, no silent wrong answer, no deadlock.

Failures here are *device-side* failures: work that fails when the stream reaches it
(``failing_op`` below), not errors raised while enqueueing. On the ``cpu`` backend that is a
task raising on the stream's worker; these tests run on the cpu device explicitly so that
they also run in-process on a GPU machine (a CUDA kernel that traps poisons the whole
context: the CUDA versions run in a child process, see ``test_reliability_gpu.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import deviceops
from deviceops import LaunchError, NestedExecutionError, SchedulingError, Tensor, api, kernels
from deviceops._context import ExecutionContext
from deviceops._launch import launch
from deviceops.graphs import host_task
from deviceops.kernels import KernelOp
from deviceops.scheduling import SingleStream, StreamPoolRoundRobin

from .conftest import to_np

CPU = deviceops.device("cpu")


def failing_op(out: Tensor, what: str = "injected fault") -> KernelOp:
    """A kernel op that writes ``out`` and fails on the device (cpu: the task raises)."""

    def run(ctx: ExecutionContext, o: Tensor) -> Tensor:
        def cpu() -> None:
            o.array[...] = np.nan  # it wrote garbage, then failed
            raise RuntimeError(what)

        def cuda(native: Any) -> None:  # pragma: no cover - never launched in-process on cuda
            raise AssertionError("failing_op is for the cpu backend in-process")

        launch(ctx, "fail_inject", (), (o,), cpu, cuda)
        return o

    return KernelOp("fail_inject", run, (out,))


@pytest.fixture
def pool() -> Any:
    """A fresh cpu stream pool as the current policy (stale errors cannot leak between tests)."""
    p = StreamPoolRoundRobin(CPU, num_streams=4)
    with deviceops.using(p):
        yield p


def _buf(n: int = 3) -> Tensor:
    return api.zeros((n,)).sync_on(CPU.new_stream())


# -- 1. zip ---------------------------------------------------------------------------------


def test_zip_failing_branch_reaches_sync(pool: Any) -> None:
    with pytest.raises(LaunchError, match=r"fail_inject.*injected fault"):
        deviceops.zip(api.ones((3,)), failing_op(_buf())).sync()


def test_zip_failing_branch_with_non_tensor_output_reaches_sync(pool: Any) -> None:
    # the output carries no tensor: only the join (the home stream waits on the branch) can
    # carry the error to the caller
    with pytest.raises(LaunchError, match=r"fail_inject.*injected fault"):
        deviceops.zip(api.ones((3,)), failing_op(_buf()).map(lambda t: 5)).sync()


@pytest.mark.parametrize("position", [0, 1, 2])
def test_zip_any_branch_position(pool: Any, position: int) -> None:
    ops: list[deviceops.DeviceOp[Any]] = [api.ones((3,)).map(lambda t: 1) for _ in range(3)]
    ops[position]._consume()
    ops[position] = failing_op(_buf()).map(lambda t: 0)
    with pytest.raises(LaunchError, match="injected fault"):
        deviceops.zip(*ops).sync()


def test_zip_failing_branch_reaches_sync_on(pool: Any) -> None:
    s = CPU.new_stream()
    with pytest.raises(LaunchError, match="injected fault"):
        deviceops.zip(api.ones((3,)), failing_op(_buf()).map(lambda t: 0)).sync_on(s)
    # the stream is usable afterwards
    np.testing.assert_array_equal(to_np(api.ones((2,)).sync_on(s)), 1.0)


def test_zip_failing_branch_reaches_schedule_result(pool: Any) -> None:
    fut = deviceops.zip(api.ones((3,)), failing_op(_buf()).map(lambda t: 0)).schedule()
    with pytest.raises(LaunchError, match="injected fault"):
        fut.result()


@pytest.mark.anyio
async def test_zip_failing_branch_reaches_await(pool: Any) -> None:
    with pytest.raises(LaunchError, match="injected fault"):
        await deviceops.zip(api.ones((3,)), failing_op(_buf()).map(lambda t: 0))


@pytest.mark.anyio
async def test_zip_failing_branch_tensor_output_reaches_await(pool: Any) -> None:
    with pytest.raises(LaunchError, match="fail_inject"):
        await deviceops.zip(api.ones((3,)), failing_op(_buf()))


def test_zip_under_single_stream(pool: Any) -> None:
    with deviceops.using(SingleStream(CPU.new_stream())), pytest.raises(LaunchError,
                                                                         match="injected"):
        deviceops.zip(failing_op(_buf()).map(lambda t: 0), api.ones((3,))).sync()


def test_issue_example_nan_fill_for_int_is_refused_before_launch() -> None:
    ones = api.ones(3)
    with pytest.raises(ValueError, match=r"full.*fill_value nan.*int32"):
        deviceops.zip(ones, api.full((3,), float("nan"), "int32"))
    ones.sync()


# -- 3. shared() and failed producers -------------------------------------------------------


def test_shared_failure_reaches_every_consumer(pool: Any) -> None:
    s = failing_op(_buf()).shared()
    for _ in range(3):
        with pytest.raises(LaunchError, match="fail_inject"):
            s.sync()


def test_shared_failure_reaches_every_consumer_non_tensor(pool: Any) -> None:
    s = failing_op(_buf()).map(lambda t: "host value").shared()
    for i in range(4):
        with pytest.raises(LaunchError, match="injected fault"):
            s.map(lambda v: v).sync() if i % 2 else s.sync()


def test_shared_failure_reaches_consumers_on_one_stream() -> None:
    st = CPU.new_stream()
    with deviceops.using(SingleStream(st)):
        s = failing_op(_buf()).map(lambda t: 1).shared()
        for _ in range(3):
            with pytest.raises(LaunchError, match="injected fault"):
                s.sync()


def test_shared_failure_reaches_kernel_consumers(pool: Any) -> None:
    s = failing_op(_buf()).shared()
    one = api.ones((3,)).sync()
    for _ in range(3):
        with pytest.raises(LaunchError, match="fail_inject"):
            kernels.add(s, one).sync()


def test_unzip_failure_reaches_every_output(pool: Any) -> None:
    a, b = deviceops.unzip(deviceops.zip(api.ones((3,)), failing_op(_buf()).map(lambda t: 0)), 2)
    with pytest.raises(LaunchError, match="injected"):
        a.sync()
    with pytest.raises(LaunchError, match="injected"):
        b.sync()


def test_consumer_of_failed_output_raises_naming_producer(pool: Any) -> None:
    out = _buf()
    with pytest.raises(LaunchError):
        failing_op(out).sync()
    one = api.ones((3,)).sync()
    # known failed at enqueue: refused before launch, naming the producer
    with pytest.raises(LaunchError, match=r"add: an input was produced by fail_inject"):
        kernels.add(out, one).sync()
    with pytest.raises(LaunchError, match=r"fail_inject"):
        api.to_host(out).sync()


def test_failure_propagates_through_a_chain(pool: Any) -> None:
    one = api.ones((3,)).sync()
    op: deviceops.DeviceOp[Any] = failing_op(_buf())
    for _ in range(5):
        op = kernels.add(op, one)
    with pytest.raises(LaunchError, match="fail_inject"):
        op.sync()


def test_overwrite_clears_the_failure(pool: Any) -> None:
    out = _buf()
    with pytest.raises(LaunchError):
        failing_op(out).sync()
    api.memcpy(out, api.ones((3,)).sync()).sync()
    np.testing.assert_array_equal(to_np(kernels.add(out, out).sync()), 2.0)


def test_enqueue_error_in_shared_reaches_every_consumer(pool: Any) -> None:
    def boom(t: Tensor) -> Tensor:
        raise ValueError("host-side failure")

    s = api.ones((3,)).map(boom).shared()
    for _ in range(3):
        with pytest.raises(ValueError, match="host-side failure"):
            s.sync()


# -- 4 (combinator misuse) ------------------------------------------------------------------


def test_then_map_inspect_refuse_non_callables() -> None:
    op = api.ones((3,))
    with pytest.raises(TypeError, match=r"then: fn must be callable.*NoneType"):
        op.then(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"map: fn must be callable.*int"):
        op.map(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"inspect: fn must be callable"):
        op.inspect("x")  # type: ignore[arg-type]
    assert op.sync().shape == (3,)  # still usable: nothing was consumed


def test_second_use_of_consumed_op_refused_at_once() -> None:
    x = api.ones((3,))
    y = x.map(lambda t: t)
    with pytest.raises(SchedulingError, match=r"ones.*already passed to map"):
        x.sync()
    with pytest.raises(SchedulingError, match=r"ones.*already passed to map"):
        x.schedule().result()
    with pytest.raises(SchedulingError, match=r"ones.*passed to map"):
        deviceops.zip(x, api.ones((2,)).map(lambda t: t).shared())
    assert y.sync().shape == (3,)  # the combinator still works


def test_second_use_in_kernel_refused_naming_both() -> None:
    x = api.ones((3,))
    k = kernels.add(x, api.ones((3,)).sync())
    with pytest.raises(SchedulingError, match=r"cannot pass ones to gelu.*already passed to add"):
        kernels.gelu(x)
    k.sync()


def test_same_op_twice_in_zip_refused() -> None:
    x = api.ones((3,))
    with pytest.raises(SchedulingError, match="passed twice"):
        deviceops.zip(x, x)
    s = api.ones((3,)).shared()
    assert len(deviceops.zip(s, s).sync()) == 2  # a shared op may be passed twice


def test_graph_of_consumed_op_refused() -> None:
    x = api.ones((3,))
    y = x.map(lambda t: t)
    with pytest.raises(SchedulingError, match="already passed to map"):
        x.graph()
    y.sync()


# -- 5. same failures on both backends -------------------------------------------------------


def test_to_host_in_graph_refused(dev: deviceops.Device) -> None:
    x = api.ones((3,)).sync()
    with pytest.raises(deviceops.CaptureError, match="to_host"):
        api.to_host(x).graph_on(dev.new_stream())


def test_to_host_in_graph_refused_on_cpu() -> None:
    s = CPU.new_stream()
    x = api.ones((3,)).sync_on(s)
    with pytest.raises(deviceops.CaptureError, match=r"to_host.*api.memcpy"):
        api.to_host(x).graph_on(s)


def test_embedding_out_of_range_clamps_on_every_backend(dev: deviceops.Device) -> None:
    s = dev.new_stream()
    table_h = np.arange(15, dtype=np.float32).reshape(5, 3)
    table = api.from_host(table_h).sync_on(s)
    for idt in ("int32", "int64"):
        ids = api.from_host(np.array([[0, 5, -1], [4, 1000, -7]], idt)).sync_on(s)
        got = to_np(kernels.embedding(ids, table).sync_on(s))
        want = table_h[np.clip(np.array([[0, 5, -1], [4, 1000, -7]]), 0, 4)]
        np.testing.assert_array_equal(got, want)


# -- 6. host tasks ---------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_sync_on_inside_host_task_on_same_stream_raises(dev: deviceops.Device) -> None:
    s = dev.new_stream()
    seen: list[BaseException] = []

    def fn() -> None:
        try:
            api.ones((3,)).sync_on(s)
        except BaseException as exc:
            seen.append(exc)

    host_task(fn, "nested").sync_on(s)
    assert len(seen) == 1 and isinstance(seen[0], NestedExecutionError), seen
    assert "host_task nested" in str(seen[0])


@pytest.mark.timeout(30)
def test_stream_synchronize_inside_host_task_raises_on_cpu() -> None:
    s = CPU.new_stream()
    seen: list[BaseException] = []

    def fn() -> None:
        try:
            s.synchronize()
        except BaseException as exc:
            seen.append(exc)

    host_task(fn).sync_on(s)
    assert len(seen) == 1 and isinstance(seen[0], NestedExecutionError), seen


@pytest.mark.timeout(30)
def test_await_and_schedule_inside_host_task_raise(dev: deviceops.Device) -> None:
    s = dev.new_stream()
    seen: list[str] = []

    def fn() -> None:
        for call in (lambda: api.ones((2,)).schedule(), lambda: api.ones((2,)).sync()):
            try:
                call()
            except NestedExecutionError:
                seen.append("refused")

    host_task(fn).sync_on(s)
    assert seen == ["refused", "refused"]
