"""Cross-stream safety: RAW/WAR/WAW ordering and memory reuse, made race-prone on purpose.

Each test launches a slow writer or reader (``slow_copy``: a device-side delay,
then a copy) on one stream and immediately touches the same tensor from
another. Without hazard tracking the second stream would run first and the
result would be wrong nearly every time.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

import deviceops
from deviceops import api, kernels
from deviceops._tensor import parked_count
from deviceops.kernels.testing import slow_copy

from .conftest import to_np

N = 4096
ROUNDS = 100


def _delay(dev: deviceops.Device) -> float:
    return 0.002 if dev.is_cpu else 0.0005


def test_read_after_write_across_streams(dev: deviceops.Device) -> None:
    a, b = dev.new_stream(), dev.new_stream()
    src = api.full((N,), 5.0).sync_on(a)
    fails = 0
    for i in range(ROUNDS):
        mid = api.zeros((N,)).sync_on(a)
        slow_copy(mid, src, _delay(dev)).async_on(a)        # long write on A
        out = kernels.add(mid, mid).async_on(b)              # immediate read on B
        b.synchronize()
        fails += int(not np.array_equal(to_np(out), np.full(N, 10.0, np.float32)))
        if i == 0:
            assert b._waited.get(a.id, 0) > 0, "B must have waited on an event of A"
    assert fails == 0, f"{fails}/{ROUNDS} rounds read before the write finished"


def test_write_after_read_across_streams(dev: deviceops.Device) -> None:
    a, b = dev.new_stream(), dev.new_stream()
    fails = 0
    for _ in range(ROUNDS):
        src = api.full((N,), 3.0).sync_on(a)
        copy = api.zeros((N,)).sync_on(a)
        slow_copy(copy, src, _delay(dev)).async_on(a)        # long read of src on A
        kernels.saxpy(src, 1.0, src).async_on(b)             # overwrite src on B (src = 6)
        a.synchronize()
        b.synchronize()
        fails += int(not np.array_equal(to_np(copy), np.full(N, 3.0, np.float32)))
        fails += int(not np.array_equal(to_np(src), np.full(N, 6.0, np.float32)))
    assert fails == 0


def test_write_after_write_across_streams(dev: deviceops.Device) -> None:
    a, b = dev.new_stream(), dev.new_stream()
    seven = api.full((N,), 7.0).sync_on(a)
    one = api.ones((N,)).sync_on(a)
    fails = 0
    for _ in range(ROUNDS):
        dst = api.zeros((N,)).sync_on(a)
        slow_copy(dst, seven, _delay(dev)).async_on(a)       # slow write 7
        api.memcpy(dst, one).async_on(b)                     # later write 1 must win
        b.synchronize()
        a.synchronize()
        fails += int(not np.array_equal(to_np(dst), np.ones(N, np.float32)))
    assert fails == 0


def test_same_stream_needs_no_events(dev: deviceops.Device) -> None:
    s = dev.new_stream()
    x = api.ones((16,)).sync_on(s)
    before = s._last_event
    for _ in range(10):
        kernels.add(x, x, out=x).async_on(s)
    assert s._last_event is before, "same-stream work must not record events"
    s.synchronize()
    np.testing.assert_array_equal(to_np(x), 1024.0)


def test_memory_not_reused_while_another_stream_reads(dev: deviceops.Device) -> None:
    """A tensor dropped while another stream still reads it is parked, not reused."""
    a, b = dev.new_stream(), dev.new_stream()
    fails = 0
    for _ in range(20):
        x = api.full((N,), 9.0).sync_on(a)
        y = api.zeros((N,)).sync_on(b)
        slow_copy(y, x, 20 * _delay(dev)).async_on(b)        # B reads x for a while
        del x
        gc.collect()
        assert parked_count() >= 1
        z = api.full((N,), -1.0).async_on(a)                 # same size, same stream as x
        b.synchronize()
        a.synchronize()
        fails += int(not np.array_equal(to_np(y), np.full(N, 9.0, np.float32)))
        del z
    assert fails == 0
    api.zeros((1,)).sync()  # an allocation sweeps finished parked memory
    assert parked_count() <= 1


def test_shared_output_on_other_stream_waits(dev: deviceops.Device) -> None:
    a, b = dev.new_stream(), dev.new_stream()
    src = api.full((N,), 2.0).sync_on(a)
    dst = api.zeros((N,)).sync_on(a)
    s = slow_copy(dst, src, _delay(dev)).shared()
    s.async_on(a)
    out = s.then(lambda t: kernels.add(t, t)).async_on(b)
    b.synchronize()
    np.testing.assert_array_equal(to_np(out), 4.0)


@pytest.mark.parametrize("policy", ["round_robin", "single"])
def test_zip_results_same_under_every_policy(dev: deviceops.Device, policy: str) -> None:
    pol = (deviceops.scheduling.StreamPoolRoundRobin(dev, 4) if policy == "round_robin"
           else deviceops.scheduling.SingleStream(dev.new_stream()))
    src = api.full((N,), 1.5).sync()
    with deviceops.using(pol):
        outs = deviceops.zip(*[kernels.mul(src, src) for _ in range(6)]).then(
            lambda ts: kernels.add(ts[0], ts[5])).sync()
    np.testing.assert_array_equal(to_np(outs), 4.5)


def test_ordered_records_and_waits_exactly() -> None:
    """The hazard step itself (``extend.ordered``), on cpu streams: which events it waits on,
    what it records, and that a raising call leaves no record and no count."""
    from deviceops.extend import ordered

    dev = deviceops.device("cpu")
    a, b = dev.new_stream(), dev.new_stream()
    x = api.zeros((4,)).async_on(a)  # (not synchronized: B must wait for these writes)
    y = api.zeros((4,)).async_on(a)
    sx, sy = x._storage, y._storage
    calls: list[int] = []
    seq = ordered(b, (sx,), (sy,), calls.append, 1)  # B reads x, writes y: both written on A
    assert calls == [1] and seq == b.seq
    assert sx.reads == {b: seq} and sy.write == (b, seq) and sy.reads == {}
    assert b._waited.get(a.id, 0) == a.seq  # ordered after A's writes
    # A now writes x, which B read: write-after-read makes A wait for B
    seq_a = ordered(a, (), (sx,), calls.append, 2)
    assert a._waited.get(b.id, 0) == seq and sx.write == (a, seq_a) and sx.reads == {}

    def boom() -> None:
        raise RuntimeError("driver said no")

    before = (b.seq, dict(sy.reads), sy.write)
    with pytest.raises(RuntimeError, match="driver said no"):
        ordered(b, (sy,), (sx,), boom)
    assert (b.seq, sy.reads, sy.write) == before and sx.write == (a, seq_a)
    a.synchronize()
    b.synchronize()
