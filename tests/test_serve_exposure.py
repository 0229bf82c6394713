"""The server as something exposed: OpenAI's error shapes, refused parameters, agent
messages, keys and hosts, and a battery of hostile requests (the toy model, cpu only).

Every refusal is checked for its status, its OpenAI error body and the field it names; the
battery checks that nothing answers 500, that ``/health`` keeps answering within 100 ms
while it runs, and that the server's memory comes back.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from deviceops.nn.serving.engine import Engine
from deviceops.nn.serving.guard import Exposure
from deviceops.nn.serving.http import create_app
from deviceops.nn.serving.openai import Limits

from .test_serve_http import BAD, ServerThread, ToyLM

pytestmark = [pytest.mark.timeout(120)]

KEY = "sk-test-1"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def server() -> Iterator[ServerThread]:
    toy = ToyLM()
    app = create_app(lambda: Engine(toy, max_batch=4, max_seq=64, max_queue=8),
                     model_name="toy", exposure=Exposure.for_bind("127.0.0.1", api_keys=[KEY]),
                     limits=Limits(max_messages=64, max_prompt_chars=10_000))
    with ServerThread(app) as srv:
        srv.wait_healthy()
        yield srv


def _err(r: httpx.Response, status: int, param: str | None = None,
         code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"], e
    if param is not None:
        assert e["param"] == param, e
    if code is not None:
        assert e["code"] == code, e
    return e


def test_openai_errors_and_models(server: ServerThread) -> None:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        _err(c.post("/v1/completions", json={"prompt": "hi", "model": "gpt-4"}), 404, "model",
             "model_not_found")
        assert c.get("/v1/models/toy").json()["id"] == "toy"
        _err(c.get("/v1/models/gpt-4"), 404, "model", "model_not_found")
        _err(c.get("/v1/nope"), 404, code="unknown_url")
        _err(c.get("/v1/completions"), 405, code="method_not_allowed")
        r = c.post("/v1/completions", json={"prompt": "hi", "n": None, "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 1


UNSUPPORTED = [
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/chat/completions", {"echo": True}, "echo"),  # not a chat parameter
    ("/v1/completions", {"echo": True, "logprobs": 1}, "echo"),  # needs prompt logprobs
    ("/v1/completions", {"echo": "yes"}, "echo"),
    # supported (tests/test_sampling_features.py), refused only with values out of range
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
    ("/v1/completions", {"presence_penalty": 5}, "presence_penalty"),  # outside [-2, 2]
    ("/v1/completions", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("/v1/completions", {"logit_bias": {"100000": 10}}, "logit_bias"),  # not a token id
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/completions", {"n": 17}, "n"),  # more choices than MAX_N (n > 1 itself is served)
    ("/v1/completions", {"frobnicate": 1}, "frobnicate"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice"),
    ("/v1/chat/completions", {"tools": "all"}, "tools"),
]


@pytest.mark.parametrize(("path", "extra", "param"), UNSUPPORTED, ids=[u[2] for u in UNSUPPORTED])
def test_parameters_it_cannot_honour_are_refused(server: ServerThread, path: str,
                                                 extra: dict[str, Any], param: str) -> None:
    body = {"max_tokens": 2, **extra}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
                else {"prompt": "hi"})
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        e = _err(c.post(path, json=body), 400, param)
    assert param in e["message"]


def test_neutral_values_of_those_parameters_are_accepted(server: ServerThread) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "best_of": 1, "echo": False, "logprobs": None,
            "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "user": "u1"}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        assert c.post("/v1/completions", json=body).status_code == 200
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "response_format": {"type": "text"}, "logprobs": False,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                "tool_choice": "auto", "parallel_tool_calls": True}
        assert c.post("/v1/chat/completions", json=chat).status_code == 200


def test_agent_conversation_messages_are_accepted(server: ServerThread) -> None:
    msgs = [
        {"role": "developer", "content": "Be"},
        {"role": "user", "content": "Rain?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "no"},
    ]
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3})
        assert r.status_code == 200, r.text
        _err(c.post("/v1/chat/completions", json={"messages": [
            {"role": "user", "content": None}]}), 400, "messages[0].content")
        _err(c.post("/v1/chat/completions", json={"messages": [
            {"role": "tool", "content": "x"}]}), 400, "messages[0].tool_call_id")
        _err(c.post("/v1/chat/completions", json={"messages": [
            {"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}]}),
             400, "messages[0].tool_calls[0]")


def test_keys_and_hosts(server: ServerThread) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.get("/health").status_code == 200  # open without a key
        _err(c.post("/v1/completions", json={"prompt": "hi"}), 401, code="invalid_api_key")
        _err(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        _err(c.get("/v1/models", headers={**AUTH, "Host": "evil.example"}), 400,
             code="host_not_allowed")
        _err(c.post("/v1/completions", content=b'{"prompt": "hi"}',
                    headers={**AUTH, "content-type": "text/plain"}), 415)


def test_oversized_upload_still_sending_reads_its_413(server: ServerThread) -> None:
    """A client that goes on uploading a too-large body after the server has decided reads
    the whole 413 (the guard drains the upload first) instead of a broken pipe or reset."""
    body = b'{"prompt": "' + b"x" * (5 << 20) + b'"}'
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
            + KEY.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(head + body[:65536])
        time.sleep(0.3)  # the declared size alone decides: the server has answered by now
        for i in range(65536, len(body), 65536):
            s.sendall(body[i:i + 65536])
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status, _, rest = data.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 413"), data[:200]
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_too_large"


def _hostile(url: str) -> list[tuple[str, Any, dict[str, str]]]:
    """(path, body as bytes or JSON, extra headers): every case the issue lists, and more."""
    j = {"content-type": "application/json"}
    big = b'{"prompt": "' + b"x" * (5 << 20) + b'"}'
    out: list[tuple[str, Any, dict[str, str]]] = [
        ("/v1/completions", big, j),  # 5 MB body: 413
        ("/v1/completions", b'{"prompt": "a\\ud800b"}', j),  # lone surrogate
        ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, j),  # nesting
        ("/v1/chat/completions", json.dumps({"messages": [
            {"role": "user", "content": "x"}] * 100_000}).encode()[: 4 << 20], j),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 65}, j),
        ("/v1/completions", {"prompt": "y" * 20_000}, j),
        ("/v1/completions", b'{"prompt": "hi"}', {"content-type": "text/plain"}),
        ("/v1/completions", b'{"prompt": "hi"}', {"content-type": "application/x-www-form-urlencoded"}),
        ("/v1/completions", b"\xff\xfe\x00", j),
        ("/v1/completions", b"", j),
        ("/v1/completions", b"null", j),
        ("/v1/completions", b"1e999999", j),
        ("/v1/completions", b'"just a string"', j),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "<|im_start|>x"}]}, j),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": {"$ne": 1}}]}, j),
        ("/v1/chat/completions", {"messages": [{"role": "developer", "content": ["x"]}]}, j),
        ("/v1/chat/completions", {"messages": None}, j),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1e308}, j),
        ("/v1/completions", {"prompt": "hi", "max_tokens": float("nan")}, j),
        ("/v1/completions", {"prompt": "hi", "temperature": float("inf")}, j),
        ("/v1/completions", {"prompt": "hi", "seed": "0"}, j),
        ("/v1/completions", {"prompt": "hi", "stop": ["a"] * 10}, j),
        ("/v1/completions", {"prompt": [-1]}, j),
        ("/v1/completions", {"prompt": [2**70]}, j),
        ("/v1/completions", {"prompt": "hi", "model": None, "n": 0}, j),
        ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": "x"}, j),
    ]
    out += [(p, b, j) for p, b, _ in BAD]  # the malformed-request battery of test_serve_http
    out += [(p, {"prompt": "hi", **e}, j) for p, e, _ in UNSUPPORTED if "chat" not in p]
    out += [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **e}, j)
            for p, e, _ in UNSUPPORTED if "chat" in p]
    return out


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _serve_forever(sock: socket.socket) -> None:  # the child process of the battery
    import uvicorn

    from deviceops.nn.serving.guard import TimedH11Protocol

    toy = ToyLM()
    app = create_app(lambda: Engine(toy, max_batch=4, max_seq=64, max_queue=8),
                     model_name="toy", exposure=Exposure.for_bind("127.0.0.1", api_keys=[KEY]),
                     limits=Limits(max_messages=64, max_prompt_chars=10_000))
    TimedH11Protocol.header_timeout_s = 2.0
    uvicorn.Server(uvicorn.Config(app, log_level="error", http=TimedH11Protocol)).run(
        sockets=[sock])


@pytest.fixture
def server_process() -> Iterator[tuple[str, int]]:
    """The toy server in its own process (its event loop shares no GIL with the clients)."""
    import multiprocessing

    sock = socket.socket()  # TimedH11Protocol turns Nagle off on its connections
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    proc = multiprocessing.get_context("fork").Process(target=_serve_forever, args=(sock,),
                                                       daemon=True)
    proc.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline and proc.is_alive(), "server never became healthy"
        time.sleep(0.05)
    try:
        yield url, int(proc.pid or 0)
    finally:
        proc.terminate()
        proc.join(10)
        sock.close()


def _send_all(url: str, cases: list[tuple[str, bytes, dict[str, str]]], out: Any) -> None:
    """The battery's client (a process of its own: its work shares no GIL with the
    ``/health`` watcher). Puts ``(status, error text)`` per request on ``out``."""
    port = int(url.rsplit(":", 1)[1])
    try:
        with httpx.Client(base_url=url, headers=AUTH, timeout=60) as c:
            for path, content, headers in cases:
                what = f"{path} {content[:60]!r}"
                try:
                    r = c.post(path, content=content, headers=headers)
                except httpx.TransportError as exc:  # counted as a failure: no response
                    out.put((599, f"{what}: no response ({exc!r})"))
                else:
                    out.put((r.status_code, f"{what}: {r.text[:200]}"))
        # raw sockets: an upload abandoned half way, a head that never ends
        for raw in (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"pro",
                    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(raw)
    finally:
        out.put(None)  # the watcher stops at once, whatever happened here


def test_hostile_battery(server_process: tuple[str, int]) -> None:
    import multiprocessing

    url, pid = server_process
    cases = [(p, b if isinstance(b, bytes) else json.dumps(b).encode(), h)
             for p, b, h in _hostile(url)]
    assert len(cases) >= 60
    rss0 = _rss_mb(pid)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    client = ctx.Process(target=_send_all, args=(url, cases, out), daemon=True)
    worst, at = 0.0, 0
    results: list[tuple[int, str]] = []
    with httpx.Client(base_url=url, timeout=30) as c:
        client.start()
        deadline = time.monotonic() + 90
        finished = False
        while not finished:
            t0 = time.perf_counter()
            assert c.get("/health").status_code == 200
            dt = time.perf_counter() - t0
            if dt > worst:
                worst, at = dt, len(results)
            try:
                while True:
                    got = out.get(timeout=0.01)
                    if got is None:
                        finished = True
                        break
                    results.append(got)
            except queue.Empty:
                assert time.monotonic() < deadline, "the battery did not finish"
    client.join(30)
    assert len(results) == len(cases)
    bad = [text for status, text in results if status >= 500]
    assert not bad, bad
    assert worst < 0.1, (f"/health took {worst * 1e3:.0f} ms during the battery, near "
                         f"request {at}: {results[min(at, len(results) - 1)][1][:120]}")
    time.sleep(0.5)
    assert _rss_mb(pid) - rss0 < 50, f"RSS {rss0:.0f} -> {_rss_mb(pid):.0f} MB"
    with httpx.Client(base_url=url, headers=AUTH, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
        m = c.get("/metrics").text
    assert 'status="413"' in m and 'status="415"' in m and 'status="499"' in m


def test_streams_cut_at_shutdown_end_with_a_final_chunk_and_done() -> None:
    """Shutdown past the drain time (``AppState.abort_streams``, what ``serve`` calls at
    ``--drain-timeout`` after SIGTERM): each of 16 streams still running gets a final chunk
    with ``finish_reason: "abort"`` and ``data: [DONE]``; a non-streamed request its text so
    far with the same reason."""
    toy = ToyLM(max_batch=17, max_seq=64, delay=0.1)
    app = create_app(lambda: Engine(toy, max_batch=17, max_seq=64, max_queue=32),
                     model_name="toy")
    results: list[list[Any]] = [[] for _ in range(16)]
    plain: list[Any] = []
    with ServerThread(app) as srv:
        srv.wait_healthy()

        def client(i: int) -> None:
            body = {"prompt": "ab", "max_tokens": 60, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        results[i].append(data if data == "[DONE]" else json.loads(data))

        def one_plain() -> None:
            body = {"prompt": "ab", "max_tokens": 60, "ignore_eos": True}
            plain.append(httpx.post(srv.url + "/v1/completions", json=body, timeout=60))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
        threads.append(threading.Thread(target=one_plain))
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while sum(bool(r) for r in results) < 16 or len(app.state.serve.live) < 17:
            assert time.monotonic() < deadline, ([len(r) for r in results], len(app.state.serve.live))
            time.sleep(0.01)
        assert app.state.serve.abort_streams() == 17
        for t in threads:
            t.join(30)
    for events in results:
        assert events[-1] == "[DONE]", events[-3:]
        assert events[-2]["choices"][0]["finish_reason"] == "abort", events[-2]
        assert 0 < len(events) - 2 < 60  # cut before the end
    r = plain[0]
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "abort"


def test_the_official_openai_client(server: ServerThread) -> None:
    """The ``openai`` package against the server: listing and retrieving models, chat and
    completions (streamed and not), and each refusal surfacing as the client's own error."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == ["toy"]
    assert client.models.retrieve("toy").id == "toy"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    msgs = [{"role": "developer", "content": "x"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="toy", messages=msgs, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="toy", messages=msgs, max_tokens=4, temperature=0, stream=True) if c.choices)
    assert text == r.choices[0].message.content
    c = client.completions.create(model="toy", prompt="ab", max_tokens=3, temperature=0, n=None)
    assert len(c.choices) == 1
    with pytest.raises(openai.NotFoundError) as e404:
        client.completions.create(model="gpt-4", prompt="ab", max_tokens=3)
    assert e404.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e400:
        client.chat.completions.create(model="toy", messages=msgs,
                                       response_format={"type": "json_object"})
    assert e400.value.param == "response_format"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_completions_echo(server: ServerThread) -> None:
    """``echo``: the prompt's text comes first, streamed or not, for a text or token prompt."""
    toy = ToyLM()
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        body = {"prompt": "abc", "max_tokens": 4, "temperature": 0}
        plain = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
        echoed = c.post("/v1/completions", json={**body, "echo": True}).json()
        assert echoed["choices"][0]["text"] == "abc" + plain
        assert echoed["usage"]["completion_tokens"] == 4
        ids = [1, 2, 3]
        r = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "echo": True,
                                            "temperature": 0})
        assert r.json()["choices"][0]["text"].startswith(toy.decode(ids))
        with c.stream("POST", "/v1/completions", json={**body, "echo": True,
                                                       "stream": True}) as st:
            chunks = [json.loads(line[6:]) for line in st.iter_lines()
                      if line.startswith("data: {")]
        assert chunks[0]["choices"][0]["text"] == "abc"
        assert "".join(ch["choices"][0]["text"] for ch in chunks) == "abc" + plain

