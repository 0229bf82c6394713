"""Issue 16, item 2: deep DAGs execute iteratively (no RecursionError at 100,000 deep).

Each test builds a DAG nested far beyond Python's recursion limit (1,000 by default)
through one kind of nesting, executes it, checks the result exactly, and drops it
(deallocating a deeply nested chain must not crash either).
"""

from __future__ import annotations

import gc
import sys
from typing import Any

import numpy as np
import pytest

import deviceops
from deviceops import DeviceOp, Tensor, api, kernels

from .conftest import to_np

DEEP = 100_000


@pytest.fixture(autouse=True)
def _default_recursion_limit() -> Any:
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)  # what a user has: the test must not rely on a raised limit
    yield
    sys.setrecursionlimit(old)


def _ones(n: int = 4) -> Tensor:
    return api.ones((n,)).sync()


def test_kernel_argument_nesting_100k(stream: deviceops.Stream) -> None:
    acc = api.zeros((4,)).sync_on(stream)
    one = api.ones((4,)).sync_on(stream)
    op: DeviceOp[Any] = api.memcpy(acc, api.zeros((4,)).sync_on(stream))
    for _ in range(DEEP):
        op = kernels.add(op, one, out=acc)
    assert op.sync_on(stream) is acc
    np.testing.assert_array_equal(to_np(acc), float(DEEP))
    del op
    gc.collect()


def test_build_op_kernel_nesting(stream: deviceops.Stream) -> None:
    # kernels made by the shared builder (KernelOp) nest the same way
    x = api.full((2, 8), -3.0).sync_on(stream)
    op: DeviceOp[Any] = kernels.silu(x)
    for _ in range(3000):
        op = kernels.gelu(kernels.silu(op, out=x), out=x)
    assert op.sync_on(stream) is x
    assert np.isfinite(to_np(x)).all()


@pytest.mark.slow  # (issue 35: the default run stays under 5 minutes; --slow runs it)
@pytest.mark.parametrize("kind", ["map", "inspect", "then", "shared", "unzip", "mixed"])
def test_combinator_chains_100k(kind: str, stream: deviceops.Stream) -> None:
    seen = [0]

    def bump(v: int) -> None:
        seen[0] += 1

    op: DeviceOp[Any] = deviceops.value(0)
    for i in range(DEEP):
        k = kind if kind != "mixed" else ("map", "inspect", "then", "shared", "unzip")[i % 5]
        if k == "map":
            op = op.map(lambda v: v + 1)
        elif k == "inspect":
            op = op.inspect(bump).map(lambda v: v + 1)
        elif k == "then":
            op = op.then(lambda v: deviceops.value(v + 1))
        elif k == "shared":
            op = op.map(lambda v: v + 1).shared()
        else:
            first, second = deviceops.unzip(op.map(lambda v: (v + 1, -1)), 2)
            second._consume()  # only the first output is used
            op = first
    assert op.sync_on(stream) == DEEP
    if kind == "inspect":
        assert seen[0] == DEEP
    del op
    gc.collect()


def test_api_op_nesting_100k(stream: deviceops.Stream) -> None:
    dst = api.zeros((3,)).sync_on(stream)
    src = api.full((3,), 7.0).sync_on(stream)
    op: DeviceOp[Any] = api.memcpy(dst, src)
    for _ in range(DEEP):
        op = api.memcpy(dst, op)
    op = api.to_host(api.convert(api.dup(op), "float16"))
    np.testing.assert_array_equal(op.sync_on(stream), 7.0)


def test_deep_chain_failure_propagates(stream: deviceops.Stream) -> None:
    def boom(t: Tensor) -> Tensor:
        raise RuntimeError("deep failure")

    one = _ones()
    op: DeviceOp[Any] = api.ones((4,)).map(boom)
    for _ in range(20_000):
        op = kernels.add(op, one)
    with pytest.raises(RuntimeError, match="deep failure"):
        op.sync_on(stream)


def test_deep_shared_failure_reaches_both_consumers(stream: deviceops.Stream) -> None:
    def boom(v: int) -> int:
        raise RuntimeError("shared deep failure")

    op: DeviceOp[Any] = deviceops.value(0).map(boom)
    for _ in range(20_000):
        op = op.map(lambda v: v + 1).shared()
    for _ in range(2):
        with pytest.raises(RuntimeError, match="shared deep failure"):
            op.sync_on(stream)


def test_zip_of_deep_branches(stream: deviceops.Stream) -> None:
    branches = []
    for b in range(3):
        op: DeviceOp[Any] = deviceops.value(b)
        for _ in range(20_000):
            op = op.map(lambda v: v + 1)
        branches.append(op)
    assert deviceops.zip(*branches).sync_on(stream) == (20_000, 20_001, 20_002)


def test_deep_chain_each_node_runs_once(stream: deviceops.Stream) -> None:
    calls = [0]

    def f(v: int) -> int:
        calls[0] += 1
        return v + 1

    op: DeviceOp[Any] = deviceops.value(0)
    for _ in range(10_000):
        op = op.map(f)
    s = op.shared()
    t, u = _ones(), _ones()
    a = kernels.add(s.map(lambda v: t), u)  # two consumers of one shared source
    assert s.sync_on(stream) == 10_000
    a.sync_on(stream)
    assert calls[0] == 10_000
