"""Small documented contracts that mutants survived (``tools/mutation.py``, tests/MUTATION.md):
argument validation, defaults a caller relies on, the one-device and one-stream edges.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

import deviceops
from deviceops import api
from deviceops.nn.runner.paged_kv import max_concurrent_sequences
from deviceops.nn.serving.engine import Engine, EngineStats
from deviceops.nn.serving.slots import SlotPool
from deviceops.scheduling import MultiDeviceRoundRobin, StreamPoolRoundRobin

from .conftest import to_np
from .test_engine import Toy, _prompt


def test_slot_pool_defaults_and_validation() -> None:
    pool = SlotPool(4, 2048)  # the docstring's example: blocks of 16 positions by default
    s = pool.acquire()
    assert s == 0
    pool.set_length(s, 100)
    assert (pool.block_size, pool.blocks_in_use, pool.tokens_in_use) == (16, 7, 100)
    pool.set_length(s, 2048)  # the whole row is a valid length ...
    with pytest.raises(ValueError, match=r"length 2049 outside \[0, 2048\]"):
        pool.set_length(s, 2049)  # ... one more is not
    with pytest.raises(ValueError, match="length -1"):
        pool.set_length(s, -1)
    with pytest.raises(ValueError, match="slot 3 is not held"):
        pool.set_length(3, 1)
    pool.release(s)
    assert (pool.in_use, pool.free) == (0, 4)
    a, _, c = pool.acquire(), pool.acquire(), pool.acquire()
    pool.release(a)
    pool.release(c)
    assert (pool.acquire(), pool.acquire(), pool.acquire()) == (a, c, 3)  # lowest first
    for kw, name in (({"n_slots": 0, "max_seq": 8}, "n_slots"),
                     ({"n_slots": 2, "max_seq": 0}, "max_seq"),
                     ({"n_slots": 2, "max_seq": 8, "block_size": 0}, "block_size")):
        with pytest.raises(ValueError, match=f"{name} must be positive, got 0"):
            SlotPool(**kw)
    assert SlotPool(1, 1, block_size=1).free == 1  # the smallest sizes are fine
    with pytest.raises(ValueError, match="positive"):
        max_concurrent_sequences(10**9, 0, 100)
    assert max_concurrent_sequences(1000, 10, 10) == 10


def test_engine_stats_defaults_and_pending_tokens() -> None:
    st = EngineStats(queued=0, running=0, slots_in_use=0, kv_tokens_in_use=0, kv_blocks_in_use=0,
                     max_batch=1, steps=0, decode_rows=0, prefill_tokens=0, generated_tokens=0,
                     finished=0, cancelled=0)
    assert (st.kv_blocks_total, st.pending_tokens) == (0, 0)
    eng = Engine(Toy(max_batch=2), max_batch=2, max_seq=64)
    assert eng.stats().pending_tokens == 0 and eng.stats().kv_blocks_total == 0
    held = [eng.stream(_prompt(1, 5), 7), eng.stream(_prompt(2, 3), 4)]  # queued, not run
    assert eng.pending_tokens == (5 + 7) + (3 + 4) == eng.stats().pending_tokens
    held[0].cancel()
    assert eng.pending_tokens == 3 + 4


def test_stream_pool_of_one_stream() -> None:
    dev = deviceops.device("cpu")
    pool = StreamPoolRoundRobin(dev, num_streams=1)
    assert len(pool.streams) == 1 and pool.next_stream() is pool.next_stream() is pool.streams[0]
    with deviceops.using(pool):
        a, b = deviceops.zip(api.full((2,), 1.0), api.full((2,), 2.0)).sync()
    assert float(to_np(a)[0]) + float(to_np(b)[0]) == 3.0


def test_multi_device_policy_defaults() -> None:
    d0, d1 = deviceops.device("cpu:0"), deviceops.device("cpu:1")
    pol = MultiDeviceRoundRobin([d0, d1], streams_per_device=1)
    assert pol.device is d0 and pol.devices == (d0, d1)
    assert [s.device for s in pol.streams] == [d0, d1]
    if deviceops.cuda_available():
        return
    only = MultiDeviceRoundRobin()  # no GPU: the cpu device
    assert only.devices == (deviceops.device("cpu"),) and only.device is deviceops.device("cpu")


def test_kv_cache_geometry() -> None:
    from deviceops.nn.runner.paged_kv import BlockAllocator, KVCache

    s = deviceops.device("cpu").new_stream()
    c = KVCache.allocate(s, layers=3, num_blocks=5, kv_heads=2, block_size=4, head_dim=8,
                         dtype="float16")
    assert (c.num_blocks, c.block_size) == (5, 4)
    assert c.nbytes == 2 * 3 * 5 * 2 * 4 * 8 * 2
    assert c.bytes_per_block == 2 * 3 * 2 * 4 * 8 * 2
    k1, v1 = c.layer(1)
    assert k1 is c.k[1] and v1 is c.v[1] and k1 is not v1
    one = KVCache.allocate(s, layers=1, num_blocks=3, kv_heads=5, block_size=2, head_dim=4,
                           dtype="float32")
    assert (one.num_blocks, one.block_size, one.bytes_per_block) == (3, 2, 2 * 5 * 2 * 4 * 4)
    a = BlockAllocator(9, 16)  # the docstring's example: block 0 reserved, lowest first
    ids = a.acquire(3)
    assert ids == [1, 2, 3] and (a.free, a.in_use, a.capacity) == (5, 3, 8)
    assert a.blocks_for(0) == 0 and a.blocks_for(16) == 1 and a.blocks_for(17) == 2
    assert a.acquire(6) is None and a.free == 5  # too few: nothing taken
    with pytest.raises(ValueError, match="not held"):
        a.release([4])
    with pytest.raises(ValueError, match="not held"):
        a.release([1, 1])
    a.release([3, 1])
    assert a.acquire(2) == [1, 3]
    with pytest.raises(ValueError, match="n=-1"):
        a.acquire(-1)
    assert a.acquire(0) == [] and a.in_use == 3
    for bad in ({"num_blocks": 1, "block_size": 4}, {"num_blocks": 4, "block_size": 0},
                {"num_blocks": 4, "block_size": 2, "reserved": -1}):
        with pytest.raises(ValueError, match="BlockAllocator"):
            BlockAllocator(**bad)
    assert BlockAllocator(2, 1).capacity == 1 and BlockAllocator(3, 2, reserved=0).capacity == 3


class _DecodeFails(Toy):
    fail_decode = False

    async def decode_step(self, slots: Sequence[int], tokens: Sequence[int],
                          positions: Sequence[int]) -> list[int]:
        out = await super().decode_step(slots, tokens, positions)
        if self.fail_decode:
            raise RuntimeError("decode failed")
        return out


@pytest.mark.anyio
async def test_cancel_during_a_failing_step_reports_the_error() -> None:
    """A request cancelled while the step it is in fails ends with the step's error (its
    finish_reason says ``"error"``, not ``"cancelled"``): the caller learns the step failed."""
    import anyio

    toy = _DecodeFails(max_batch=2, delay=0.05)
    eng = Engine(toy, max_batch=2, max_seq=64)
    s1 = eng.stream(_prompt(1, 4), 20)
    with anyio.fail_after(10):
        await s1.__anext__()  # s1 decodes from now on
        toy.fail_decode = True
        async with anyio.create_task_group() as tg:
            async def drive() -> None:
                with pytest.raises(RuntimeError, match="decode failed"):
                    await s1.__anext__()
            tg.start_soon(drive)
            await anyio.sleep(0.02)  # inside the step (the toy sleeps 0.05 s in it)
            assert eng.scheduler.stepping
            s1.cancel()
    assert s1.finish_reason == "error"
    assert eng.stats().slots_in_use == 0


def test_placement_walks_past_shared_and_pinned_ops() -> None:
    """The placement walk sees every input: an op reached twice (shared) or a pinned op
    (``api.to_device``) met first does not end the walk before a tensor of another device."""
    from deviceops import kernels
    from deviceops._placement import placement

    d0, d1 = deviceops.device("cpu:0"), deviceops.device("cpu:1")
    x0 = api.full((4,), 1.0).sync_on(d0.new_stream())
    x1 = api.full((4,), 2.0).sync_on(d1.new_stream())
    sh = kernels.add(x0, x0).shared()
    twice = kernels.add(kernels.add(x1, x1), kernels.add(sh, sh))  # sh met again first
    pinned = kernels.add(kernels.add(x1, x1), api.to_device(x0, d0))  # to_device met first
    for root in (twice, pinned):
        with pytest.raises(deviceops.DeviceError, match="two devices"):
            placement(root)
        root._consume()
    ok = kernels.add(kernels.add(x0, x0), api.to_device(x1, d0))
    assert placement(ok) is d0
    ok._consume()


def test_sampling_params_and_stats_are_frozen_values() -> None:
    """``SamplingParams()`` is greedy with every filter off (the documented defaults), and
    both records are immutable values (hashable, compared by value)."""
    import dataclasses

    from deviceops.nn.serving.engine import SamplingParams

    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.seed) == (0.0, 0, 1.0, 0)
    assert p == SamplingParams(0.0, 0, 1.0, 0) and len({p, SamplingParams()}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.top_k = 3  # type: ignore[misc]
    st = Engine(Toy(max_batch=2), max_batch=2, max_seq=64).stats()
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.queued = 1  # type: ignore[misc]
    assert hash(st) == hash(dataclasses.replace(st))


def test_pool_records_and_edges() -> None:
    import dataclasses

    pool = SlotPool(2, 8, block_size=4)
    s = pool.acquire()
    assert s is not None and pool.tokens_in_use == 0 and pool.blocks_in_use == 0
    pool.set_length(s, 0)  # an empty row is a valid length
    u = pool.usage()
    assert (u.slots_in_use, u.tokens_in_use, u.blocks_in_use) == (1, 0, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        u.slots_in_use = 2  # type: ignore[misc]
    assert max_concurrent_sequences(100, 1, 10) == 10  # the smallest sizes are valid
    assert max_concurrent_sequences(100, 10, 1) == 10
    for seq_len, per_token in ((0, 10), (10, 0), (-1, 10), (10, -1)):
        with pytest.raises(ValueError, match="positive"):
            max_concurrent_sequences(100, seq_len, per_token)


def test_block_release_error_names_the_blocks() -> None:
    from deviceops.nn.runner.paged_kv import BlockAllocator

    a = BlockAllocator(5, 2)
    a.acquire(2)
    with pytest.raises(ValueError, match=r"blocks \[1, 1\] are not held"):
        a.release([1, 1])  # held, but twice
    with pytest.raises(ValueError, match=r"blocks \[4\] are not held"):
        a.release([4, 1])


def test_scheduling_policy_default_sizes() -> None:
    assert len(StreamPoolRoundRobin(deviceops.device("cpu")).streams) == 4
    pol = MultiDeviceRoundRobin(["cpu:0", "cpu:1"])
    assert len(pol.streams) == 4 and [str(s.device) for s in pol.streams] == [
        "cpu", "cpu:1", "cpu", "cpu:1"]  # two a device, interleaved


def _kv_writers() -> dict[str, object]:
    from deviceops.kernels.transformer._reference import rope_kv_write_reference

    out: dict[str, object] = {"reference": rope_kv_write_reference}
    try:
        from deviceops.kernels.transformer._cpu import rope_kv_write_cpu
    except ImportError:
        return out
    out["cpu"] = rope_kv_write_cpu
    return out


@pytest.mark.parametrize("writer", sorted(_kv_writers()))
def test_kv_write_skips_positions_outside_the_cache(writer: str) -> None:
    """``rope_kv_write``'s host paths (the float64 reference and the cpu float32 path) write
    K/V at ``start + i`` and skip, as the CUDA kernel does, positions before 0 or past the
    cache and block-table entries outside the pool; RoPE matches an independent formula."""
    import numpy as np

    from . import nn_tiny

    fn: Any = _kv_writers()[writer]
    rng = np.random.default_rng(3)
    hq, hkv, d, length = 2, 1, 4, 3
    qkv = rng.standard_normal((2, length, (hq + 2 * hkv) * d)).astype(np.float32)
    heads = qkv.reshape(2, length, hq + 2 * hkv, d).astype(np.float64)
    start = np.array([-1, 4], np.int64)  # row 0: positions -1, 0, 1; row 1: 4, 5, 6
    # contiguous caches of 6 positions: row 1's position 6 is past the end
    k, v = np.zeros((2, hkv, 6, d), np.float32), np.zeros((2, hkv, 6, d), np.float32)
    q = np.zeros((2, hq, length, d), np.float32)
    fn(qkv, start, k, v, q, hq, hkv, 10000.0)
    for b, pos in ((0, [-1, 0, 1]), (1, [4, 5, 6])):
        p = np.asarray(pos, np.float64)
        want_q = nn_tiny._rope(heads[b, :, :hq], p, 10000.0)  # (L, Hq, D)
        np.testing.assert_allclose(q[b].transpose(1, 0, 2), want_q, rtol=1e-5, atol=1e-6)
        want_k = nn_tiny._rope(heads[b, :, hq:hq + hkv], p, 10000.0)
        for i, pi in enumerate(pos):
            if 0 <= pi < 6:
                np.testing.assert_allclose(k[b, :, pi], want_k[i], rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(v[b, :, pi], heads[b, i, hq + hkv:], rtol=1e-6)
    assert not k[0, :, 2:].any() and not k[1, :, :4].any()  # nothing else written
    assert not v[0, :, 2:].any() and not v[1, :, :4].any()
    # paged: blocks of 2; row 0 maps block 1 to an id outside the pool, row 1 past its table
    kp, vp = np.zeros((4, hkv, 2, d), np.float32), np.zeros((4, hkv, 2, d), np.float32)
    table = np.array([[1, 7], [2, 3]], np.int32)  # 2 blocks a row: positions 0..3
    fn(qkv, np.array([0, 2], np.int64), kp, vp, q, hq, hkv, 10000.0, table)
    assert vp[1].any() and not vp[0].any()  # row 0 positions 0, 1 in block 1; 2 dropped
    np.testing.assert_allclose(vp[1, :, 0], heads[0, 0, hq + hkv:], rtol=1e-6)
    np.testing.assert_allclose(vp[3, :, 1], heads[1, 1, hq + hkv:], rtol=1e-6)  # row 1 pos 3
    np.testing.assert_allclose(vp[3, :, 0], heads[1, 0, hq + hkv:], rtol=1e-6)  # pos 2
    assert not vp[2].any()  # row 1's block 0 (positions 0, 1) is not written; pos 4 dropped
    # paged, a position before 0 (row 0) and a block id of -1 (row 1): both skipped
    kp[...], vp[...] = 0, 0
    table = np.array([[1, 2], [-1, 3]], np.int32)
    fn(qkv, np.array([-1, 0], np.int64), kp, vp, q, hq, hkv, 10000.0, table)
    np.testing.assert_allclose(vp[1, :, 0], heads[0, 1, hq + hkv:], rtol=1e-6)  # row 0 pos 0
    np.testing.assert_allclose(vp[1, :, 1], heads[0, 2, hq + hkv:], rtol=1e-6)  # pos 1
    np.testing.assert_allclose(vp[3, :, 0], heads[1, 2, hq + hkv:], rtol=1e-6)  # row 1 pos 2
    assert not vp[0].any() and not vp[2].any() and not vp[3, :, 1].any()
    assert not kp[0].any() and not kp[2].any()


def test_rope_host_paths_match_an_independent_formula() -> None:
    import numpy as np

    from deviceops.kernels.transformer._reference import rope_reference

    from . import nn_tiny

    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 2, 8)).astype(np.float32)  # (B, L, H, D)
    start = np.array([0, 5], np.int64)
    fns: dict[str, Any] = {"reference": lambda a, s, th: rope_reference(a, s, th)}
    try:
        from deviceops.kernels.transformer._cpu import rope_cpu
    except ImportError:
        pass
    else:
        def fast(a: Any, s: Any, th: float) -> Any:
            out = np.empty_like(a)
            rope_cpu(a, s, th, out)
            return out

        fns["cpu"] = fast
    for name, fn in fns.items():
        got = fn(x, start, 500.0)
        for b in range(2):
            pos = start[b] + np.arange(3, dtype=np.float64)
            want = nn_tiny._rope(x[b].astype(np.float64), pos, 500.0)
            np.testing.assert_allclose(got[b], want, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.anyio
async def test_cancel_in_a_step_frees_the_slot_when_the_step_ends() -> None:
    import anyio

    toy = Toy(max_batch=2, delay=0.05)
    eng = Engine(toy, max_batch=2, max_seq=64)
    s1, s2 = eng.stream(_prompt(1, 4), 20), eng.stream(_prompt(2, 4), 20)
    with anyio.fail_after(10):
        await s1.__anext__()
        await s2.__anext__()
        got: list[int] = []
        async with anyio.create_task_group() as tg:
            async def drive() -> None:
                got.append(await s2.__anext__())  # one decode step of both rows
            tg.start_soon(drive)
            await anyio.sleep(0.02)
            assert eng.scheduler.stepping
            s1.cancel()  # inside the step: the slot goes when the step ends
        assert got and s1.finish_reason == "cancelled"
        assert eng.stats().slots_in_use == 1 and len(toy.cache) == 1  # no further step ran
    await s2.aclose()


@pytest.mark.anyio
async def test_dropped_stream_is_reaped_before_the_next_step_decodes() -> None:
    import gc

    import anyio

    toy = Toy(max_batch=2)
    eng = Engine(toy, max_batch=2, max_seq=64)
    s = eng.stream(_prompt(1, 4), 20)
    with anyio.fail_after(5):
        await s.__anext__()
    del s
    gc.collect()  # marks the request cancelled; the next step reaps it before decoding
    toy.events.clear()
    with anyio.fail_after(5):
        assert await eng.generate(_prompt(2, 3), 3) == toy.reference(_prompt(2, 3), 3)
    assert toy.events[0] == ("prefill", 3), toy.events  # no decode step for the dropped row
    assert eng.stats().cancelled == 1 and eng.stats().slots_in_use == 0


def test_copies_refuse_bad_arguments_and_other_devices() -> None:
    import numpy as np

    d0, d1 = deviceops.device("cpu:0"), deviceops.device("cpu:1")
    s0, s1 = d0.new_stream(), d1.new_stream()
    with pytest.raises(TypeError, match="cannot make a NumPy array"):
        api.from_host([[1.0, 2.0], [3.0]])  # ragged
    with pytest.raises(deviceops.DTypeError, match="not numbers"):
        api.from_host(["a", "b"])
    t = api.from_host(np.array(["1", "2"]), dtype="float32").sync_on(s0)  # dtype= converts
    np.testing.assert_array_equal(to_np(t), [1.0, 2.0])
    with pytest.raises(TypeError, match="device must be a Device"):
        api.to_device(t, True)  # type: ignore[arg-type]
    x1 = api.full((4,), 1.0).sync_on(s1)
    x0 = api.zeros((4,)).sync_on(s0)
    with pytest.raises(deviceops.DeviceError, match=r"dup: .* is on cpu:1 .*api.to_device"):
        api.dup(x1).sync_on(s0)
    with pytest.raises(deviceops.DeviceError, match=r"memcpy: .* is on cpu:1"):
        api.memcpy(x0, x1).sync_on(s0)  # the source on another device
    with pytest.raises(deviceops.DeviceError, match=r"memcpy: .* is on cpu:1"):
        api.memcpy(x1, x0).sync_on(s0)  # the destination on another device
    with pytest.raises(deviceops.ShapeError, match=r"memcpy: dst shape \(4,\) != src shape \(5,\)"):
        api.memcpy(x0, api.zeros((5,))).sync_on(s0)  # a DeviceOp source: checked when it runs
    np.testing.assert_array_equal(to_np(x0), 0.0)


def test_from_host_snapshots_at_enqueue() -> None:
    """The host data is copied when the op is enqueued: a change made after that, while the
    stream has not reached the upload yet (held by a gate), does not leak in."""
    import threading

    import numpy as np

    from deviceops.graphs import host_task

    s = deviceops.device("cpu").new_stream()
    host = np.arange(4, dtype=np.float32)
    gate = threading.Event()
    host_task(lambda: gate.wait(30), "gate").async_on(s)
    try:
        t = api.from_host(host).async_on(s)
        host[:] = -1.0
    finally:
        gate.set()
    np.testing.assert_array_equal(to_np(t), [0.0, 1.0, 2.0, 3.0])


def test_attention_reference_clamps_lengths_and_checks_blocks() -> None:
    """``kv_len`` is clamped to ``[0, Lk]`` (a row with no valid key gives zeros), a block id
    outside the pool raises ``IndexError``, and malformed shapes raise ``ShapeError``."""
    import numpy as np

    from deviceops.kernels.attention._reference import attention_reference

    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 2, 1, 4))
    k, v = rng.standard_normal((2, 1, 6, 4)), rng.standard_normal((2, 1, 6, 4))
    out = attention_reference(q, k, v, kv_len=np.array([-3, 9]))
    assert not out[0].any()  # nothing valid: zeros
    np.testing.assert_allclose(out[1], attention_reference(q[1:], k[1:], v[1:])[0])
    pool_k = rng.standard_normal((3, 1, 2, 4))  # 3 blocks of 2 positions
    pool_v = rng.standard_normal((3, 1, 2, 4))
    table = np.array([[1, 2, 0], [2, 1, 0]], np.int32)
    paged = attention_reference(q, pool_k, pool_v, kv_len=np.array([-1, 4]), block_table=table)
    assert not paged[0].any()
    dense_k = np.concatenate([pool_k[2], pool_k[1]], axis=1)[None]  # row 1: blocks 2, 1
    dense_v = np.concatenate([pool_v[2], pool_v[1]], axis=1)[None]
    np.testing.assert_allclose(paged[1], attention_reference(q[1:], dense_k, dense_v)[0])
    for bad in (-1, 3):
        with pytest.raises(IndexError, match=f"holds block {bad}, outside the pool of 3"):
            attention_reference(q, pool_k, pool_v, kv_len=np.array([3, 1]),
                                block_table=np.array([[1, bad, 0], [1, 0, 0]], np.int32))
    with pytest.raises(deviceops.ShapeError, match="4-D"):
        attention_reference(q, k[0], v)  # k 3-D
    with pytest.raises(deviceops.ShapeError, match="4-D"):
        attention_reference(q, k, v[0])  # v 3-D
    with pytest.raises(deviceops.ShapeError):
        attention_reference(q, k, v[:, :, :5])  # k and v differ


def test_memcpy_is_placed_on_its_destination_and_to_host_checks_the_device() -> None:
    import numpy as np

    d0, d1 = deviceops.device("cpu:0"), deviceops.device("cpu:1")
    x1 = api.zeros((3,)).sync_on(d1.new_stream())
    with deviceops.using(MultiDeviceRoundRobin([d0, d1], streams_per_device=1)):
        for v in (1.0, 2.0, 3.0):  # an input-less source: the destination places the copy
            api.memcpy(x1, api.full((3,), v)).sync()
            np.testing.assert_array_equal(to_np(x1), v)
    with pytest.raises(deviceops.DeviceError, match=r"to_host: .* is on cpu:1"):
        api.to_host(x1).sync_on(d0.new_stream())


def test_readme_environment_table_is_the_knob_table() -> None:
    """The README's "Environment" table is ``deviceops._env.describe()`` verbatim, and every
    ``DEVICEOPS_*`` name the product's code mentions is a listed knob."""
    import re
    from pathlib import Path

    from deviceops import _env

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    m = re.search(r"<!-- env-table -->\n(.*?)\n<!-- /env-table -->", readme, re.S)
    assert m, "README.md has no <!-- env-table --> block"
    assert m.group(1) == _env.describe(), "README's Environment table differs from deviceops/_env.py"
    listed = {k.name for k in _env.KNOBS}
    used: set[str] = set()
    for folder in ("deviceops", "scheduling", "graphs", "kernels", "nn", "benchmarks", "tools",
                   "scripts", "tests"):
        for path in (root / folder).rglob("*"):
            if path.suffix in (".py", ".sh") and "__pycache__" not in path.parts:
                used |= set(re.findall(r"DEVICEOPS_[A-Z0-9_]+", path.read_text()))
    assert used - listed == set(), f"knobs not in deviceops/_env.py: {sorted(used - listed)}"
    with pytest.raises(KeyError, match="not a deviceops environment knob"):
        _env.get("DEVICEOPS_" + "NO_SUCH_KNOB")  # (split: the scan above must not see it)
