"""Every sampling parameter the engine and the server accept has a checked *effect*.

The toy :class:`SampToy` draws its next token from a fixed, sequence-dependent logit vector
with the contract's rule (softmax of ``logits / temperature`` on the top-``k`` set, then the
top-``p`` prefix, one uniform draw from a counter-based generator keyed by the seed), so a
parameter lost anywhere between the HTTP body and the model changes the tokens: temperature
0 is greedy, ``top_k=1`` and a tiny ``top_p`` are greedy at any temperature, the same seed
gives the same tokens, different seeds different ones, and ``ignore_eos`` runs past an EOS
the toy emits at a chosen step. Each test first asserts that the alternatives it tells
apart really differ (so no check passes by coincidence). ``include_usage`` and
``max_completion_tokens`` are sent and their effect asserted. The same engine on the tiny
random Llama must equal ``CausalLM.generate`` with every sampling parameter.

Mutants these tests were written to kill (tests/MUTATION.md): ``top_k`` / ``top_p`` /
``seed`` / ``ignore_eos`` dropped between the request and ``Engine.stream``, temperature
forced to 0, an ``Engine`` that passes ``top_k=0`` / ``top_p=1`` to the model.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import pytest

from deviceops.nn.serving.engine import Engine, SamplingParams

from . import nn_tiny
from .test_serve_http import ServerThread, sse_events

pytestmark = [pytest.mark.timeout(60)]

VOCAB = 52  # token t < 26 is the letter chr(97 + t), t >= 26 the capital chr(65 + t - 26)
EOS = 0


def _h(xs: Sequence[int], salt: int = 0) -> int:
    h = 1469598103934665603 ^ salt
    for t in xs:
        h = ((h ^ (t + 1)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def toy_logits(seq: Sequence[int]) -> np.ndarray:
    """The toy's logits after ``seq``: distinct, spread over a few units (EOS kept low)."""
    rng = np.random.default_rng(_h(seq))
    z = rng.standard_normal(VOCAB) * 1.5
    z[EOS] = -30.0
    return z


def toy_pick(logits: np.ndarray, p: SamplingParams, counter: int) -> int:
    """The contract's sampling rule, keyed by (seed, counter)."""
    if p.temperature == 0.0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / p.temperature
    order = np.argsort(-z, kind="stable")
    if p.top_k:
        order = order[: p.top_k]
    pr = np.exp(z[order] - z[order].max())
    pr /= pr.sum()
    n = int(np.searchsorted(np.cumsum(pr), p.top_p - 1e-12) + 1)
    order, pr = order[:n], pr[:n] / pr[:n].sum()
    u = np.random.default_rng([p.seed, counter]).random()
    return int(order[min(int(np.searchsorted(np.cumsum(pr), u, side="right")), n - 1)])


class SampToy:
    """A StepModel whose tokens follow :func:`toy_pick`; EOS comes at step ``eos_at``."""

    def __init__(self, max_batch: int = 4, max_seq: int = 64, eos_at: int | None = None) -> None:
        self._max_batch, self._max_seq, self.eos_at = max_batch, max_seq, eos_at
        self.cache: dict[int, list[int]] = {}
        self.params: dict[int, SamplingParams] = {}
        self.counter: dict[int, int] = {}

    max_batch = property(lambda self: self._max_batch)
    max_seq = property(lambda self: self._max_seq)
    vocab_size = property(lambda self: VOCAB)
    eos_ids = property(lambda self: frozenset({EOS}))

    def encode(self, text: str) -> list[int]:
        return [1 + ord(c) % (VOCAB - 1) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(97 + t) if t < 26 else chr(65 + t - 26) for t in ids)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def _next(self, seq: Sequence[int], p: SamplingParams, counter: int) -> int:
        if self.eos_at is not None and counter == self.eos_at:
            return EOS
        return toy_pick(toy_logits(seq), p, counter)

    def _sample(self, slot: int) -> int:
        c = self.counter[slot]
        self.counter[slot] = c + 1
        return self._next(self.cache[slot], self.params[slot], c)

    async def prefill(self, slot: int, ids: Sequence[int], start: int, params: SamplingParams,
                      *, last: bool) -> int | None:
        if start == 0:
            self.cache[slot], self.params[slot], self.counter[slot] = [], params, 0
        self.cache[slot].extend(ids)
        await anyio.lowlevel.checkpoint()
        return self._sample(slot) if last else None

    async def decode_step(self, slots: Sequence[int], tokens: Sequence[int],
                          positions: Sequence[int]) -> list[int]:
        out = []
        for s, t in zip(slots, tokens, strict=True):
            self.cache[s].append(t)
            out.append(self._sample(s))
        await anyio.lowlevel.checkpoint()
        return out

    def release(self, slot: int) -> None:
        del self.cache[slot]

    def reference(self, prompt: Sequence[int], n: int, *, temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                  ignore_eos: bool = False) -> list[int]:
        p = SamplingParams(temperature, top_k, top_p, seed)
        seq, out = list(prompt), []
        for c in range(n):
            t = self._next(seq, p, c)
            out.append(t)
            seq.append(t)
            if t == EOS and not ignore_eos:
                break
        return out


