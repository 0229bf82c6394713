"""Policies, zip overlap, several devices, traces and the DAG picture.

Overlap is measured with ``slow_copy`` (a device-side delay, then a copy), so
"two branches of length T" is literal on both backends.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import deviceops
from deviceops import api, kernels
from deviceops.kernels.testing import slow_copy
from deviceops.scheduling import (
    MultiDeviceRoundRobin,
    SchedulingPolicy,
    SingleStream,
    StreamPoolRoundRobin,
    current_policy,
)

from .conftest import overlapped, to_np, traced


def _t(dev: deviceops.Device) -> float:
    return 0.15 if dev.is_cpu else 0.02


def _branches(dev: deviceops.Device, n: int, delay: float) -> tuple[list[Any], list[deviceops.Tensor]]:
    s = dev.new_stream()
    srcs = [api.full((1024,), float(i + 1)).sync_on(s) for i in range(n)]
    dsts = [api.zeros((1024,)).sync_on(s) for _ in range(n)]
    return [slow_copy(d, x, delay) for d, x in zip(dsts, srcs, strict=True)], dsts


def _traced_zip(dev: deviceops.Device, policy: SchedulingPolicy, n: int, delay: float) -> list[Any]:
    """Run a zip of ``n`` slow copies under ``policy``; their trace records (device times)."""
    ops, dsts = _branches(dev, n, delay)
    with deviceops.using(policy), deviceops.trace() as t:
        out = deviceops.zip(*ops).sync()
    assert tuple(out) == tuple(dsts)
    for i, d in enumerate(dsts):
        np.testing.assert_array_equal(to_np(d), float(i + 1))
    return traced(t, "slow_copy")


def test_zip_branches_overlap_under_round_robin(dev: deviceops.Device) -> None:
    recs = _traced_zip(dev, StreamPoolRoundRobin(dev, num_streams=4), 2, _t(dev))
    assert len({r.stream for r in recs}) == 2, recs
    assert overlapped(recs), f"the two branches ran one after the other: {recs}"


def test_zip_branches_serialize_under_single_stream(dev: deviceops.Device) -> None:
    recs = _traced_zip(dev, SingleStream(dev.new_stream()), 2, _t(dev))
    assert len({r.stream for r in recs}) == 1, recs
    first, second = sorted(recs, key=lambda r: r.start)
    assert first.end <= second.start, f"branches on one stream overlapped: {recs}"


def test_zip_uses_distinct_streams_and_joins(dev: deviceops.Device) -> None:
    ops, _ = _branches(dev, 3, 0.001)
    pool = StreamPoolRoundRobin(dev, num_streams=3)
    z = deviceops.zip(*ops)
    with deviceops.using(pool):
        z.sync()
    assert len({op._ran_on for op in ops}) == 3
    dot = z.to_dot()
    assert dot.count("stream ") >= 3 and "slow_copy" in dot and "->" in dot


def test_using_and_default_policy(dev: deviceops.Device) -> None:
    default = current_policy()
    s = dev.new_stream()
    single = SingleStream(s)
    with deviceops.using(single) as p:
        assert p is single and current_policy() is single
        t = api.ones((2,)).sync()
        assert t._storage.write is not None and t._storage.write[0] is s
    assert current_policy() is default
    try:
        deviceops.set_default_policy(single)
        assert current_policy() is single
    finally:
        deviceops.set_default_policy(None)
    assert isinstance(current_policy(), StreamPoolRoundRobin)


def test_custom_policy_needs_only_next_stream(dev: deviceops.Device) -> None:
    streams = [dev.new_stream(), dev.new_stream()]

    class Alternate(SchedulingPolicy):
        def __init__(self) -> None:
            self.n = 0

        def next_stream(self) -> deviceops.Stream:
            self.n += 1
            return streams[self.n % 2]

    pol = Alternate()
    a, b = deviceops.zip(api.full((3,), 1.0), api.full((3,), 2.0)).schedule(pol).result()
    np.testing.assert_array_equal(to_np(kernels.add(a, b).sync()), 3.0)
    assert pol.n >= 2


def test_policy_argument_errors(dev: deviceops.Device) -> None:
    with pytest.raises((deviceops.SchedulingError, ValueError), match="num_streams"):
        StreamPoolRoundRobin(dev, num_streams=0)
    with pytest.raises(deviceops.SchedulingError, match="streams_per_device"):
        MultiDeviceRoundRobin([dev], streams_per_device=0)


def test_multi_device_round_robin_spreads_and_computes(dev: deviceops.Device) -> None:
    devices: list[Any] = ["cpu"] if dev.is_cpu else None  # type: ignore[assignment]
    pol = MultiDeviceRoundRobin(devices, streams_per_device=2)
    assert len(pol.streams) == 2 * len(pol.devices)
    seen = {pol.next_stream() for _ in range(len(pol.streams))}
    assert len(seen) == len(pol.streams)
    # Each branch builds its inputs where it lands: no cross-device use.
    ops = [api.full((16,), float(i)).then(lambda t: kernels.add(t, t)) for i in range(4)]
    with deviceops.using(pol):
        outs = deviceops.zip(*ops).sync()
    for i, o in enumerate(outs):
        assert o.device in pol.devices
        np.testing.assert_array_equal(to_np(o), 2.0 * i)


def test_tensor_from_another_device_is_refused_or_copied(dev: deviceops.Device) -> None:
    if dev.is_cpu:
        pytest.skip("needs a second device: the cpu backend plus a GPU")
    cpu = deviceops.device("cpu")
    host_t = api.full((8,), 3.0).sync_on(cpu.new_stream())
    assert host_t.device is cpu
    s = dev.new_stream()
    with pytest.raises(deviceops.DeviceError, match=r"is on cpu.*api.to_device"):
        kernels.add(host_t, host_t).sync_on(s)
    moved = api.to_device(host_t, dev).sync_on(s)
    assert moved.device is dev
    np.testing.assert_array_equal(to_np(kernels.add(moved, moved).sync_on(s)), 6.0)


def test_trace_records_streams_and_times(dev: deviceops.Device, tmp_path: Path) -> None:
    delay = _t(dev) / 3
    ops, _ = _branches(dev, 2, delay)
    with deviceops.trace() as t, deviceops.using(StreamPoolRoundRobin(dev, 2)):
        deviceops.zip(*ops).sync()
    recs = [r for r in t.records if r.name == "slow_copy"]
    assert len(recs) == 2
    assert len({r.stream for r in recs}) == 2
    assert all(r.device == str(dev) for r in recs)
    a, b = recs
    assert a.start is not None and a.end is not None and b.start is not None and b.end is not None
    assert a.end - a.start >= 0.8 * delay and b.end - b.start >= 0.8 * delay
    assert a.start < b.end and b.start < a.end, "the two branches should overlap in time"
    path = t.save(tmp_path / "trace.json")
    doc = json.loads(path.read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["name"] == "slow_copy"]
    assert len(spans) == 2 and len({e["tid"] for e in spans}) == 2


def test_trace_does_not_nest() -> None:
    with deviceops.trace(), pytest.raises(RuntimeError, match="do not nest"), deviceops.trace():
        pass
