"""Engine scheduling logic on a tiny deterministic StepModel (asyncio and trio).

The toy model's next token is a hash of the whole sequence in its cache slot, so any
engine mistake (wrong slot, wrong position, a token fed twice or skipped, a slot reused
before release) changes every later token and the comparison with the sequential
reference fails. The real SmolLM2 acceptance tests are in ``test_serve_*.py``.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence

import anyio
import pytest

from deviceops.nn.runner.paged_kv import kv_bytes_per_token, max_concurrent_sequences
from deviceops.nn.serving.engine import (
    Engine,
    EngineClosed,
    EngineOverloaded,
    SamplingParams,
    StepModel,
)
from deviceops.nn.serving.slots import SlotPool

pytestmark = [pytest.mark.timeout(60)]

VOCAB = 97
EOS = 0


def _next(seq: Sequence[int], p: SamplingParams, counter: int) -> int:
    h = 1469598103934665603
    for t in seq:
        h = ((h ^ t) * 1099511628211) & 0xFFFFFFFFFFFF
    if p.temperature > 0:
        h = ((h ^ (p.seed * 31 + counter)) * 1099511628211) & 0xFFFFFFFFFFFF
    return 1 + h % (VOCAB - 1)  # never EOS unless forced


class Toy:
    """StepModel with per-slot host 'KV' that checks every position the engine sends."""

    def __init__(self, max_batch: int = 8, max_seq: int = 64, delay: float = 0.0,
                 eos_after: int | None = None) -> None:
        self._max_batch, self._max_seq, self.delay = max_batch, max_seq, delay
        self.cache: dict[int, list[int]] = {}
        self.params: dict[int, SamplingParams] = {}
        self.counter: dict[int, int] = {}
        self.decode_sizes: list[int] = []
        self.prefill_sizes: list[int] = []
        self.events: list[tuple[str, int]] = []
        self.fail_next = False
        self.eos_after = eos_after

    max_batch = property(lambda self: self._max_batch)
    max_seq = property(lambda self: self._max_seq)
    vocab_size = property(lambda self: VOCAB)
    eos_ids = property(lambda self: frozenset({EOS}))

    def encode(self, text: str) -> list[int]:
        return [1 + ord(c) % (VOCAB - 1) for c in text]

    def _sample(self, slot: int) -> int:
        seq = self.cache[slot]
        c = self.counter[slot]
        self.counter[slot] = c + 1
        if self.eos_after is not None and c + 1 >= self.eos_after:
            return EOS
        return _next(seq, self.params[slot], c)

    async def prefill(self, slot: int, ids: Sequence[int], start: int, params: SamplingParams,
                      *, last: bool) -> int | None:
        if start == 0:
            assert slot not in self.cache, f"slot {slot} reused before release"
            self.cache[slot], self.params[slot], self.counter[slot] = [], params, 0
        assert len(self.cache[slot]) == start, (slot, len(self.cache[slot]), start)
        self.cache[slot].extend(ids)
        self.prefill_sizes.append(len(ids))
        self.events.append(("prefill", len(ids)))
        await anyio.sleep(self.delay)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("toy failure")
        return self._sample(slot) if last else None

    async def decode_step(self, slots: Sequence[int], tokens: Sequence[int],
                     positions: Sequence[int]) -> list[int]:
        assert len(slots) == len(set(slots)) <= self._max_batch
        out = []
        for s, t, p in zip(slots, tokens, positions, strict=True):
            assert len(self.cache[s]) == p, (s, len(self.cache[s]), p)
            assert p < self._max_seq
            self.cache[s].append(t)
            out.append(self._sample(s))
        self.decode_sizes.append(len(slots))
        self.events.append(("decode", len(slots)))
        await anyio.sleep(self.delay)
        return out

    def release(self, slot: int) -> None:
        del self.cache[slot]

    def reference(self, prompt: list[int], n: int, p: SamplingParams | None = None,
                  stop: Sequence[int] = ()) -> list[int]:
        p = p or SamplingParams()
        seq, out = list(prompt), []
        for c in range(n):
            if len(seq) > self._max_seq:  # the last token was never fed (CausalLM.generate)
                break
            t = EOS if self.eos_after is not None and c + 1 >= self.eos_after else _next(seq, p, c)
            out.append(t)
            seq.append(t)
            if t == EOS or t in stop:
                break
        return out


def _prompt(i: int, n: int) -> list[int]:
    return [1 + (i * 13 + j * 7) % (VOCAB - 1) for j in range(n)]


def test_protocol_and_pool() -> None:
    assert isinstance(Toy(), StepModel)
    pool = SlotPool(3, 100, block_size=16)
    a, b = pool.acquire(), pool.acquire()
    assert (a, b) == (0, 1)
    assert a is not None and b is not None
    pool.set_length(a, 17)
    pool.set_length(b, 16)
    assert (pool.in_use, pool.tokens_in_use, pool.blocks_in_use) == (2, 33, 3)
    pool.release(a)
    assert pool.acquire() == 0 and pool.acquire() == 2 and pool.acquire() is None
    with pytest.raises(ValueError, match="not held"):
        pool.release(a if False else 5)
    # SmolLM2-135M fp16: 2 * 30 layers * 3 kv heads * 64 * 2 bytes
    assert kv_bytes_per_token(30, 3, 64, 2) == 23040
    assert max_concurrent_sequences(80 * 2**30, 2048, 23040) == 1820


@pytest.mark.anyio
async def test_generate_matches_reference() -> None:
    toy = Toy()
    eng = Engine(toy, max_batch=4, max_seq=64)
    with anyio.fail_after(10):
        assert await eng.generate(_prompt(1, 5), 10) == toy.reference(_prompt(1, 5), 10)
        p = SamplingParams(temperature=0.8, seed=7)
        got = await eng.generate(_prompt(2, 3), 12, temperature=0.8, seed=7)
        assert got == toy.reference(_prompt(2, 3), 12, p)
        assert got != toy.reference(_prompt(2, 3), 12)
        assert await eng.generate("hello", 4) == toy.reference(toy.encode("hello"), 4)
        batch = await eng.generate([_prompt(3, 4), _prompt(4, 9)], 6)
        assert batch == [toy.reference(_prompt(3, 4), 6), toy.reference(_prompt(4, 9), 6)]
    assert eng.stats().slots_in_use == 0 and not toy.cache


@pytest.mark.anyio
async def test_concurrent_streams_join_and_leave() -> None:
    toy = Toy(max_batch=4, delay=0.001)
    eng = Engine(toy, max_batch=4, max_seq=64, max_queue=64)
    results: dict[int, list[int]] = {}

    async def client(i: int) -> None:
        await anyio.sleep(0.002 * (i % 5))
        s = eng.stream(_prompt(i, 2 + i % 7), 3 + i % 6)
        results[i] = [t async for t in s]
        assert s.finish_reason == "length"

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for i in range(20):
                tg.start_soon(client, i)
    for i in range(20):
        assert results[i] == toy.reference(_prompt(i, 2 + i % 7), 3 + i % 6), i
    assert max(toy.decode_sizes) == 4  # the batch filled up to max_batch ...
    assert len(set(toy.decode_sizes)) > 1  # ... and changed size as requests joined/left
    st = eng.stats()
    assert (st.slots_in_use, st.queued, st.running, st.finished) == (0, 0, 0, 20)
    assert not toy.cache


@pytest.mark.anyio
async def test_long_prompt_is_chunked_between_decode_steps() -> None:
    toy = Toy(max_batch=4, max_seq=128)
    eng = Engine(toy, max_batch=4, max_seq=128, prefill_chunk=8)
    short = eng.stream(_prompt(1, 3), 30)
    got_short: list[int] = []
    with anyio.fail_after(10):
        got_short.append(await short.__anext__())
        got_short.append(await short.__anext__())
        long = eng.stream(_prompt(2, 50), 5)
        toy.events.clear()
        async with anyio.create_task_group() as tg:
            async def read_long() -> None:
                assert [t async for t in long] == toy.reference(_prompt(2, 50), 5)
            tg.start_soon(read_long)
            async for t in short:
                got_short.append(t)
    assert got_short == toy.reference(_prompt(1, 3), 30)
    assert max(toy.prefill_sizes[-7:]) <= 8 and sum(toy.prefill_sizes[-7:]) == 50
    # at most one prefill chunk between two decode steps of the running stream
    kinds = [k for k, _ in toy.events]
    assert "prefill,prefill" not in ",".join(kinds)


@pytest.mark.anyio
async def test_cancellation_frees_slots_at_once() -> None:
    toy = Toy(max_batch=4, delay=0.001)
    eng = Engine(toy, max_batch=4, max_seq=64, max_queue=64)
    done: dict[int, list[int]] = {}

    async def client(i: int) -> None:
        s = eng.stream(_prompt(i, 4), 20)
        if i % 3 == 0:  # cancel the consuming task mid-stream
            with anyio.CancelScope() as scope:
                n = 0
                async for _ in s:
                    n += 1
                    if n == 2 + i % 4:
                        scope.cancel()  # lands in the next __anext__ that waits
            assert s.finish_reason == "cancelled"
        elif i % 3 == 1:  # aclose mid-stream
            async with s:
                n = 0
                async for _ in s:
                    n += 1
                    if n == 1 + i % 5:
                        break
            assert s.finish_reason == "cancelled"
        else:
            done[i] = [t async for t in s]

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for i in range(18):
                tg.start_soon(client, i)
    for i, got in done.items():
        assert got == toy.reference(_prompt(i, 4), 20)
    st = eng.stats()
    assert (st.slots_in_use, st.running, st.queued, st.kv_tokens_in_use) == (0, 0, 0, 0)
    assert st.cancelled == 12 and st.finished == 6
    assert not toy.cache


@pytest.mark.anyio
async def test_cancel_outside_step_frees_immediately() -> None:
    toy = Toy(max_batch=2)
    eng = Engine(toy, max_batch=2, max_seq=64)
    s = eng.stream(_prompt(1, 4), 20)
    with anyio.fail_after(5):
        await s.__anext__()
    assert eng.stats().slots_in_use == 1
    await s.aclose()
    assert eng.stats().slots_in_use == 0 and not toy.cache  # no step needed


@pytest.mark.anyio
async def test_dropped_stream_is_reaped() -> None:
    toy = Toy(max_batch=2)
    eng = Engine(toy, max_batch=2, max_seq=64)
    s = eng.stream(_prompt(1, 4), 20)
    with anyio.fail_after(5):
        await s.__anext__()
    del s
    gc.collect()
    with anyio.fail_after(5):
        assert await eng.generate(_prompt(2, 3), 3) == toy.reference(_prompt(2, 3), 3)
    assert eng.stats().slots_in_use == 0 and eng.stats().cancelled == 1


@pytest.mark.anyio
async def test_queue_full_raises_or_waits() -> None:
    toy = Toy(max_batch=1, delay=0.001)
    eng = Engine(toy, max_batch=1, max_seq=64, max_queue=2)
    streams = [eng.stream(_prompt(i, 3), 4) for i in range(2)]
    with pytest.raises(EngineOverloaded, match="max_queue=2"):
        eng.stream(_prompt(9, 3), 4)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            async def late() -> None:
                assert await eng.generate(_prompt(9, 3), 4) == toy.reference(_prompt(9, 3), 4)
            tg.start_soon(late)  # waits for queue space, then runs
            for i, s in enumerate(streams):
                assert [t async for t in s] == toy.reference(_prompt(i, 3), 4)
    # a batch larger than the queue: generate drives the engine while it waits for room
    with anyio.fail_after(10):
        got = await eng.generate([_prompt(i, 3) for i in range(6)], 3)
    assert got == [toy.reference(_prompt(i, 3), 3) for i in range(6)]
    assert eng.stats().slots_in_use == 0


@pytest.mark.anyio
async def test_stop_eos_and_context_end() -> None:
    toy = Toy(max_batch=2, max_seq=16)
    eng = Engine(toy, max_batch=2, max_seq=16)
    ref = toy.reference(_prompt(1, 4), 10)
    with anyio.fail_after(5):
        s = eng.stream(_prompt(1, 4), 10, stop=[ref[3]])
        assert [t async for t in s] == ref[: ref.index(ref[3]) + 1]
        assert s.finish_reason == "stop"
        s = eng.stream(_prompt(1, 10), 50)  # 10 + 6 fed = max_seq, the 7th is not fed
        got = [t async for t in s]
        assert got == toy.reference(_prompt(1, 10), 50) and len(got) == 7
        assert s.finish_reason == "length"
        s = eng.stream(_prompt(1, 16), 50)  # a full-context prompt still gets one token
        assert [t async for t in s] == toy.reference(_prompt(1, 16), 50) and s.tokens
        assert await eng.generate(_prompt(1, 4), 0) == []
    toy2 = Toy(eos_after=3)
    eng2 = Engine(toy2, max_batch=2, max_seq=64)
    with anyio.fail_after(5):
        s = eng2.stream(_prompt(1, 4), 10)
        got = [t async for t in s]
    assert got[-1] == EOS and len(got) == 3 and s.finish_reason == "stop"


@pytest.mark.anyio
async def test_step_failure_reaches_requests_and_engine_recovers() -> None:
    toy = Toy(max_batch=2)
    eng = Engine(toy, max_batch=2, max_seq=64)
    toy.fail_next = True
    with anyio.fail_after(5):
        with pytest.raises(RuntimeError, match="toy failure"):
            await eng.generate(_prompt(1, 4), 5)
        assert eng.stats().slots_in_use == 0
        assert await eng.generate(_prompt(1, 4), 5) == toy.reference(_prompt(1, 4), 5)


@pytest.mark.anyio
async def test_close_cancels_everything() -> None:
    toy = Toy(max_batch=1)
    eng = Engine(toy, max_batch=1, max_seq=64)
    a, b = eng.stream(_prompt(1, 4), 20), eng.stream(_prompt(2, 4), 20)
    with anyio.fail_after(5):
        await a.__anext__()
    eng.close()
    assert a.finish_reason == b.finish_reason == "cancelled"
    assert eng.stats().slots_in_use == 0 and not toy.cache
    with anyio.fail_after(5):
        assert [t async for t in b] == []
    with pytest.raises(EngineClosed):
        eng.stream(_prompt(1, 4), 2)


def test_bad_arguments_raise_before_queueing() -> None:
    eng = Engine(Toy(max_batch=2, max_seq=16), max_batch=2, max_seq=16)
    cases = [
        (([], 4), {}, ValueError, "empty"),
        ((_prompt(1, 17), 4), {}, ValueError, "max_seq=16"),
        ((_prompt(1, 3), -1), {}, ValueError, "max_new_tokens"),
        ((_prompt(1, 3), 2.5), {}, TypeError, "max_new_tokens"),
        ((_prompt(1, 3), 4), {"temperature": -1.0}, ValueError, "temperature"),
        ((_prompt(1, 3), 4), {"top_p": 0.0}, ValueError, "top_p"),
        ((_prompt(1, 3), 4), {"top_k": -2}, ValueError, "top_k"),
        (([1, VOCAB], 4), {}, ValueError, "outside"),
        ((3.5, 4), {}, TypeError, "prompt"),
    ]
    for args, kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            eng.stream(*args, **kw)  # type: ignore[arg-type]
    assert eng.stats().queued == 0
    small = Engine(Toy(max_batch=2, max_seq=16))  # defaults 32 x 2048, lowered to the cache
    assert (small.max_batch, small.max_seq) == (2, 16)