PROMPT = [5, 17, 3, 40, 22, 9]
N = 12


def _distinct(*seqs: list[int]) -> None:
    """The alternatives a check tells apart really differ."""
    assert len({tuple(s) for s in seqs}) == len(seqs), seqs


# -- the engine -------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_engine_applies_every_sampling_parameter() -> None:
    toy = SampToy()
    eng = Engine(toy, max_batch=4, max_seq=64)
    ref = toy.reference
    greedy = ref(PROMPT, N)
    hot = ref(PROMPT, N, temperature=1.5, seed=3)
    k3 = ref(PROMPT, N, temperature=1.5, top_k=3, seed=3)
    p6 = ref(PROMPT, N, temperature=1.5, top_p=0.6, seed=3)
    other_seed = ref(PROMPT, N, temperature=1.5, seed=4)
    _distinct(greedy, hot, k3, p6, other_seed)
    with anyio.fail_after(10):
        assert await eng.generate(PROMPT, N) == greedy
        assert await eng.generate(PROMPT, N, temperature=1.5, seed=3) == hot
        assert await eng.generate(PROMPT, N, temperature=1.5, seed=4) == other_seed
        assert await eng.generate(PROMPT, N, temperature=1.5, top_k=3, seed=3) == k3
        assert await eng.generate(PROMPT, N, temperature=1.5, top_p=0.6, seed=3) == p6
        # top_k=1 and a tiny top_p leave one token: greedy at any temperature and seed
        assert await eng.generate(PROMPT, N, temperature=1.5, top_k=1, seed=3) == greedy
        assert await eng.generate(PROMPT, N, temperature=1.5, top_p=1e-6, seed=3) == greedy
        # what the model was given
        s = eng.stream(PROMPT, 2, temperature=0.7, top_k=5, top_p=0.8, seed=11)
        assert [t async for t in s] == ref(PROMPT, 2, temperature=0.7, top_k=5, top_p=0.8,
                                           seed=11)
    assert SamplingParams(0.7, 5, 0.8, 11) in toy.params.values()


@pytest.mark.anyio
async def test_engine_seed_none_is_fresh_and_ignore_eos_runs_past_eos() -> None:
    toy = SampToy(eos_at=2)
    eng = Engine(toy, max_batch=4, max_seq=64)
    with anyio.fail_after(10):
        s = eng.stream(PROMPT, N)
        got = [t async for t in s]
        assert got == toy.reference(PROMPT, N) and len(got) == 3 and got[-1] == EOS
        assert s.finish_reason == "stop"
        s = eng.stream(PROMPT, N, ignore_eos=True)
        got = [t async for t in s]
        assert got == toy.reference(PROMPT, N, ignore_eos=True) and len(got) == N
        assert got[2] == EOS and s.finish_reason == "length"
    toy = SampToy()
    eng = Engine(toy, max_batch=4, max_seq=64)
    with anyio.fail_after(10):
        runs = [await eng.generate(PROMPT, N, temperature=1.5) for _ in range(4)]
    assert len({tuple(r) for r in runs}) > 1  # seed None: a fresh seed per request


