"""Device failures are delivered exactly once, to the right consumer, naming the failing op,
and every stream involved is usable afterwards (cpu backend, in-process).

``tests/test_reliability_errors.py`` checks that a failure *reaches* its consumer; these
tests check what happens around it: a failing ``zip`` branch raises at the join and nowhere
else (not again on the branch's own stream, not in a later ``zip`` or op that reuses the
pool's streams, not through an event), the error names the failing op and its message, the
other branches' results are intact, and a second, independent failure is reported as itself
(a stale first error does not mask it). The same for ``shared`` with consumers on several
streams. Property tests over random programs are in ``tests/test_properties.py``.

Mutant these tests were written to kill (tests/MUTATION.md): the zip join's
``hand_over_error()`` removed (the branch stream keeps the error it already delivered).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import deviceops
from deviceops import LaunchError, Stream, Tensor, api, kernels
from deviceops._context import ExecutionContext
from deviceops._launch import launch
from deviceops.kernels import KernelOp
from deviceops.scheduling import SingleStream, StreamPoolRoundRobin

from .conftest import to_np

CPU = deviceops.device("cpu")


def failing_op(out: Tensor, what: str) -> KernelOp:
    """A kernel op that fails on the device (cpu: its task raises ``what``)."""

    def run(ctx: ExecutionContext, o: Tensor) -> Tensor:
        def cpu() -> None:
            raise RuntimeError(what)

        launch(ctx, "fail_inject", (), (o,), cpu, lambda native: None)
        return o

    return KernelOp("fail_inject", run, (out,))


def _buf(n: int = 4) -> Tensor:
    return api.zeros((n,)).sync_on(CPU.new_stream())


def assert_clean(streams: tuple[Stream, ...] | list[Stream]) -> None:
    """Every stream runs new work without an error: synchronized, through an event, and as
    the source of a cross-stream wait."""
    for s in streams:
        t = api.full((3,), 7.0).sync_on(s)
        np.testing.assert_array_equal(to_np(t), 7.0)
        s.synchronize()
        s.record_event().synchronize()
        other = CPU.new_stream()
        other.wait_event(s.record_event())
        other.synchronize()
        got = api.full((2,), 2.0).schedule(SingleStream(s)).result(timeout=10)
        np.testing.assert_array_equal(to_np(got), 2.0)


@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("how", ["sync", "schedule", "sync_on"])
def test_zip_branch_failure_delivered_once_and_streams_clean(position: int, how: str) -> None:
    pool = StreamPoolRoundRobin(CPU, num_streams=3)
    ops: list[deviceops.DeviceOp[Any]] = [api.full((4,), float(i)) for i in range(3)]
    ops[position]._consume()
    ops[position] = failing_op(_buf(), f"branch {position} broke")
    z = deviceops.zip(*ops)
    home = CPU.new_stream()
    with deviceops.using(pool), pytest.raises(LaunchError) as info:
        if how == "sync":
            z.sync()
        elif how == "schedule":
            z.schedule().result(timeout=10)
        else:
            z.sync_on(home)
    text = str(info.value) + repr(info.value.__cause__)
    assert "fail_inject" in text and f"branch {position} broke" in text, text
    assert_clean([*pool.streams, home])
    # the pool's streams serve a new zip: no stale error, the right values
    with deviceops.using(pool):
        outs = deviceops.zip(*(api.full((4,), float(10 + i)) for i in range(3))).sync()
    for i, o in enumerate(outs):
        np.testing.assert_array_equal(to_np(o), 10.0 + i)


def test_zip_good_branches_finish_and_keep_their_results() -> None:
    pool = StreamPoolRoundRobin(CPU, num_streams=3)
    a, c = _buf(), _buf()
    src = api.from_host(np.arange(4, dtype=np.float32)).sync_on(CPU.new_stream())
    z = deviceops.zip(kernels.add(src, src, out=a), failing_op(_buf(), "middle"),
                      kernels.mul(src, src, out=c))
    with deviceops.using(pool), pytest.raises(LaunchError, match="middle"):
        z.sync()
    np.testing.assert_array_equal(to_np(a), 2 * np.arange(4))
    np.testing.assert_array_equal(to_np(c), np.arange(4) ** 2)


def test_second_failure_is_reported_as_itself() -> None:
    """A stale first error on a branch stream would mask (or replace) the second one."""
    pool = StreamPoolRoundRobin(CPU, num_streams=2)
    with deviceops.using(pool):
        with pytest.raises(LaunchError, match="first failure"):
            deviceops.zip(api.ones((2,)), failing_op(_buf(), "first failure")).sync()
        for s in pool.streams:  # each stream of the pool fails once more, on its own
            with pytest.raises(LaunchError, match="second failure") as info:
                failing_op(_buf(), "second failure").sync_on(s)
            assert "first failure" not in str(info.value)
        assert_clean(pool.streams)


@pytest.mark.anyio
async def test_zip_failure_awaited_once_then_clean() -> None:
    pool = StreamPoolRoundRobin(CPU, num_streams=2)
    with deviceops.using(pool):
        with pytest.raises(LaunchError, match="awaited failure"):
            await deviceops.zip(api.ones((2,)), failing_op(_buf(), "awaited failure"))
        outs = await deviceops.zip(api.full((2,), 3.0), api.full((2,), 4.0))
    assert [float(to_np(o)[0]) for o in outs] == [3.0, 4.0]
    assert_clean(pool.streams)


def test_shared_failure_reaches_each_consumer_once() -> None:
    pool = StreamPoolRoundRobin(CPU, num_streams=3)
    s1, s2 = CPU.new_stream(), CPU.new_stream()
    src = failing_op(_buf(), "shared source broke").shared()
    with deviceops.using(pool):
        for s in (s1, s2):
            with pytest.raises(LaunchError, match="shared source broke"):
                src.map(lambda t: 0).sync_on(s)
    assert_clean([*pool.streams, s1, s2])


def test_nested_zip_failure_delivered_once() -> None:
    pool = StreamPoolRoundRobin(CPU, num_streams=4)
    inner = deviceops.zip(api.ones((2,)), failing_op(_buf(), "inner branch"))
    outer = deviceops.zip(api.full((2,), 5.0), inner)
    with deviceops.using(pool), pytest.raises(LaunchError, match="inner branch"):
        outer.sync()
    assert_clean(pool.streams)


def test_zip_raising_while_enqueueing_owns_its_branches_device_failures() -> None:
    """A branch that raises on the host while the zip enqueues it makes the zip raise that
    error; a device failure already enqueued on another branch's stream is part of the same
    failed zip and is not reported again later on that stream."""
    pool = StreamPoolRoundRobin(CPU, num_streams=3)

    def boom(t: Any) -> Any:
        raise ValueError("refused while enqueueing")

    z = deviceops.zip(api.ones((2,)), failing_op(_buf(), "device failure"),
                      api.ones((2,)).map(boom))
    with deviceops.using(pool), pytest.raises(ValueError, match="refused while enqueueing"):
        z.sync()
    assert_clean(pool.streams)


def test_zip_branch_with_mixed_devices_is_refused_naming_the_branch() -> None:
    from deviceops.scheduling import MultiDeviceRoundRobin

    d0, d1 = deviceops.device("cpu:0"), deviceops.device("cpu:1")
    x0 = api.full((2,), 1.0).sync_on(d0.new_stream())
    x1 = api.full((2,), 2.0).sync_on(d1.new_stream())
    # DeviceOp arguments: only placement sees that the inputs live on two devices
    z = deviceops.zip(api.ones((2,)), kernels.add(api.dup(x0), api.dup(x1)))
    with deviceops.using(MultiDeviceRoundRobin([d0, d1])), pytest.raises(
            deviceops.DeviceError, match=r"^add: its input tensors live on two devices"):
        z.sync()
