"""The engine's lookahead (:mod:`deviceops.nn.serving.scheduler`): each step is enqueued
before the previous step's tokens are read, rows feeding the tokens still on the device.

Checked on the cpu backend with an untied random model (so a wrong position, a wrong fed
token or a stale KV entry changes the output): many concurrent requests with different
prompt lengths, budgets, stop ids, sampling and log-probabilities give exactly what the same
engine gives with ``lookahead=False``, requests joining and leaving at every step; cancelled
and stopped requests drop their in-flight token; every KV block comes back; the option's
refusal for a step model that cannot feed device-held tokens.
"""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest

from deviceops import nn
from deviceops.nn import Engine

CFG = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
           num_kv_heads=2, head_dim=16, rope_theta=1e4, tie_word_embeddings=False)


def _model() -> Any:
    return nn.random_model(nn.LlamaConfig(**CFG), dtype="float32", device="cpu", seed=4,
                           max_batch=4, max_seq=48, kv_block_size=8, kv_blocks=40)


def _jobs() -> list[dict[str, Any]]:
    rng = np.random.default_rng(3)
    jobs = []
    for i in range(10):
        n = int(rng.integers(2, 30))
        jobs.append(dict(prompt=rng.integers(3, 96, n).tolist(), max_new_tokens=int(rng.integers(1, 14)),
                         temperature=0.0 if i % 2 else 1.0, seed=100 + i,
                         stop=[int(rng.integers(3, 96))] if i % 3 == 0 else None,
                         logprobs=2 if i == 4 else None))
    jobs[7]["max_new_tokens"] = 40  # runs into max_seq
    return jobs


def _run(lookahead: bool, backend: str, cancel_at: dict[int, int] | None = None
         ) -> tuple[dict[int, list[int]], dict[int, Any], Engine]:
    m = _model()
    eng = Engine(m, max_batch=4, max_seq=48, prefill_chunk=16, lookahead=lookahead)
    got: dict[int, list[int]] = {}
    lps: dict[int, Any] = {}

    async def one(i: int, job: dict[str, Any]) -> None:
        await anyio.sleep(0.002 * i)  # arrivals spread over the steps
        toks: list[int] = []
        s = eng.stream(**job)
        async with s:
            async for t in s:
                toks.append(t)
                if cancel_at and cancel_at.get(i) == len(toks):
                    s.cancel()
                    break
        got[i] = toks
        if job.get("logprobs"):
            lps[i] = [(lp.token, round(lp.logprob, 4)) for lp in s.logprobs]

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for i, job in enumerate(_jobs()):
                tg.start_soon(one, i, job)

    anyio.run(main, backend=backend)
    return got, lps, eng


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_lookahead_gives_what_stepping_in_turn_gives(backend: str) -> None:
    ahead, lp_a, eng = _run(True, backend)
    assert eng.scheduler.lookahead
    plain, lp_p, eng_p = _run(False, backend)
    assert not eng_p.scheduler.lookahead
    assert ahead == plain
    assert lp_a == lp_p and lp_a  # the log-probabilities ride along with their tokens
    jobs = _jobs()
    assert all(len(ahead[i]) <= j["max_new_tokens"] for i, j in enumerate(jobs))
    # ended by max_seq: the last token is sampled at position max_seq - 1, never fed
    assert len(ahead[7]) == 48 - len(jobs[7]["prompt"]) + 1
    for e in (eng, eng_p):
        st = e.stats()
        assert (st.kv_blocks_in_use, st.running, st.queued) == (0, 0, 0)


def test_lookahead_drops_the_token_in_flight_of_a_cancelled_request() -> None:
    ahead, _, eng = _run(True, "asyncio", cancel_at={1: 2, 5: 1})
    plain, _, _ = _run(False, "asyncio", cancel_at={1: 2, 5: 1})
    assert ahead == plain
    assert len(ahead[1]) == 2 and len(ahead[5]) == 1
    assert eng.stats().kv_blocks_in_use == 0


def test_lookahead_refused_for_a_step_model_that_cannot_feed_device_tokens() -> None:
    class Steps:  # the StepModel protocol without device_fed
        max_batch, max_seq, vocab_size, eos_ids = 2, 16, 10, frozenset()

        def encode(self, text: str) -> list[int]:
            return [1]

        async def prefill(self, slot: int, ids: Any, start: int, params: Any, *,
                          last: bool) -> int | None:
            return 1 if last else None

        async def decode_step(self, slots: Any, tokens: Any, positions: Any) -> list[int]:
            return [1] * len(slots)

        def release(self, slot: int) -> None:
            pass

    with pytest.raises(ValueError, match="lookahead needs a step model"):
        Engine(Steps(), max_batch=2, max_seq=16, lookahead=True)
    eng = Engine(Steps(), max_batch=2, max_seq=16)
    assert not eng.scheduler.lookahead
    assert anyio.run(eng.generate, [1, 2], 3) == [1, 1, 1]


@pytest.mark.parametrize("lookahead", [True, False])
def test_each_step_spends_the_whole_prefill_budget_and_counts_what_is_written(
        lookahead: bool) -> None:
    """Driven step by step: a 15-token and a 5-token prompt with a 16-token chunk budget
    take 16 tokens in the first step (the second prompt's first token too) and the rest in
    the second; ``kv_tokens_in_use`` follows the chunks as they complete (with lookahead,
    a completed chunk counts its row's positions enqueued so far)."""
    m = _model()
    eng = Engine(m, max_batch=4, max_seq=48, prefill_chunk=16, lookahead=lookahead,
                 prefix_cache=False)
    a = eng.stream(list(range(3, 18)), 4)
    b = eng.stream([20, 21, 22, 23, 24], 4)

    async def main() -> list[tuple[int, int]]:
        seen = []
        for _ in range(3):
            await eng.run_step()
            seen.append((eng.scheduler.prefill_tokens, eng.stats().kv_tokens_in_use))
        return seen

    seen = anyio.run(main)
    if lookahead:  # a step's chunks complete at the next step, which enqueued b's rest
        assert seen[0] == (0, 0) and seen[1] == (16, 20) and seen[2][0] == 20
    else:  # 15 of a and the first of b, written and counted; then b's other 4
        assert seen[0] == (16, 16) and seen[1][0] == 20
    a.cancel()
    b.cancel()
