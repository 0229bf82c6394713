"""The guard's key and ``Host`` checks against near misses (issue 43, point 6).

An independent mutation run found that a wrong API-key comparison or a loose ``Host`` check
passed the whole suite (which only tried a plainly wrong key and a plainly foreign host).
Here every check meets the inputs a sloppy comparison lets through: keys that are a prefix,
an extension, a case change or a whitespace variant of a real one, an empty bearer, the
scheme without a key, other schemes; hosts that start, end or contain an allowed name
(``localhost.evil.com``, ``127.0.0.1.nip.io``, ``evil.com#localhost``), ports that are not
ports, bracketed IPv6 with a tail; paths that look like the open ``/health``. The accepted
forms (scheme and host names in any case, a numeric port, several spaces after ``Bearer``)
are checked alongside, so a check made too strict fails as well.

The scope is handed to the guard directly (the header bytes exactly as written) and, for a
sample, sent over a socket to uvicorn with the serving protocols (h11's and httptools'
parsing in front).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import uvicorn

from deviceops.nn.serving import guard
from deviceops.nn.serving.guard import LOOPBACK_HOSTS, Exposure, Guard

KEY = "sk-test-1"
OTHER = "k2-Ünï🔑"  # a second key, not ASCII: compared as the header's UTF-8 bytes


async def _ok(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _status(exposure: Exposure, headers: list[tuple[bytes, bytes]], path: str = "/v1/models",
            method: str = "GET") -> int:
    """The status the guard (in front of an app answering 200) gives this request head."""
    sent: list[Any] = []

    async def receive() -> Any:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(m: Any) -> None:
        sent.append(m)

    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    anyio.run(Guard(_ok, exposure), scope, receive, send)
    return int(sent[0]["status"])


def _auth(value: bytes | None, host: bytes = b"127.0.0.1:8000") -> list[tuple[bytes, bytes]]:
    h = [(b"host", host)]
    return h if value is None else [*h, (b"authorization", value)]


KEYED = Exposure.for_bind("127.0.0.1", api_keys=[KEY, OTHER])

# -- API keys ---------------------------------------------------------------------------------
REFUSED_AUTH: list[bytes | None] = [
    None,  # no header
    b"",
    b"Bearer",  # the scheme without a key
    b"Bearer ",  # an empty bearer
    b"Bearer    ",
    b"Bearer sk-test-",  # a prefix of the key
    b"Bearer sk",
    b"Bearer s",
    b"Bearer sk-test-1x",  # the key extended
    b"Bearer sk-test-12",
    b"Bearer xsk-test-1",
    b"Bearer sk-test-1sk-test-1",
    b"Bearer SK-TEST-1",  # a case change
    b"Bearer Sk-test-1",
    b"Bearer sk-Test-1",
    b"Bearer sk-test-1 x",  # the key, whitespace, more
    b"Bearer sk-test-1 sk-test-1",
    b"Bearer sk-test -1",  # whitespace inside
    b"Bearer sk-test-1\tx",
    b"Bearer sk -test-1",
    b"Bearer sk-test-1\x00",
    b"Bearer sk-test-1,",
    b"Bearer k2-\xc3\x9cn\xc3\xaf",  # a prefix of the second key
    b"Bearer K2-\xc3\x9cN\xc3\x8f\xf0\x9f\x94\x91",  # its case changed
    b"Bearer k2-\xdcn\xef\xf0\x9f\x94\x91",  # its latin-1 spelling (other bytes)
    b"Basic sk-test-1",  # other schemes, or none
    b"Token sk-test-1",
    b"Bearersk-test-1",
    b"Bearer:sk-test-1",
    b"Bearer\tsk-test-1",
    b"sk-test-1",
    b"sk-test-1 Bearer",
    b"Bearer Bearer sk-test-1",
    b"X Bearer sk-test-1",
    b"Bearer-sk-test-1",
]
ACCEPTED_AUTH = [
    b"Bearer sk-test-1",
    b"bearer sk-test-1",  # the scheme is case-insensitive (RFC 9110)
    b"BEARER sk-test-1",
    b"Bearer  sk-test-1",  # 1*SP after the scheme (RFC 6750)
    b"Bearer sk-test-1 ",  # trailing whitespace is not part of a field value
    "Bearer k2-Ünï🔑".encode(),  # the second key, as UTF-8 bytes
]


@pytest.mark.parametrize("value", REFUSED_AUTH, ids=repr)
def test_near_miss_keys_are_refused(value: bytes | None) -> None:
    assert _status(KEYED, _auth(value)) == 401
    assert _status(KEYED, _auth(value), "/v1/completions", "POST") == 401


@pytest.mark.parametrize("value", ACCEPTED_AUTH, ids=repr)
def test_the_keys_are_accepted_in_every_legal_spelling(value: bytes) -> None:
    assert _status(KEYED, _auth(value)) == 200


def test_a_single_key_and_the_key_check_alone() -> None:
    one = Exposure.for_bind("127.0.0.1", api_keys=["", "abc"])  # empty keys are dropped
    assert one.api_keys == ("abc",)
    assert one.key_ok("Bearer abc")
    for bad in ("", "Bearer", "Bearer ", "Bearer ab", "Bearer abcd", "Bearer ABC", "Bearer  ",
                "Bearer a bc", "Bearer abc abc", "Basic abc", "abc"):
        assert not one.key_ok(bad), bad
    assert Exposure.for_bind("127.0.0.1", api_keys=[""]).key_ok("")  # no key configured: open


@pytest.mark.parametrize("path", ["/health/", "/healthz", "/v1/health", "/health/../v1/models",
                                  "//health", "/HEALTH", "/v1/models", "/metrics", "/"])
def test_only_the_open_path_itself_skips_the_key(path: str) -> None:
    assert _status(KEYED, _auth(None), "/health") == 200
    assert _status(KEYED, _auth(None), path) == 401
    assert _status(KEYED, _auth(b"Bearer sk-test-"), path) == 401


# -- Host -------------------------------------------------------------------------------------
LOOPBACK = Exposure.for_bind("127.0.0.1")
REFUSED_HOSTS = [
    "localhost.evil.com", "localhost.evil.com:8000", "LOCALHOST.EVIL.COM",
    "127.0.0.1.nip.io", "127.0.0.1.nip.io:8000",
    "evil.com#localhost", "evil.com#@localhost", "evil.com?localhost", "evil.com/localhost",
    "localhost@evil.com", "evil.com:localhost", "evil.com:127.0.0.1",
    "notlocalhost", "evil-localhost", "xlocalhost", "localhostx", "localhost-evil",
    "127.0.0.10", "127.0.0.1x", "127.0.0.1.", "0.0.0.0", "127.1", "2130706433",
    "localhost:evil", "localhost:8000.evil.com", "localhost:80:80", "localhost:\uff18\uff10",
    "local host", "localhost .evil.com",
    "[::1].evil.com", "[::1]evil", "[::1]:8000x", "[::1]:evil.com", "[::1", "[::2]", "::1.evil",
    "[::ffff:7f00:1].evil", "",
]
ACCEPTED_HOSTS = ["localhost", "LOCALHOST", "LocalHost:8000", "localhost:8000", "localhost:",
                  "127.0.0.1", "127.0.0.1:8000", "[::1]", "[::1]:8000", "::1", " localhost "]


@pytest.mark.parametrize("host", REFUSED_HOSTS, ids=repr)
def test_look_alike_hosts_are_refused(host: str) -> None:
    assert not LOOPBACK.host_ok(host)
    assert _status(LOOPBACK, [(b"host", host.encode())], "/health") == 400


@pytest.mark.parametrize("host", ACCEPTED_HOSTS, ids=repr)
def test_loopback_names_any_case_with_a_port_are_accepted(host: str) -> None:
    assert LOOPBACK.host_ok(host)
    assert _status(LOOPBACK, [(b"host", host.encode())], "/health") == 200


def test_a_request_without_host_is_refused() -> None:
    assert _status(LOOPBACK, [], "/health") == 400
    assert _status(Exposure.for_bind("0.0.0.0"), [], "/health") == 200  # any host: no check


@pytest.mark.parametrize("bind", [*LOOPBACK_HOSTS, "127.0.0.5"])
def test_every_loopback_bind_refuses_foreign_hosts(bind: str) -> None:
    ex = Exposure.for_bind(bind)
    assert "*" not in ex.allowed_hosts
    for host in ("evil.com", f"{bind}.evil.com", "localhost.evil.com", "attacker.example:8000"):
        assert not ex.host_ok(host), (bind, host)
    for host in ("localhost:8000", "127.0.0.1", "[::1]:8000"):
        assert ex.host_ok(host), (bind, host)
    named = f"[{bind}]:8000" if ":" in bind else f"{bind}:8000"
    assert ex.host_ok(named), bind


@pytest.mark.parametrize("bind", ["0.0.0.0", "::", "192.168.1.10"])
def test_other_binds_accept_any_host_unless_told(bind: str) -> None:
    assert Exposure.for_bind(bind).host_ok("anything.example")
    ex = Exposure.for_bind(bind, allowed_hosts=[" API.Example.com ", "10.0.0.2"])
    assert ex.allowed_hosts == ("api.example.com", "10.0.0.2")
    for host in ("api.example.com", "API.EXAMPLE.COM:443", "10.0.0.2:8000"):
        assert ex.host_ok(host), host
    for host in ("api.example.com.evil.net", "evil.api.example.com", "api.example",
                 "example.com", "10.0.0.20", "10.0.0.2.nip.io", "evil.com#api.example.com"):
        assert not ex.host_ok(host), host


# -- the same over a socket, through uvicorn's HTTP parsers (h11, httptools) -------------------
PROTOCOLS = [n for n in ("TimedH11Protocol", "TimedHttpToolsProtocol") if hasattr(guard, n)]


@pytest.fixture(scope="module", params=PROTOCOLS)
def port(request: pytest.FixtureRequest) -> Iterator[int]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(Guard(_ok, KEYED), http=getattr(guard, request.param),
                                           log_level="warning"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and t.is_alive(), "server did not start"
        time.sleep(0.01)
    yield int(sock.getsockname()[1])
    server.should_exit = True
    t.join(10)
    sock.close()


def _wire_status(port: int, host: bytes, auth: bytes | None) -> int:
    head = b"GET /v1/models HTTP/1.1\r\nHost: " + host + b"\r\n"
    if auth is not None:
        head += b"Authorization: " + auth + b"\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + b"Connection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    return int(data.split(b" ", 2)[1])


@pytest.mark.parametrize("host, auth, status", [
    (b"127.0.0.1", b"Bearer sk-test-1", 200),
    (b"LOCALHOST:8000", b"bearer   sk-test-1  ", 200),
    (b"[::1]:8000", "Bearer k2-Ünï🔑".encode(), 200),
    (b"127.0.0.1", b"Bearer sk-test-", 401),
    (b"127.0.0.1", b"Bearer sk-test-1x", 401),
    (b"127.0.0.1", b"Bearer SK-TEST-1", 401),
    (b"127.0.0.1", b"Bearer", 401),
    (b"127.0.0.1", b"Bearer ", 401),
    (b"127.0.0.1", b"Bearer sk-test-1 x", 401),
    (b"127.0.0.1", b"Basic sk-test-1", 401),
    (b"localhost.evil.com", b"Bearer sk-test-1", 400),
    (b"127.0.0.1.nip.io:8000", b"Bearer sk-test-1", 400),
    (b"evil.com#localhost", b"Bearer sk-test-1", 400),
    (b"[::1].evil.com", b"Bearer sk-test-1", 400),
])
def test_over_the_wire(port: int, host: bytes, auth: bytes, status: int) -> None:
    assert _wire_status(port, host, auth) == status
