"""DeviceOp semantics: laziness, execute-once, combinators, guard, warnings, errors."""

from __future__ import annotations

import gc
import sys
import warnings
from typing import Any

import numpy as np
import pytest

import deviceops
from deviceops import DeviceOp, ExecutionContext, api, kernels
from deviceops.scheduling import SingleStream

from .conftest import to_np


class Counting(DeviceOp[int]):
    """An op that counts how often it was executed and on which streams."""

    __slots__ = ("calls", "result", "streams")

    def __init__(self, result: Any = 1) -> None:
        super().__init__()
        self.calls = 0
        self.result = result
        self.streams: list[int] = []

    def _execute(self, ctx: ExecutionContext) -> Any:
        self.calls += 1
        self.streams.append(ctx.stream.id)
        return self.result


def test_construction_runs_nothing() -> None:
    op = Counting()
    chained = op.map(lambda x: x + 1)
    assert op.calls == 0
    assert chained.sync() == 2
    assert op.calls == 1


def test_execute_once_plain_op_refuses_second_run() -> None:
    op = Counting()
    op.sync()
    with pytest.raises(deviceops.SchedulingError, match=r"already executed.*shared"):
        op.sync()


def test_op_used_by_two_combinators_is_refused_early() -> None:
    op = Counting()
    op.map(lambda x: x).sync()
    with pytest.raises(deviceops.SchedulingError, match="already"):
        op.map(lambda x: x)


def test_shared_executes_once_for_many_consumers(stream: deviceops.Stream) -> None:
    src = Counting(41)
    s = src.shared()
    a = s.map(lambda x: x + 1)
    b = s.map(lambda x: x - 1)
    assert deviceops.zip(a, b, s).sync_on(stream) == (42, 40, 41)
    assert src.calls == 1


def test_zip_executes_each_branch_once() -> None:
    ops = [Counting(i) for i in range(5)]
    assert deviceops.zip(*ops).sync() == (0, 1, 2, 3, 4)
    assert [o.calls for o in ops] == [1] * 5


def test_zip_method_matches_function() -> None:
    assert Counting(1).zip(Counting(2), Counting(3)).sync() == (1, 2, 3)


def test_unzip_executes_source_once() -> None:
    src = Counting((1, 2, 3))
    a, b, c = deviceops.unzip(src, 3)
    assert deviceops.zip(c, a, b).sync() == (3, 1, 2)
    assert src.calls == 1


def test_unzip_wrong_arity_is_clear() -> None:
    (a, b) = deviceops.unzip(Counting((1, 2, 3)), 2)
    with pytest.raises(TypeError, match="tuple of 2 outputs, got tuple of length 3"):
        deviceops.zip(a, b).sync()


def test_diamond_executes_root_once(dev: deviceops.Device) -> None:
    root = api.ones((8, 8)).shared()
    left = root.then(lambda t: kernels.add(t, t))
    right = root.then(lambda t: kernels.mul(t, t))
    joined = deviceops.zip(left, right).then(lambda lr: kernels.add(lr[0], lr[1]))
    out = joined.sync()
    np.testing.assert_array_equal(to_np(out), np.full((8, 8), 3.0, np.float32))


def test_diamond_counts_on_every_policy(dev: deviceops.Device) -> None:
    for policy in (SingleStream(dev.new_stream()), deviceops.scheduling.StreamPoolRoundRobin(dev, 3)):
        root = Counting(5)
        s = root.shared()
        op = deviceops.zip(s.map(lambda v: v * 2), s.map(lambda v: v * 3)).map(sum)
        with deviceops.using(policy):
            assert op.sync() == 25
        assert root.calls == 1


def test_then_is_bind_on_same_stream(stream: deviceops.Stream) -> None:
    first = Counting(3)
    second: list[Counting] = []

    def nxt(v: int) -> Counting:
        c = Counting(v * 10)
        second.append(c)
        return c

    assert first.then(nxt).sync_on(stream) == 30
    assert first.streams == [stream.id] and second[0].streams == [stream.id]


def test_then_closure_must_return_op() -> None:
    with pytest.raises(TypeError, match=r"returned int, not a DeviceOp; use \.map\(\)"):
        Counting(1).then(lambda v: v + 1).sync()  # type: ignore[arg-type, return-value]


def test_map_and_inspect() -> None:
    seen: list[int] = []
    assert Counting(2).inspect(seen.append).map(lambda v: v * 7).sync() == 14
    assert seen == [2]