@pytest.mark.anyio
async def test_engine_equals_causal_lm_generate_with_sampling(tmp_path: Path) -> None:
    """The engine on the tiny random Llama == ``CausalLM.generate`` for every parameter."""
    from deviceops import nn

    path = tmp_path / "tiny.gguf"
    nn_tiny.write_gguf(path, nn_tiny.hf_weights(2, tied=False), "F32")
    m = nn.load_gguf(path, device="cpu", dtype="float32", max_batch=4, max_seq=48,
                     prefill_chunk=32)
    eng = Engine(m, max_batch=4, max_seq=48)
    ids = [7, 30, 41, 12, 99, 5]
    cases: list[dict[str, Any]] = [
        {}, {"temperature": 1.2, "seed": 5}, {"temperature": 1.2, "seed": 6},
        {"temperature": 1.2, "top_k": 4, "seed": 5}, {"temperature": 1.2, "top_p": 0.5, "seed": 5},
    ]
    want = [m.generate(ids, 8, **kw) for kw in cases]
    _distinct(*want)
    with anyio.fail_after(30):
        for kw, w in zip(cases, want, strict=True):
            assert await eng.generate(ids, 8, **kw) == w, kw
    assert eng.stats().slots_in_use == 0


# -- over HTTP --------------------------------------------------------------------------------

@pytest.fixture
def server() -> Iterator[tuple[ServerThread, SampToy]]:
    from deviceops.nn.serving.http import create_app

    toy = SampToy(max_batch=4, max_seq=64)
    app = create_app(lambda: Engine(toy, max_batch=4, max_seq=64, max_queue=8), model_name="toy")
    with ServerThread(app) as srv:
        srv.wait_healthy()
        yield srv, toy


def _complete(c: httpx.Client, **body: Any) -> dict[str, Any]:
    r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": N, **body})
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_http_sampling_parameters_take_effect(server: tuple[ServerThread, SampToy]) -> None:
    srv, toy = server
    ref, dec = toy.reference, toy.decode
    greedy = dec(ref(PROMPT, N))
    hot = dec(ref(PROMPT, N, temperature=1.5, seed=3))
    hot4 = dec(ref(PROMPT, N, temperature=1.5, seed=4))
    k3 = dec(ref(PROMPT, N, temperature=1.5, top_k=3, seed=3))
    p6 = dec(ref(PROMPT, N, temperature=1.5, top_p=0.6, seed=3))
    assert len({greedy, hot, hot4, k3, p6}) == 5
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        text = lambda **kw: _complete(c, **kw)["choices"][0]["text"]  # noqa: E731
        assert text(temperature=0) == greedy
        assert text(temperature=1.5, seed=3) == hot  # temperature and seed reach the model
        assert text(temperature=1.5, seed=3) == hot  # same seed, same text
        assert text(temperature=1.5, seed=4) == hot4  # another seed, another text
        assert text(temperature=1.5, top_k=3, seed=3) == k3
        assert text(temperature=1.5, top_k=1, seed=3) == greedy
        assert text(temperature=1.5, top_p=0.6, seed=3) == p6
        assert text(temperature=1.5, top_p=1e-6, seed=3) == greedy
        # chat: the same parameters through /v1/chat/completions
        msgs = [{"role": "user", "content": "hi"}]
        cids = toy.encode(toy.apply_chat_template(msgs))
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 6,
                                                 "temperature": 1.5, "top_k": 3, "seed": 8})
        assert r.status_code == 200, r.text
        want = ref(cids, 6, temperature=1.5, top_k=3, seed=8)
        assert want != ref(cids, 6, temperature=1.5, seed=8)
        assert r.json()["choices"][0]["message"]["content"] == dec(t for t in want if t != EOS)


