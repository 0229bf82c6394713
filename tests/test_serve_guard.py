"""The serving guard: keys, hosts, content types, body limits and timeouts (cpu only)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from deviceops.nn.serving.guard import (
    DRAIN_FACTOR,
    MAX_DEPTH,
    Exposure,
    Guard,
    InvalidJSON,
    TimedH11Protocol,
    parse_json,
)

pytestmark = pytest.mark.anyio


async def _echo(request: Request) -> JSONResponse:
    body = await request.body()
    return JSONResponse({"n": len(body)})


async def _health(request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


def _app(exposure: Exposure, seen: list[tuple[str, int]] | None = None) -> Guard:
    inner = Starlette(routes=[Route("/v1/echo", _echo, methods=["POST"]),
                              Route("/health", _health, methods=["GET"])])
    return Guard(inner, exposure, on_status=(lambda p, s: seen.append((p, s)))
                 if seen is not None else None)


def _client(app: Any, host: str = "127.0.0.1") -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=f"http://{host}")


def _err(r: httpx.Response) -> dict[str, Any]:
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"}, e
    return e


async def test_loopback_bind_refuses_foreign_host_header() -> None:
    seen: list[tuple[str, int]] = []
    app = _app(Exposure.for_bind("127.0.0.1"), seen)
    async with _client(app, "localhost:8000") as c:
        assert (await c.get("/health")).status_code == 200
    async with _client(app, "attacker.example:8000") as c:
        r = await c.get("/health")
    assert r.status_code == 400 and _err(r)["code"] == "host_not_allowed"
    assert "attacker.example" in _err(r)["message"]
    assert seen == [("/health", 400)]


async def test_ipv6_loopback_host_and_any_host_when_bound_elsewhere() -> None:
    async with _client(_app(Exposure.for_bind("::1")), "[::1]:8000") as c:
        assert (await c.get("/health")).status_code == 200
    async with _client(_app(Exposure.for_bind("0.0.0.0")), "anything.example") as c:
        assert (await c.get("/health")).status_code == 200
    ex = Exposure.for_bind("0.0.0.0", allowed_hosts=["api.example"])
    async with _client(_app(ex), "other.example") as c:
        assert (await c.get("/health")).status_code == 400
    with pytest.raises(ValueError, match="allowed_hosts is empty"):
        Exposure.for_bind("0.0.0.0", allowed_hosts=[" "])


async def test_api_keys_required_except_health() -> None:
    app = _app(Exposure.for_bind("127.0.0.1", api_keys=["k1", "k2"]))
    async with _client(app) as c:
        assert (await c.get("/health")).status_code == 200
        r = await c.post("/v1/echo", json={})
        assert r.status_code == 401 and _err(r)["code"] == "invalid_api_key"
        r = await c.post("/v1/echo", json={}, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        r = await c.post("/v1/echo", json={}, headers={"Authorization": "Basic k1"})
        assert r.status_code == 401
        for key in ("k1", "k2"):
            r = await c.post("/v1/echo", json={}, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text


async def test_body_must_be_json() -> None:
    async with _client(_app(Exposure())) as c:
        r = await c.post("/v1/echo", content=b'{"a": 1}', headers={"content-type": "text/plain"})
        assert r.status_code == 415 and _err(r)["code"] == "unsupported_media_type"
        r = await c.post("/v1/echo", content=b"{}")  # no content type at all
        assert r.status_code == 415
        r = await c.post("/v1/echo", content=b"{}",
                         headers={"content-type": "application/json; charset=utf-8"})
        assert r.status_code == 200 and r.json() == {"n": 2}


async def test_body_limit_declared_and_streamed() -> None:
    seen: list[tuple[str, int]] = []
    app = _app(Exposure(max_body_bytes=1000), seen)
    async with _client(app) as c:
        r = await c.post("/v1/echo", content=b"x" * 1001,
                         headers={"content-type": "application/json"})
        assert r.status_code == 413 and _err(r)["code"] == "request_too_large"

        async def chunks() -> Any:  # no content-length: counted as it streams
            for _ in range(5):
                yield b"y" * 300

        r = await c.post("/v1/echo", content=chunks(),
                         headers={"content-type": "application/json"})
        assert r.status_code == 413
        r = await c.post("/v1/echo", content=b"z" * 1000,
                         headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.json() == {"n": 1000}
    assert seen == [("/v1/echo", 413), ("/v1/echo", 413)]


@pytest.mark.parametrize("declared", [None, 4000, 4001, 1_000_000])
async def test_413_reads_the_rest_of_the_upload_first(declared: int | None) -> None:
    """A refused upload is read to its end (up to DRAIN_FACTOR x the limit) before the
    413 goes out, so a client still sending reads the answer instead of a reset; a body
    declared beyond that bound is answered at once."""
    guard = _app(Exposure(max_body_bytes=1000))
    chunks = [{"type": "http.request", "body": b"x" * 500, "more_body": i < 7}
              for i in range(8)]  # 4000 bytes in all
    log: list[str] = []

    async def receive() -> Any:
        log.append("receive")
        return chunks.pop(0) if chunks else {"type": "http.disconnect"}

    async def send(m: Any) -> None:
        log.append(m["type"])
        if m["type"] == "http.response.start":
            assert m["status"] == 413

    headers = [(b"content-type", b"application/json"), (b"host", b"x")]
    if declared is not None:
        headers.append((b"content-length", str(declared).encode()))
    scope = {"type": "http", "method": "POST", "path": "/v1/echo", "headers": headers}
    await guard(scope, receive, send)
    first_send = log.index("http.response.start")
    if declared is not None and declared > DRAIN_FACTOR * 1000:
        assert first_send == 0, log  # nothing read: the declared size alone refuses
    else:
        assert chunks == [] and first_send == log.count("receive"), log


async def test_upload_abort_counts_499_and_sends_nothing() -> None:
    seen: list[tuple[str, int]] = []
    guard = _app(Exposure(), seen)
    sent: list[Any] = []
    msgs = iter([{"type": "http.request", "body": b"{", "more_body": True},
                 {"type": "http.disconnect"}])

    async def receive() -> Any:
        return next(msgs)

    async def send(m: Any) -> None:
        sent.append(m)

    scope = {"type": "http", "method": "POST", "path": "/v1/echo",
             "headers": [(b"content-type", b"application/json"), (b"host", b"x")]}
    await guard(scope, receive, send)
    assert sent == [] and seen == [("/v1/echo", 499)]


async def test_slow_body_times_out_408() -> None:
    guard = _app(Exposure(body_timeout_s=0.2))
    sent: list[Any] = []

    async def receive() -> Any:
        import anyio
        await anyio.sleep(5)
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(m: Any) -> None:
        sent.append(m)

    scope = {"type": "http", "method": "POST", "path": "/v1/echo",
             "headers": [(b"content-type", b"application/json")]}
    t0 = time.perf_counter()
    await guard(scope, receive, send)
    assert time.perf_counter() - t0 < 2
    assert sent[0]["status"] == 408
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_timeout"


@pytest.mark.parametrize("raw, why", [
    (b'{"a": "\\ud800b"}', "lone surrogate"),
    (b'{"\\udfff": 1}', "lone surrogate"),
    (b"[" * 100_000 + b"]" * 100_000, "nested deeper"),
    (b'{"a": ' * (MAX_DEPTH + 1) + b"1" + b"}" * (MAX_DEPTH + 1), "nested deeper"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b"{nope", "not valid JSON"),
])
def test_parse_json_refuses(raw: bytes, why: str) -> None:
    with pytest.raises(InvalidJSON, match=why):
        parse_json(raw)


def test_parse_json_accepts_ordinary_bodies() -> None:
    deep = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    assert parse_json(deep) is not None
    assert parse_json('{"s": "[{ \\" é 😀 \\ud83d\\ude00"}'.encode()) == {"s": '[{ " é 😀 😀'}


@pytest.fixture
def server_port() -> Iterator[int]:
    TimedH11Protocol.header_timeout_s = 0.5
    app = _app(Exposure())
    # a socket made with the defaults (proto 0): asyncio leaves Nagle's algorithm on for
    # its connections; TimedH11Protocol turns it off (test_keep_alive_responses_go_out_at_once)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, http=TimedH11Protocol, log_level="warning",
                            timeout_keep_alive=30)
    server = uvicorn.Server(config)
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        t.join(5)
        TimedH11Protocol.header_timeout_s = 10.0


def _closed_within(s: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``s`` within ``seconds`` (what it still sends is read)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        s.settimeout(left)
        try:
            if s.recv(4096) == b"":
                return True
        except TimeoutError:
            return False
    return False


def test_idle_and_half_sent_connections_are_closed(server_port: int) -> None:
    idle = socket.create_connection(("127.0.0.1", server_port))
    half = socket.create_connection(("127.0.0.1", server_port))
    half.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the head never ends
    assert _closed_within(idle, 3) and _closed_within(half, 3)
    # a complete request is answered, then the connection idles out too
    ok = socket.create_connection(("127.0.0.1", server_port))
    ok.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    ok.settimeout(3)
    assert ok.recv(4096).startswith(b"HTTP/1.1 200")
    assert _closed_within(ok, 3)
    for s in (idle, half, ok):
        s.close()


def test_keep_alive_responses_go_out_at_once(server_port: int) -> None:
    """With Nagle's algorithm on, each response on a kept-alive connection waits ~40 ms
    for the client's delayed ACK of its head; TimedH11Protocol turns it off."""
    with httpx.Client(base_url=f"http://127.0.0.1:{server_port}", timeout=10) as c:
        c.get("/health")  # the connection is open and warm
        took = []
        for _ in range(7):
            t0 = time.perf_counter()
            assert c.get("/health").status_code == 200
            took.append(time.perf_counter() - t0)
    took.sort()
    assert took[3] < 0.025, f"median {took[3] * 1e3:.1f} ms per kept-alive /health"
