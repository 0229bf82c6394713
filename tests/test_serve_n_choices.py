"""``n`` > 1 (issue 43, point 1) through the HTTP layer, and the prefix cache's counters in
``/metrics``.

The toy model (fast, exact): ``n`` choices indexed 0..n-1, equal at temperature 0, each its
own seed (``seed + i``: choice ``i`` equals a one-choice request with that seed), streamed
chunks naming their choice in ``choices[0].index``, usage summed, ``best_of`` and too many
choices refused in OpenAI's error shape, every slot free afterwards; the official ``openai``
client. The tiny random Llama (cpu backend): the choices share the prompt's full KV blocks
(prefilled once: ``deviceops_prefix_cache_hit_tokens``), greedy choices equal one plain
request, ``--no-prefix-cache`` (``Engine(prefix_cache=False)``) prefills every choice's
prompt; and ``serve`` with its engine core, both ways.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from deviceops.nn.serving.engine import Engine
from deviceops.nn.serving.http import create_app

from .test_serve_http import ServerThread, ToyLM, sse_events

pytestmark = [pytest.mark.timeout(120)]

PATHS = [("/v1/completions", {"prompt": "hello there"}),
         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there"}]})]
IDS = ["completions", "chat"]


@pytest.fixture(scope="module")
def toy() -> Iterator[ServerThread]:
    lm = ToyLM(max_batch=4, max_seq=64, delay=0.001)
    app = create_app(lambda: Engine(lm, max_batch=4, max_seq=64, max_queue=16),
                     model_name="toy")
    with ServerThread(app) as srv:
        srv.wait_healthy()
        yield srv


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=60) as c:
        return c.post(path, json=body)


def _text(choice: dict[str, Any]) -> str:
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


@pytest.mark.parametrize(("path", "base"), PATHS, ids=IDS)
def test_n_greedy_choices_are_equal_and_usage_is_summed(toy: ServerThread, path: str,
                                                        base: dict[str, Any]) -> None:
    one = _post(toy.url, path, {**base, "max_tokens": 6, "temperature": 0})
    r = _post(toy.url, path, {**base, "max_tokens": 6, "temperature": 0, "n": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    want = _text(one.json()["choices"][0])
    assert [_text(c) for c in body["choices"]] == [want] * 3
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    use, use1 = body["usage"], one.json()["usage"]
    assert use["prompt_tokens"] == use1["prompt_tokens"]  # the prompt, once
    assert use["completion_tokens"] == 3 * 6 == 3 * use1["completion_tokens"]
    assert use["total_tokens"] == use["prompt_tokens"] + use["completion_tokens"]
    st = toy.engine.stats()
    assert (st.slots_in_use, st.running, st.queued) == (0, 0, 0)


@pytest.mark.parametrize(("path", "base"), PATHS, ids=IDS)
def test_each_choice_samples_with_its_own_seed(toy: ServerThread, path: str,
                                               base: dict[str, Any]) -> None:
    """At temperature 1 with ``seed`` s, choice i is what a one-choice request with seed
    s + i gives: the choices differ, and the request is reproducible."""
    req = {**base, "max_tokens": 8, "temperature": 1.0, "seed": 41}
    r = _post(toy.url, path, {**req, "n": 4})
    assert r.status_code == 200, r.text
    got = [_text(c) for c in r.json()["choices"]]
    assert len(set(got)) == 4, got
    singles = [_text(_post(toy.url, path, {**req, "seed": 41 + i}).json()["choices"][0])
               for i in range(4)]
    assert got == singles
    assert [_text(c) for c in _post(toy.url, path, {**req, "n": 4}).json()["choices"]] == got


@pytest.mark.parametrize(("path", "base"), PATHS, ids=IDS)
def test_streamed_choices_name_their_index(toy: ServerThread, path: str,
                                           base: dict[str, Any]) -> None:
    chat = "chat" in path
    req = {**base, "max_tokens": 7, "temperature": 1.0, "seed": 3, "n": 3}
    whole = _post(toy.url, path, req).json()
    with httpx.Client(base_url=toy.url, timeout=60) as c, c.stream(
            "POST", path, json={**req, "stream": True,
                                "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    texts: dict[int, str] = {0: "", 1: "", 2: ""}
    finished: dict[int, str] = {}
    roles: list[int] = []
    for ev in events[:-2]:
        assert len(ev["choices"]) == 1, ev
        ch = ev["choices"][0]
        i = ch["index"]
        assert i in texts and i not in finished, ev  # nothing after a choice's last chunk
        if chat:
            delta = ch["delta"]
            if delta.get("role") == "assistant":
                assert texts[i] == "" and i not in roles
                roles.append(i)
            texts[i] += delta.get("content") or ""
        else:
            texts[i] += ch["text"]
        if ch["finish_reason"] is not None:
            finished[i] = ch["finish_reason"]
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert [texts[i] for i in range(3)] == [_text(x) for x in whole["choices"]]
    if chat:
        assert sorted(roles) == [0, 1, 2]
    st = toy.engine.stats()
    assert (st.slots_in_use, st.running, st.queued) == (0, 0, 0)


@pytest.mark.parametrize(("path", "base"), PATHS, ids=IDS)
def test_best_of_and_too_many_choices_are_refused_naming_the_parameter(
        toy: ServerThread, path: str, base: dict[str, Any]) -> None:
    for extra, param, code in (({"best_of": 3, "n": 2}, "best_of", "unsupported_parameter"),
                               ({"best_of": 2}, "best_of", "unsupported_parameter"),
                               ({"best_of": True}, "best_of", "unsupported_parameter"),
                               ({"n": 17}, "n", "integer_above_max_value")):
        r = _post(toy.url, path, {**base, "max_tokens": 2, **extra})
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param,
                                                            code), err
        assert f"'{param}'" in err["message"]
    ok = _post(toy.url, path, {**base, "max_tokens": 2, "best_of": 1, "n": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_the_openai_client_gets_n_choices(toy: ServerThread) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=toy.url + "/v1", api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "hello"}]
    hot = client.chat.completions.create(model="toy", messages=msgs, n=3, max_tokens=6,
                                         temperature=1.0, seed=9)
    assert [c.index for c in hot.choices] == [0, 1, 2]
    assert len({c.message.content for c in hot.choices}) == 3
    cold = client.chat.completions.create(model="toy", messages=msgs, n=3, max_tokens=6,
                                          temperature=0)
    assert len({c.message.content for c in cold.choices}) == 1
    assert cold.usage is not None and cold.usage.completion_tokens == 18
    comp = client.completions.create(model="toy", prompt="hi", n=2, max_tokens=4,
                                     temperature=0)
    assert [c.index for c in comp.choices] == [0, 1] and comp.choices[0].text == comp.choices[1].text
    seen: dict[int, str] = {}
    for chunk in client.chat.completions.create(model="toy", messages=msgs, n=2, max_tokens=5,
                                                temperature=1.0, seed=9, stream=True):
        for ch in chunk.choices:
            seen[ch.index] = seen.get(ch.index, "") + (ch.delta.content or "")
    assert seen == {0: hot.choices[0].message.content[:len(seen[0])],
                    1: hot.choices[1].message.content[:len(seen[1])]}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="toy", prompt="hi", best_of=2, max_tokens=2)
    assert e.value.param == "best_of"


# -- the tiny Llama: shared blocks -----------------------------------------------------------
def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:_total)? (\S+)$", text, re.M)
    assert m is not None, f"{name} not in /metrics"
    return float(m.group(1))


PROMPT = list(range(3, 3 + 37))  # 37 token ids: 2 full blocks of 16, then 5 tokens


@pytest.mark.parametrize("cache", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_choices_share_the_prompt_blocks(tiny_gguf: str, cache: bool) -> None:
    from deviceops import nn

    def load() -> Engine:
        lm = nn.load_gguf(tiny_gguf, device="cpu", dtype="float32", max_batch=4, max_seq=96)
        return Engine(lm, max_batch=4, max_seq=96, prefill_chunk=64, prefix_cache=cache)

    app = create_app(load, model_name="tiny")
    with ServerThread(app) as srv:
        srv.wait_healthy()
        one = _post(srv.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6,
                                                 "temperature": 0, "ignore_eos": True})
        eng = srv.engine
        assert eng.clear_prefix_cache() == (2 if cache else 0)  # the first request's blocks
        before = eng.stats()
        r = _post(srv.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "n": 4,
                                               "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        want = one.json()["choices"][0]["text"]
        assert [c["text"] for c in r.json()["choices"]] == [want] * 4
        st = eng.stats()
        prefilled = st.prefill_tokens - before.prefill_tokens
        hits = st.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
        if cache:  # the first choice prefills 37; the others share 2 blocks, prefill 5
            assert (prefilled, hits) == (37 + 3 * 5, 3 * 32)
        else:
            assert (prefilled, hits, st.prefix_cache_miss_tokens) == (4 * 37, 0, 0)
        assert st.kv_blocks_in_use == 0 and st.slots_in_use == 0
        text = httpx.get(srv.url + "/metrics").text
        assert _metric(text, "deviceops_prefix_cache_hit_tokens") == st.prefix_cache_hit_tokens
        assert _metric(text, "deviceops_prefix_cache_miss_tokens") == st.prefix_cache_miss_tokens
        assert _metric(text, "deviceops_kv_blocks_cached") == st.kv_blocks_cached
        assert (st.kv_blocks_cached > 0) == cache


@pytest.mark.parametrize("flags", [(), ("--no-prefix-cache",)], ids=["default", "off"])
def test_serve_with_its_engine_core_shares_blocks_unless_told_not_to(
        tiny_gguf: str, flags: tuple[str, ...]) -> None:
    from .test_serve_processes import _serve

    with _serve("--model", tiny_gguf, "--device", "cpu", "--max-batch", "4", "--max-seq", "96",
                *flags) as (_, url):
        r = _post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "n": 3,
                                           "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        texts = [c["text"] for c in r.json()["choices"]]
        assert len(texts) == 3 and len(set(texts)) == 1
        assert r.json()["usage"]["completion_tokens"] == 12
        text = httpx.get(url + "/metrics").text
        hits = _metric(text, "deviceops_prefix_cache_hit_tokens")
        assert hits == (0 if flags else 2 * 32)
        assert _metric(text, "deviceops_engine_prefill_tokens") == (
            3 * 37 if flags else 37 + 2 * 5)
