"""Request fields current OpenAI clients send that change nothing here, and the refusals'
codes (issue 43, point 5): ``store`` and ``metadata`` are accepted (checked as OpenAI checks
them, then unused), chat ``echo`` and ``echo`` with ``logprobs`` are 400s with
``"code": "unsupported_parameter"`` naming the field, ``n`` beyond its bound one with
``"integer_above_max_value"`` (the toy model, cpu only).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from deviceops.nn.serving.engine import Engine
from deviceops.nn.serving.guard import Exposure
from deviceops.nn.serving.http import create_app
from deviceops.nn.serving.openai import Limits

from .test_serve_http import ServerThread, ToyLM

pytestmark = [pytest.mark.timeout(120)]

KEY = "sk-fields"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
COMPLETION = {"prompt": "hi", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    toy = ToyLM()
    app = create_app(lambda: Engine(toy, max_batch=4, max_seq=64, max_queue=8),
                     model_name="toy", exposure=Exposure.for_bind("127.0.0.1", api_keys=[KEY]),
                     limits=Limits(max_messages=64, max_prompt_chars=10_000))
    with ServerThread(app) as srv:
        srv.wait_healthy()
        yield srv


def _post(server: ServerThread, path: str, body: dict[str, Any]) -> httpx.Response:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        return c.post(path, json=body)


def _refusal(r: httpx.Response, param: str, code: str | None) -> str:
    assert r.status_code == 400, (r.status_code, r.text)
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"}, e
    assert e["type"] == "invalid_request_error" and e["param"] == param and e["code"] == code, e
    return str(e["message"])


# -- store and metadata: accepted, no effect -------------------------------------------------
META_OK: list[Any] = [
    None,
    {},
    {"session": "abc", "user_tier": ""},
    {f"k{i}": "v" * 512 for i in range(16)},  # 16 keys, values of the longest length
    {"k" * 64: "x"},  # the longest key
    {"ünï 🙂": "çödé"},  # any Unicode
]


@pytest.mark.parametrize("path, base", [("/v1/completions", COMPLETION),
                                        ("/v1/chat/completions", CHAT)], ids=["completions", "chat"])
@pytest.mark.parametrize("store", [None, False, True])
def test_store_and_metadata_are_accepted_and_change_nothing(
        server: ServerThread, path: str, base: dict[str, Any], store: bool | None) -> None:
    plain = _post(server, path, base)
    assert plain.status_code == 200, plain.text
    want = plain.json()["choices"][0]
    for meta in META_OK:
        r = _post(server, path, {**base, "store": store, "metadata": meta})
        assert r.status_code == 200, (store, meta, r.text)
        got = r.json()
        assert got["choices"][0] == want and got["usage"] == plain.json()["usage"]
        assert "metadata" not in got and "store" not in got


META_BAD: list[tuple[Any, str]] = [
    ({f"k{i}": "v" for i in range(17)}, "17 keys"),  # one key too many
    ({"k" * 65: "v"}, "65 characters"),  # a key one character too long
    ({"k": "v" * 513}, "513 characters"),  # a value one character too long
    ({"k": 1}, "must be a string"),
    ({"k": None}, "must be a string"),
    ({"k": True}, "must be a string"),
    ({"k": {"nested": "x"}}, "must be a string"),
    ({"k": ["x"]}, "must be a string"),
    ("session=abc", "must be an object"),
    (["k", "v"], "must be an object"),
    (7, "must be an object"),
]


@pytest.mark.parametrize("path, base", [("/v1/completions", COMPLETION),
                                        ("/v1/chat/completions", CHAT)], ids=["completions", "chat"])
@pytest.mark.parametrize("meta, why", META_BAD, ids=[w.replace(" ", "_") + f"-{i}"
                                                     for i, (_, w) in enumerate(META_BAD)])
def test_metadata_outside_openai_bounds_is_a_400_naming_it(
        server: ServerThread, path: str, base: dict[str, Any], meta: Any, why: str) -> None:
    msg = _refusal(_post(server, path, {**base, "metadata": meta}), "metadata", None)
    assert "metadata" in msg and why in msg, msg


@pytest.mark.parametrize("store", ["false", 0, 1, [], {}])
def test_store_must_be_a_boolean(server: ServerThread, store: Any) -> None:
    msg = _refusal(_post(server, "/v1/chat/completions", {**CHAT, "store": store}), "store", None)
    assert "boolean" in msg


def test_the_openai_client_sends_store_and_metadata() -> None:
    """What the SDK's helpers send (``store=False``, ``metadata={...}``) goes through."""
    openai = pytest.importorskip("openai")
    toy = ToyLM()
    app = create_app(lambda: Engine(toy, max_batch=4, max_seq=64, max_queue=8),
                     model_name="toy", exposure=Exposure.for_bind("127.0.0.1", api_keys=[KEY]))
    with ServerThread(app) as srv:
        srv.wait_healthy()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
        r = client.chat.completions.create(model="toy", messages=CHAT["messages"], max_tokens=3,
                                           store=False, metadata={"trace": "t-1"})
        assert r.choices[0].message.content and r.usage.completion_tokens == 3
        c = client.completions.create(model="toy", prompt="hi", max_tokens=2,
                                      extra_body={"store": False, "metadata": {"a": "b"}})
        assert len(c.choices) == 1
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="toy", messages=CHAT["messages"],
                                           metadata={"k": "v" * 600})
        assert e.value.param == "metadata"