def test_http_ignore_eos_max_completion_tokens_and_usage(
        server: tuple[ServerThread, SampToy]) -> None:
    srv, toy = server
    toy.eos_at = 3  # the toy emits EOS at step 3
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        body = _complete(c, temperature=0)
        assert body["choices"][0]["finish_reason"] == "stop"
        assert body["usage"]["completion_tokens"] == 4
        body = _complete(c, temperature=0, ignore_eos=True)
        want = toy.reference(PROMPT, N, ignore_eos=True)
        assert len(want) == N and want[3] == EOS
        assert body["choices"][0]["text"] == toy.decode([t for t in want if t != EOS])
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": N,
                                 "total_tokens": len(PROMPT) + N}
        # streamed: the usage chunk only when asked for, with the request's counts
        for include in (True, False):
            with c.stream("POST", "/v1/completions", json={
                    "prompt": PROMPT, "max_tokens": 7, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": include}}) as r:
                assert r.status_code == 200
                ev = sse_events(r.iter_lines())
            assert ev[-1] == "[DONE]"
            usage = [e for e in ev[:-1] if "usage" in e]
            if include:
                assert usage == [ev[-2]] and ev[-2]["choices"] == []
                assert ev[-2]["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 7,
                                           "total_tokens": len(PROMPT) + 7}
                assert ev[-3]["choices"][0]["finish_reason"] == "length"
            else:
                assert not usage and ev[-2]["choices"][0]["finish_reason"] == "length"
        # chat: max_completion_tokens bounds the completion (and beats max_tokens)
        msgs = [{"role": "user", "content": "hey"}]
        for extra in ({}, {"max_tokens": 9}):
            r = c.post("/v1/chat/completions", json={
                "messages": msgs, "max_completion_tokens": 2, "temperature": 0, **extra})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 2
            assert r.json()["choices"][0]["finish_reason"] == "length"
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_completion_tokens": 10**6})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    assert srv.engine.stats().slots_in_use == 0


class _FailingDecode(SampToy):
    fail = False

    async def decode_step(self, slots: Sequence[int], tokens: Sequence[int],
                          positions: Sequence[int]) -> list[int]:
        if self.fail:
            raise RuntimeError("decode broke")
        return await super().decode_step(slots, tokens, positions)


def test_http_response_details_stop_at_start_metrics_and_failures() -> None:
    """The completion's index, a stop string at the very start of the text, the TTFT metric,
    a prompt id below 0 refused by the request check, and a failed step: 500 (non-streamed)
    or an error event before ``[DONE]`` (streamed)."""
    from deviceops.nn.serving.http import create_app

    toy = _FailingDecode(max_batch=4, max_seq=64)
    app = create_app(lambda: Engine(toy, max_batch=4, max_seq=64, max_queue=8), model_name="toy")
    first = toy.decode(toy.reference(PROMPT, 1))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        srv.wait_healthy()
        body = _complete(c, temperature=0, max_tokens=4)
        assert body["choices"][0]["index"] == 0 and body["choices"][0]["finish_reason"] == "length"
        body = _complete(c, temperature=0, max_tokens=4, stop=[first])
        assert body["choices"][0]["text"] == "" and body["choices"][0]["finish_reason"] == "stop"
        m = c.get("/metrics").text
        assert "deviceops_time_to_first_token_seconds_count 2.0" in m, m
        r = c.post("/v1/completions", json={"prompt": [3, -1], "max_tokens": 2})
        assert r.status_code == 400 and "token ids must be in [0, 52)" in r.json()["error"]["message"]
        toy.fail = True
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
        assert r.status_code == 500 and "decode broke" in r.json()["error"]["message"], r.text
        with c.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4,
                                                      "stream": True}) as resp:
            assert resp.status_code == 200
            ev = sse_events(resp.iter_lines())
        assert ev[-1] == "[DONE]" and "decode broke" in ev[-2]["error"]["message"], ev
        toy.fail = False
        assert _complete(c, temperature=0, max_tokens=2)["choices"][0]["text"] == dec2(toy)


def dec2(toy: SampToy) -> str:
    return toy.decode(toy.reference(PROMPT, 2))


def test_http_engine_refusal_is_a_400() -> None:
    """A request the engine refuses after the body checks (here: more KV blocks than the
    pool holds) is a 400 naming the prompt, not a 500."""
    from deviceops.nn.serving.http import create_app

    class Paged(SampToy):
        kv_blocks_total = 2
        kv_block_size = 4

        def reserve(self, slot: int, n_tokens: int) -> bool:
            return -(-n_tokens // 4) <= 2

    app = create_app(lambda: Engine(Paged(max_batch=2, max_seq=64), max_batch=2, max_seq=64),
                     model_name="toy")
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        srv.wait_healthy()
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 20})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "prompt"
        assert "more KV blocks than the pool" in r.json()["error"]["message"]
        assert _complete(c, temperature=0, max_tokens=2)["usage"]["completion_tokens"] == 2
