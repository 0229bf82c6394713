"""Grammar-constrained requests in the engine (:mod:`deviceops.nn.serving.grammar`), on the
cpu backend with the tiny random Llama of :mod:`tests.nn_tiny` (its byte-level vocabulary of
265 tokens: an odd width for the bitmask's last word).

A random model draws tokens a grammar forbids almost every step, so the outputs parse only
if every draw is masked; the schemas are bounded (enums, booleans, short strings) so the
replies end. The scheduling rules (with lookahead: a step's forward pass enqueued before the previous
step's tokens are delivered, the masks after; without, or for a step model that cannot split
a step: steps in turn while a constrained request runs) are checked by the requests' tokens:
the unconstrained ones identical with and without constrained requests joining and leaving
their batch, the constrained ones identical under every rule.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import numpy as np
import pytest

from deviceops import nn
from deviceops.nn import Engine
from deviceops.nn.serving.grammar import (
    json_object_grammar,
    json_schema_grammar,
    tool_call_grammar,
)
from deviceops.nn.serving.step_model import CausalLMSteps
from deviceops.nn.serving.tool_calls import parse

SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]},
                         "s": {"type": "string", "maxLength": 4}},
          "required": ["ok", "n", "s"], "additionalProperties": False}

TOOLS = [{"type": "function", "function": {
             "name": "get_weather", "parameters": {
                 "type": "object", "properties": {"unit": {"enum": ["C", "F"]},
                                                  "days": {"type": "integer", "minimum": 1,
                                                           "maximum": 3}},
                 "required": ["unit", "days"], "additionalProperties": False}}},
         {"type": "function", "function": {
             "name": "ping", "parameters": {"type": "object", "properties": {},
                                            "additionalProperties": False}}}]


def _valid(obj: Any) -> bool:
    """``obj`` validates under :data:`SCHEMA` (checked by hand: no jsonschema dependency)."""
    return (isinstance(obj, dict) and set(obj) == {"ok", "n", "s"}
            and isinstance(obj["ok"], bool) and obj["n"] in (1, 2, 3)
            and not isinstance(obj["n"], bool) and isinstance(obj["s"], str)
            and len(obj["s"]) <= 4)


@pytest.fixture(scope="module")
def tiny(tiny_gguf: str) -> Any:
    return nn.load_gguf(tiny_gguf, device="cpu", dtype="float32", max_batch=4, max_seq=96,
                        kv_block_size=8, kv_blocks=60)


async def _one(eng: Engine, prompt: list[int], n: int, **kw: Any) -> tuple[list[int], str | None]:
    s = eng.stream(prompt, n, **kw)
    toks = [t async for t in s]
    return toks, s.finish_reason


def test_json_schema_replies_parse_and_validate(tiny: Any) -> None:
    eng = Engine(tiny, max_batch=4, max_seq=96)
    g = json_schema_grammar(SCHEMA)
    got: list[tuple[list[int], str | None]] = []

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for i in range(8):
                async def run(i: int = i) -> None:
                    got.append(await _one(eng, [5 + i, 9, 40, 7], 60, grammar=g,
                                          temperature=0.0 if i == 0 else 1.0, seed=i))
                tg.start_soon(run)

    anyio.run(main)
    texts = set()
    for toks, reason in got:
        text = tiny.decode(toks)
        assert reason == "stop", (text, reason)  # the grammar completed: no EOS drawn
        assert toks[-1] not in tiny.config.stop_ids
        assert _valid(json.loads(text)), text
        texts.add(text)
    assert len(texts) > 1  # sampled replies differ: the mask does not force one reply
    sc = eng.scheduler
    assert sc.grammar_masks >= sum(len(t) for t, _ in got)  # one mask per draw
    assert eng.pool.in_use == 0


def test_without_the_mask_the_model_does_not_write_json(tiny: Any) -> None:
    """The control: the same requests unconstrained do not parse (the test above can fail)."""
    eng = Engine(tiny, max_batch=4, max_seq=96)

    async def main() -> list[str]:
        return [tiny.decode((await _one(eng, [5 + i, 9, 40, 7], 30, temperature=1.0,
                                        seed=i))[0]) for i in range(4)]

    for text in anyio.run(main):
        with pytest.raises(ValueError):
            json.loads(text)


def test_a_tool_call_grammar_gives_one_call_whose_arguments_validate(tiny: Any) -> None:
    eng = Engine(tiny, max_batch=4, max_seq=96)

    async def main() -> list[tuple[list[int], str | None]]:
        out = []
        for i, name in enumerate([None, None, "get_weather", "ping"]):
            g = tool_call_grammar(TOOLS, name)
            out.append(await _one(eng, [3, 4, 5 + i], 80, grammar=g, temperature=1.0,
                                   seed=i))
        return out

    results = anyio.run(main)
    for i, (toks, reason) in enumerate(results):
        text = tiny.decode(toks)
        assert reason == "stop", text
        assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>"), text
        content, calls = parse(text, ["get_weather", "ping"])
        assert content is None and len(calls) == 1, text
        fn = calls[0]["function"]
        args = json.loads(fn["arguments"])
        if i == 2:
            assert fn["name"] == "get_weather"
        if i == 3:
            assert fn["name"] == "ping"
        if fn["name"] == "get_weather":
            assert args["unit"] in ("C", "F") and args["days"] in (1, 2, 3), args
            assert set(args) == {"unit", "days"}
        else:
            assert args == {}


def test_json_object_starts_an_object_and_parses_when_complete(tiny: Any) -> None:
    eng = Engine(tiny, max_batch=4, max_seq=96)
    g = json_object_grammar()

    async def main() -> list[tuple[list[int], str | None]]:
        return [await _one(eng, [7, 8, 9], 24, grammar=g, temperature=t, seed=3)
                for t in (0.0, 1.0)]

    for toks, reason in anyio.run(main):
        text = tiny.decode(toks)
        assert text.startswith("{"), text
        if reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert reason == "length" and len(toks) == 24


# -- scheduling: constrained requests joining and leaving a batch ---------------------------
def _plain_jobs() -> list[dict[str, Any]]:
    rng = np.random.default_rng(5)
    jobs = []
    for i in range(6):
        n = int(rng.integers(2, 20))
        jobs.append(dict(prompt=rng.integers(3, 260, n).tolist(),
                         max_new_tokens=int(rng.integers(6, 22)),
                         temperature=0.0 if i % 2 else 1.0, seed=50 + i,
                         logprobs=2 if i == 3 else None))
    return jobs


class _NoSplit(CausalLMSteps):
    """A step model without ``begin_decode``: a lookahead engine steps in turn while a
    grammar runs (the scheduler's other rule)."""

    begin_decode = None  # type: ignore[assignment]


def _run(tiny: Any, lookahead: bool, constrained: bool, split: bool = True
         ) -> tuple[dict[int, list[int]], dict[str, int], Engine]:
    steps = CausalLMSteps(tiny) if split else _NoSplit(tiny)
    eng = Engine(steps, max_batch=4, max_seq=96, prefill_chunk=8, lookahead=lookahead)
    calls = {"ahead": 0, "masked": 0}
    sc = eng.scheduler
    if lookahead:
        ahead, masked = sc._step_ahead, sc._step_ahead_masked

        async def counted() -> None:
            calls["ahead"] += 1
            await ahead()

        async def counted_masked() -> None:
            calls["masked"] += 1
            await masked()

        sc._step_ahead = counted  # type: ignore[method-assign]
        sc._step_ahead_masked = counted_masked  # type: ignore[method-assign]
    got: dict[int, list[int]] = {}
    g = json_schema_grammar(SCHEMA)

    async def plain(i: int, job: dict[str, Any]) -> None:
        await anyio.sleep(0.004 * i)
        got[i] = (await _one(eng, job["prompt"], job["max_new_tokens"],
                             **{k: v for k, v in job.items()
                                if k not in ("prompt", "max_new_tokens")}))[0]

    async def shaped(i: int) -> None:
        await anyio.sleep(0.01 + 0.006 * i)  # joins a running batch
        toks, reason = await _one(eng, [11 + i, 12, 13], 60, grammar=g, temperature=1.0,
                                  seed=i)
        assert reason == "stop" and _valid(json.loads(tiny.decode(toks)))
        got[100 + i] = toks

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for i, job in enumerate(_plain_jobs()):
                tg.start_soon(plain, i, job)
            if constrained:
                for i in range(2):
                    tg.start_soon(shaped, i)
        # after every constrained request ended: lookahead again
        before = calls["ahead"]
        got[200] = (await _one(eng, [20, 21, 22], 6))[0]
        calls["after"] = calls["ahead"] - before

    anyio.run(main)
    assert eng.pool.in_use == 0
    return got, calls, eng


def test_unconstrained_rows_are_unchanged_by_constrained_ones_joining_and_leaving(
        tiny: Any) -> None:
    alone, _, _ = _run(tiny, lookahead=True, constrained=False)
    mixed, calls, eng = _run(tiny, lookahead=True, constrained=True)  # masks after delivery
    no_split, calls2, _ = _run(tiny, lookahead=True, constrained=True, split=False)
    in_turn, _, _ = _run(tiny, lookahead=False, constrained=True)
    for i in range(6):
        assert mixed[i] == alone[i], i
        assert no_split[i] == alone[i], i
        assert in_turn[i] == alone[i], i
    for i in (100, 101):  # the constrained ones: the same tokens every way
        assert mixed[i] == in_turn[i] == no_split[i]
    assert mixed[200] == alone[200] == in_turn[200] == no_split[200]
    assert calls["masked"] > 0  # constrained rows were fed ahead
    assert calls["after"] > 0 and calls2["after"] > 0  # plain lookahead once no grammar runs
    assert eng.scheduler.grammar_masks > 0


def test_a_cancelled_constrained_request_frees_its_row(tiny: Any) -> None:
    eng = Engine(tiny, max_batch=4, max_seq=96)
    g = json_schema_grammar(SCHEMA)

    async def main() -> tuple[list[int], str | None]:
        s = eng.stream([5, 6, 7], 60, grammar=g, temperature=1.0, seed=1)
        async with s:
            async for _t in s:
                if len(s.tokens) == 3:
                    s.cancel()
                    break
        return await _one(eng, [5, 6, 7], 60, grammar=g, temperature=0.0)

    toks, reason = anyio.run(main)
    assert reason == "stop" and _valid(json.loads(tiny.decode(toks)))
    assert eng.pool.in_use == 0


def test_grammars_are_refused_before_queueing(tiny: Any) -> None:
    eng = Engine(tiny, max_batch=4, max_seq=96)
    with pytest.raises(ValueError, match="grammar does not compile"):
        eng.stream([5, 6], 4, grammar='{"grammars": [{"json_schema": {"type": "objectx"}}]}')
    with pytest.raises(TypeError, match="grammar must be a str"):
        eng.stream([5, 6], 4, grammar={"type": "object"})  # type: ignore[arg-type]
    assert not eng.scheduler.queue
    # a model without a tokenizer cannot compile a grammar: refused as a missing feature
    bare = nn.random_model(nn.LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=48,
                                          num_layers=1, num_heads=2, num_kv_heads=1,
                                          head_dim=16), device="cpu", dtype="float32",
                           max_batch=2, max_seq=32)
    eng2 = Engine(bare, max_batch=2, max_seq=32)
    assert "grammar" not in eng2.sampling_features and "logprobs" in eng2.sampling_features
    with pytest.raises(ValueError, match="grammar not supported"):
        eng2.stream([5, 6], 4, grammar=json_object_grammar())


