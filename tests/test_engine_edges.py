"""Engine edge paths that mutants of ``nn/_engine_step.py`` survived (tests/MUTATION.md): a
dropped stream still queued, a reservation that can never fit, one request's prefill
failing (or refused) beside others in the same step, the pool's per-chunk lengths and the
generated-token counter. On the toy StepModel of ``test_engine.py`` (asyncio and trio).
"""

from __future__ import annotations

import gc
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import pytest

from deviceops.nn.serving.engine import Engine, SamplingParams

from .test_engine import Toy, _prompt

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

BAD = 96  # a prompt starting with this token fails in the toys below


class FailingPrefill(Toy):
    """Prefill of a prompt that starts with ``BAD`` raises (after its KV was written)."""

    async def prefill(self, slot: int, ids: Sequence[int], start: int, params: SamplingParams,
                      *, last: bool) -> int | None:
        out = await super().prefill(slot, ids, start, params, last=last)
        if start == 0 and ids and ids[0] == BAD:
            raise RuntimeError("bad prompt")
        return out


class RefusingPrefill(Toy):
    """``submit_prefill`` refuses a prompt that starts with ``BAD`` before enqueueing it."""

    def submit_prefill(self, slot: int, ids: Sequence[int], start: int, params: SamplingParams,
                       *, last: bool) -> Callable[[], Awaitable[Any]]:
        if start == 0 and ids and ids[0] == BAD:
            raise ValueError("refused prompt")
        return lambda: self.prefill(slot, ids, start, params, last=last)

    def release(self, slot: int) -> None:
        self.cache.pop(slot, None)  # a refused prompt never reached the cache


async def test_dropped_queued_stream_is_reaped_at_admission() -> None:
    toy = Toy(max_batch=1)
    eng = Engine(toy, max_batch=1, max_seq=64)
    first = eng.stream(_prompt(1, 3), 4)
    dropped = eng.stream(_prompt(2, 3), 4)  # queued behind the only slot
    later = eng.stream(_prompt(3, 3), 4)
    del dropped
    gc.collect()  # marked cancelled, still in the queue: admission reaps it
    with anyio.fail_after(10):
        assert [t async for t in first] == toy.reference(_prompt(1, 3), 4)
        assert [t async for t in later] == toy.reference(_prompt(3, 3), 4)
    st = eng.stats()
    assert (st.cancelled, st.finished, st.queued, st.slots_in_use) == (1, 2, 0, 0)
    assert toy.prefill_sizes == [3, 3]  # the dropped prompt was never prefilled


async def test_reservation_that_can_never_fit_ends_the_request() -> None:
    class NoBlocks(Toy):
        def reserve(self, slot: int, n_tokens: int) -> bool:
            return False  # blocks held outside the engine: nothing will free any

    eng = Engine(NoBlocks(max_batch=2), max_batch=2, max_seq=64)
    with anyio.fail_after(10), pytest.raises(RuntimeError, match="needs KV blocks for 7 positions"):
        await eng.generate(_prompt(1, 3), 4)
    st = eng.stats()
    assert (st.queued, st.running, st.slots_in_use, st.finished) == (0, 0, 0, 1)


@pytest.mark.parametrize("toy_cls", [FailingPrefill, RefusingPrefill])
async def test_one_prefill_failing_ends_only_that_request(toy_cls: type[Toy]) -> None:
    toy = toy_cls(max_batch=4)
    eng = Engine(toy, max_batch=4, max_seq=64)
    running = eng.stream(_prompt(1, 4), 8)
    with anyio.fail_after(10):
        got = [await running.__anext__()]  # decoding from now on
        bad = eng.stream([BAD, *_prompt(2, 3)], 5)  # prefilled in one step with `good`
        good = eng.stream(_prompt(3, 5), 5)
        with pytest.raises((RuntimeError, ValueError), match=r"bad prompt|refused prompt"):
            await bad.__anext__()
        assert [t async for t in good] == toy.reference(_prompt(3, 5), 5)
        got += [t async for t in running]
    assert got == toy.reference(_prompt(1, 4), 8)
    assert bad.finish_reason == "error" and eng.stats().slots_in_use == 0


async def test_pool_length_recorded_after_each_prefill_chunk() -> None:
    toy = Toy(max_batch=2, max_seq=64)
    seen: list[int] = []
    inner = toy.prefill

    async def prefill(slot: int, ids: Sequence[int], start: int, params: SamplingParams,
                      *, last: bool) -> int | None:
        seen.append(eng.stats().kv_tokens_in_use)  # what the earlier chunks recorded
        return await inner(slot, ids, start, params, last=last)

    toy.prefill = prefill  # type: ignore[method-assign]
    eng = Engine(toy, max_batch=2, max_seq=64, prefill_chunk=8)
    with anyio.fail_after(10):
        got = await eng.generate(_prompt(1, 20), 3)  # slot 0, chunks of 8, 8, 4
    assert got == toy.reference(_prompt(1, 20), 3)
    assert seen == [0, 8, 16]
    st = eng.stats()
    assert (st.generated_tokens, st.prefill_tokens, st.finished) == (3, 20, 1)


async def test_engine_arguments_defaults_and_ids() -> None:
    for kw in ({"max_batch": 0}, {"max_seq": 1}, {"prefill_chunk": 0}):
        with pytest.raises(ValueError, match="must be positive"):
            Engine(Toy(), **kw)
    toy = Toy(max_batch=2, max_seq=64)
    eng = Engine(toy, max_batch=2, max_seq=64)
    a, b = eng.stream(_prompt(1, 3)), eng.stream(_prompt(2, 3))
    assert (a.id, b.id) == (1, 2)  # engine-wide ids from 1
    with anyio.fail_after(10):
        got = [t async for t in a]  # max_new_tokens defaults to 32, as CausalLM.generate
        assert got == toy.reference(_prompt(1, 3), 32) and len(got) == 32
        assert await eng.generate(_prompt(3, 3)) == toy.reference(_prompt(3, 3), 32)
    b.cancel()


async def test_request_needing_more_blocks_than_the_pool_is_refused() -> None:
    class Paged(Toy):
        kv_blocks_total = 5
        kv_block_size = 4

        def reserve(self, slot: int, n_tokens: int) -> bool:
            return -(-n_tokens // 4) <= 5

    eng = Engine(Paged(max_batch=2, max_seq=64), max_batch=2, max_seq=64)
    with pytest.raises(ValueError, match="more KV blocks than the pool's 5 of 4 positions"):
        eng.stream(_prompt(1, 3), 18)  # 21 positions: 6 blocks
    with anyio.fail_after(10):
        assert len(await eng.generate(_prompt(1, 3), 17)) == 17  # 20 positions: 5 blocks fit


async def test_submit_defaults_and_prompt_ids_below_zero() -> None:
    toy = Toy(max_batch=2, max_seq=64)
    eng = Engine(toy, max_batch=2, max_seq=64)
    with pytest.raises(ValueError, match=r"prompt token ids \[-1\] outside"):
        eng.stream([3, -1], 2)
    with anyio.fail_after(10):
        s = await eng.submit(_prompt(1, 3))  # max_new_tokens defaults to 32
        assert [t async for t in s] == toy.reference(_prompt(1, 3), 32)