def test_value() -> None:
    assert deviceops.value("x").sync() == "x"


def test_in_order_execution_on_one_stream(stream: deviceops.Stream) -> None:
    t = api.zeros((64,)).sync_on(stream)
    one = api.ones((64,)).sync_on(stream)
    for _ in range(50):
        kernels.saxpy(t, 1.0, one).async_on(stream)
    kernels.mul(t, t, out=t).async_on(stream)  # (50)^2 only if every saxpy came first
    stream.synchronize()
    np.testing.assert_array_equal(to_np(t), np.full(64, 2500.0, np.float32))


def test_error_in_closure_reaches_sync() -> None:
    class Boom(Exception):
        pass

    def bad(_: Any) -> DeviceOp[Any]:
        raise Boom("from closure")

    with pytest.raises(Boom, match="from closure"):
        Counting().then(bad).sync()
    with pytest.raises(Boom):
        Counting().map(lambda _: (_ for _ in ()).throw(Boom("map"))).sync()


def test_error_in_closure_reaches_future() -> None:
    fut = Counting().map(lambda _: 1 / 0).schedule()
    assert fut.done()
    with pytest.raises(ZeroDivisionError):
        fut.result()
    assert isinstance(fut.exception(), ZeroDivisionError)


def test_shared_error_reaches_every_consumer() -> None:
    s = Counting().map(lambda _: 1 / 0).shared()
    with pytest.raises(ZeroDivisionError):
        s.sync()
    with pytest.raises(ZeroDivisionError):
        s.map(lambda v: v).sync()


def test_never_executed_warning_names_op() -> None:
    with pytest.warns(RuntimeWarning, match="DeviceOp zeros was never executed"):
        op = api.zeros((2,))
        del op
        gc.collect()


def test_composed_op_warns_once_for_outer_only() -> None:
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        outer = api.zeros((2,)).map(lambda t: t)
        del outer
        gc.collect()
    msgs = [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "map(" in msgs[0]


def test_executed_and_consumed_ops_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        api.zeros((2,)).sync()
        a, b = deviceops.unzip(deviceops.zip(api.ones(1), api.ones(1)), 2)
        deviceops.zip(a, b).sync()
        gc.collect()


@pytest.mark.parametrize("call", ["sync", "sync_on", "async_on", "schedule"])
def test_nested_execution_is_refused_with_fix(call: str, stream: deviceops.Stream) -> None:
    def nested(_: Any) -> DeviceOp[Any]:
        inner = deviceops.value(1)
        try:
            if call == "sync":
                inner.sync()
            elif call == "sync_on":
                inner.sync_on(stream)
            elif call == "async_on":
                inner.async_on(stream)
            else:
                inner.schedule()
        finally:
            inner._state = 2  # consumed either way; keep the leak check quiet
        return deviceops.value(0)

    with pytest.raises(deviceops.NestedExecutionError, match=r"return the DeviceOp from a \.then"):
        Counting().then(nested).sync()


def test_guard_is_released_after_error() -> None:
    with pytest.raises(ZeroDivisionError):
        Counting().map(lambda _: 1 / 0).sync()
    assert Counting(9).sync() == 9


def test_to_dot_shows_streams(dev: deviceops.Device) -> None:
    op = deviceops.zip(api.ones((4,)), api.zeros((4,)))
    dot_before = op.to_dot()
    assert "zip[2]" in dot_before and "stream" not in dot_before
    with deviceops.using(deviceops.scheduling.StreamPoolRoundRobin(dev, 2)):
        op.sync()
    dot = op.to_dot()
    assert dot.count("stream ") >= 3 and "->" in dot


def test_repr_states() -> None:
    op = Counting()
    assert "fresh" in repr(op)
    op.sync()
    assert "executed" in repr(op)


def test_long_then_chain_does_not_hit_the_recursion_limit(stream: deviceops.Stream) -> None:
    z = api.zeros((8,)).sync_on(stream)
    x = api.ones((8,)).sync_on(stream)
    op: deviceops.DeviceOp[Any] = kernels.saxpy(z, 1.0, x)
    n = 3 * sys.getrecursionlimit()
    for _ in range(n - 1):
        op = op.then(lambda t: kernels.saxpy(t, 1.0, x))
    assert op.sync_on(stream) is z
    np.testing.assert_array_equal(to_np(z), float(n))