# -- the grammar module's parts ----------------------------------------------------------------
def test_matchers_masks_and_tags(tiny: Any) -> None:
    from deviceops.nn.serving.grammar import GrammarCompiler, MaskBatch, tags_are_tokens

    comp = GrammarCompiler(tiny.tokenizer.to_str(), tiny.config.vocab_size,
                           tiny.config.stop_ids)
    g = json_schema_grammar(SCHEMA)
    ms = [comp.matcher(g) for _ in range(3)]
    for t in tiny.encode('{"ok":'):  # one matcher moves on: the batch's rows differ
        assert ms[1].advance(t) is None
    batch = MaskBatch(2, tiny.config.vocab_size, threads=2)
    together = batch.fill(ms).copy()  # more rows than the batch was made for: it grows
    for i, m in enumerate(ms):
        np.testing.assert_array_equal(MaskBatch(1, tiny.config.vocab_size).fill([m])[0],
                                      together[i])
    assert not np.array_equal(together[0], together[1])
    bad = tiny.encode("x")[0]  # not a JSON start
    assert not (int(together[0, bad // 32]) >> (bad % 32)) & 1
    assert ms[0].advance(bad) == "error" and ms[0].error
    with pytest.raises(ValueError, match="not in tools"):
        tool_call_grammar(TOOLS, "nope")
    assert not tags_are_tokens(tiny.tokenizer) and not tags_are_tokens(None)
