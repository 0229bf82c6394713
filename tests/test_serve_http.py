"""The HTTP server (Starlette + uvicorn on 127.0.0.1) over the toy StepModel.

Real uvicorn on a free localhost port in a thread, driven by an httpx client: OpenAI
response shapes, SSE ending with ``data: [DONE]``, the bad-request battery, 429/503 with
``Retry-After``, client disconnects cancelling generations, ``/metrics``. The same tests
against the real SmolLM2 on the cpu backend are in ``test_serve_smollm2.py``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import anyio
import httpx
import pytest
import uvicorn

from deviceops.nn.serving.engine import Engine
from deviceops.nn.serving.http import create_app

from .test_engine import Toy

pytestmark = [pytest.mark.timeout(90)]


class ToyLM(Toy):
    """The toy with text: token t is the letter ``chr(97 + t % 26)``."""

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(97 + t % 26) for t in ids)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class ServerThread:
    """uvicorn serving ``app`` on a free 127.0.0.1 port in a daemon thread."""

    def __init__(self, app: Any) -> None:
        self.app = app
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say so, and
        # without it every keep-alive response waits ~40 ms (Nagle + delayed ACK)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            assert self.thread.is_alive(), "server thread died"
            time.sleep(0.01)
        return self

    def wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while httpx.get(self.url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "server never became healthy"
            time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
        self.sock.close()
        assert not self.thread.is_alive(), "server did not stop"

    @property
    def engine(self) -> Engine:
        eng = self.app.state.serve.engine
        assert eng is not None
        return eng  # type: ignore[no-any-return]


def wait_until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def sse_events(lines: Iterator[str]) -> list[Any]:
    """Parse an SSE body: the JSON payloads, then the string '[DONE]'."""
    out: list[Any] = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.fixture
def toy_server() -> Iterator[ServerThread]:
    toy = ToyLM(max_batch=4, max_seq=64, delay=0.002)
    app = create_app(lambda: Engine(toy, max_batch=4, max_seq=64, max_queue=8),
                     model_name="toy")
    with ServerThread(app) as srv:
        srv.wait_healthy()
        srv.toy = toy  # type: ignore[attr-defined]
        yield srv


def test_completions_chat_models_and_metrics(toy_server: ServerThread) -> None:
    url, toy = toy_server.url, toy_server.toy  # type: ignore[attr-defined]
    with httpx.Client(base_url=url, timeout=30) as c:
        assert c.get("/health").json()["status"] == "ok"
        models = c.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["toy"]
        ids = toy.encode("hello")
        want = toy.decode(toy.reference(ids, 7))
        r = c.post("/v1/completions", json={"model": "toy", "prompt": "hello", "max_tokens": 7,
                                            "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion"
        assert body["choices"][0]["text"] == want
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
        # token-id prompt, streamed
        with c.stream("POST", "/v1/completions", json={
                "prompt": ids, "max_tokens": 7, "temperature": 0, "stream": True}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            ev = sse_events(r.iter_lines())
        assert ev[-1] == "[DONE]"
        assert "".join(e["choices"][0]["text"] for e in ev[:-1]) == want
        assert ev[-2]["choices"][0]["finish_reason"] == "length"
        # chat
        msgs = [{"role": "user", "content": "hi"}]
        chat_ids = toy.encode(toy.apply_chat_template(msgs))
        want = toy.decode(toy.reference(chat_ids, 5))
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 5,
                                                 "temperature": 0.0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": want}
        with c.stream("POST", "/v1/chat/completions", json={
                "messages": msgs, "max_tokens": 5, "temperature": 0, "stream": True}) as r:
            ev = sse_events(r.iter_lines())
        assert ev[-1] == "[DONE]" and ev[0]["choices"][0]["delta"] == {"role": "assistant"}
        assert ev[0]["object"] == "chat.completion.chunk"
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in ev[:-1]) == want
        # text stop string: cut before it, finish_reason stop
        full = toy.decode(toy.reference(ids, 12))
        stop = full[4:6]
        r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 12,
                                            "temperature": 0, "stop": [stop]})
        assert r.json()["choices"][0]["text"] == full[: full.index(stop)]
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        m = c.get("/metrics").text
        for name in ("deviceops_http_requests_total", "deviceops_generated_tokens_total",
                     "deviceops_time_to_first_token_seconds_bucket",
                     "deviceops_inter_token_latency_seconds_bucket",
                     "deviceops_engine_batch_occupancy", "deviceops_kv_slots_in_use",
                     "deviceops_kv_blocks_in_use"):
            assert name in m, name
        assert 'deviceops_http_requests_total{endpoint="completions",status="200"} 3.0' in m
        assert "deviceops_kv_slots_in_use 0.0" in m
    assert toy_server.engine.stats().slots_in_use == 0


BAD: list[tuple[str, Any, str | None]] = [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", [1, 2], None),
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "4"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": "x"}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -3}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, "n"),  # more than MAX_N choices
    ("/v1/completions", {"prompt": "hi", "stop": [1]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "seed": 1.5}, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "hi", "ignore_eos": 1}, "ignore_eos"),
    ("/v1/completions", {"prompt": "hi", "stream_options": []}, "stream_options"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [3]]}, "prompt"),
    ("/v1/completions", {"prompt": [True, 2]}, "prompt"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": ["hi"]}, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"prompt": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]},
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
     "messages[0].content"),
]
# bad for the toy's context (max_seq 64, vocab 97)
BAD_TOY = [
    ("/v1/completions", {"prompt": "x" * 64}, "prompt"),
    ("/v1/completions", {"prompt": [1, 10**6]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 80}]}, "messages"),
]


def test_bad_request_battery(toy_server: ServerThread) -> None:
    with httpx.Client(base_url=toy_server.url, timeout=30) as c:
        for path, body, param in BAD + BAD_TOY:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = c.post(path, content=content, headers={"content-type": "application/json"})
            assert r.status_code == 400, (body, r.status_code, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["message"], body
            assert err["param"] == param, (body, err)
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
        assert c.get("/v1/nothing").status_code == 404
    st = toy_server.engine.stats()
    assert (st.slots_in_use, st.queued) == (0, 0)


def test_overload_429_and_disconnects_cancel() -> None:
    toy = ToyLM(max_batch=1, max_seq=64, delay=0.02)
    app = create_app(lambda: Engine(toy, max_batch=1, max_seq=64, max_queue=1), model_name="toy")
    with ServerThread(app) as srv:
        srv.wait_healthy()

        async def main() -> None:
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
                body = {"prompt": "hello", "max_tokens": 40, "stream": True}
                async with c.stream("POST", "/v1/completions", json=body) as a:
                    assert a.status_code == 200
                    lines = a.aiter_lines()
                    first = await lines.__anext__()  # a holds the only slot
                    assert first.startswith("data: ")
                    async with anyio.create_task_group() as tg:
                        async def queued() -> None:  # b waits in the queue ...
                            r = await c.post("/v1/completions", json={
                                "prompt": "hello", "max_tokens": 3})
                            assert r.status_code == 200
                        tg.start_soon(queued)
                        with anyio.fail_after(10):
                            while srv.engine.stats().queued < 1:
                                await anyio.sleep(0.01)
                        r = await c.post("/v1/completions", json={"prompt": "hi"})  # c: full
                        assert r.status_code == 429, r.text
                        assert int(r.headers["retry-after"]) >= 1
                        assert r.json()["error"]["type"] == "rate_limit_exceeded"
                        # a disconnects mid-stream: its slot goes to b
                        await a.aclose()
                with anyio.fail_after(10):
                    while srv.engine.stats().slots_in_use or srv.engine.stats().queued:
                        await anyio.sleep(0.01)
                # a non-streaming client that times out (disconnects) is cancelled too
                with pytest.raises(httpx.ReadTimeout):
                    await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 50},
                                 timeout=0.3)
                with anyio.fail_after(10):
                    while srv.engine.stats().slots_in_use:
                        await anyio.sleep(0.01)

        anyio.run(main)
        st = srv.engine.stats()
        assert st.cancelled == 2 and st.finished == 1, st
        m = httpx.get(srv.url + "/metrics").text
        assert 'deviceops_generations_total{reason="cancelled"} 2.0' in m
        assert 'status="429"' in m


def test_health_503_until_loaded_and_while_draining() -> None:
    release = threading.Event()
    toy = ToyLM()

    def load() -> Engine:
        assert release.wait(30)
        return Engine(toy, max_batch=2, max_seq=64)

    app = create_app(load, model_name="toy", retry_after=3)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.headers["retry-after"] == "3"
        assert r.json()["status"] == "loading"
        r = c.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and r.headers["retry-after"] == "3"
        assert "deviceops_http_requests_total" in c.get("/metrics").text
        release.set()
        srv.wait_healthy(30)
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        app.state.serve.draining = True
        assert c.get("/health").status_code == 503
        r = c.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]


def test_load_failure_is_reported() -> None:
    def load() -> Engine:
        raise FileNotFoundError("no weights here")

    with ServerThread(create_app(load, model_name="toy")) as srv:
        wait_until(lambda: srv.app.state.serve.load_error is not None, what="load error")
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and "no weights here" in r.json()["error"]