# -- the refusals' codes ---------------------------------------------------------------------
@pytest.mark.parametrize("path, base", [("/v1/completions", COMPLETION),
                                        ("/v1/chat/completions", CHAT)], ids=["completions", "chat"])
@pytest.mark.parametrize("n", [17, 128])
def test_n_above_the_bound_is_integer_above_max_value(server: ServerThread, path: str,
                                                      base: dict[str, Any], n: int) -> None:
    """``n`` up to MAX_N (16) is served (tests/test_serve_n_choices.py); beyond it a 400."""
    msg = _refusal(_post(server, path, {**base, "n": n}), "n", "integer_above_max_value")
    assert f"'n'={n}" in msg and "at most 16" in msg


def test_n_above_the_engine_queue_is_refused(server: ServerThread) -> None:
    """Each choice is one engine request: more than the engine queues at once (max_queue 8
    here) could never be admitted together, a 400 naming ``n`` and the flag."""
    msg = _refusal(_post(server, "/v1/completions", {**COMPLETION, "n": 9}), "n",
                   "integer_above_max_value")
    assert "at most 8" in msg and "--max-queue" in msg
    r = _post(server, "/v1/completions", {**COMPLETION, "n": 8})
    assert r.status_code == 200 and len(r.json()["choices"]) == 8


@pytest.mark.parametrize("n", [0, -1, 1.5, "2", True])
def test_n_that_is_no_count_is_an_invalid_value(server: ServerThread, n: Any) -> None:
    """``n`` = 0, negative or not an integer is a plain bad value, not a missing feature."""
    msg = _refusal(_post(server, "/v1/completions", {**COMPLETION, "n": n}), "n", None)
    assert "integer >= 1" in msg
    for ok in (1, None):
        assert _post(server, "/v1/completions", {**COMPLETION, "n": ok}).status_code == 200


@pytest.mark.parametrize("logprobs", [0, 1, 5])
@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_names_the_combination(server: ServerThread, logprobs: int,
                                                  stream: bool) -> None:
    body = {**COMPLETION, "echo": True, "logprobs": logprobs, "stream": stream}
    msg = _refusal(_post(server, "/v1/completions", body), "echo", "unsupported_parameter")
    assert "'echo' together with 'logprobs'" in msg, msg
    assert _post(server, "/v1/completions", {**COMPLETION, "echo": True}).status_code == 200
    # logprobs alone, or with echo: false, is no echo (the toy engine has no logprobs: its
    # refusal names logprobs; tests/test_sampling_features.py serves them)
    for body in ({**COMPLETION, "logprobs": logprobs},
                 {**COMPLETION, "echo": False, "logprobs": logprobs}):
        _refusal(_post(server, "/v1/completions", body), "logprobs", "unsupported_parameter")


def test_chat_echo_is_unsupported_parameter(server: ServerThread) -> None:
    msg = _refusal(_post(server, "/v1/chat/completions", {**CHAT, "echo": True}), "echo",
                   "unsupported_parameter")
    assert "/v1/completions" in msg
    assert _post(server, "/v1/chat/completions", {**CHAT, "echo": False}).status_code == 200
