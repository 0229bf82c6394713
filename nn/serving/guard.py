"""What stands between the network and the OpenAI routes: keys, hosts, bodies, timeouts.

A server bound to a port is reachable by more than its intended clients: a web page in a
browser on the same machine can reach ``127.0.0.1`` through DNS rebinding (a foreign
``Host`` header) or a plain form post (``text/plain``, no CORS preflight), and anyone on
the network can send a 100 MB body or hold a connection open without finishing its
headers. :class:`Guard` is a pure ASGI middleware that refuses all of those before a
route runs, in OpenAI's error shape::

    {"error": {"message": ..., "type": ..., "param": null, "code": ...}}

| check | refusal |
|---|---|
| ``Host`` not in ``allowed_hosts`` (default: loopback names when bound to loopback) | 400 ``host_not_allowed`` |
| ``Authorization: Bearer <key>`` missing or not one of ``api_keys`` (``/health`` open) | 401 ``invalid_api_key`` |
| a request body whose ``Content-Type`` is not ``application/json`` | 415 ``unsupported_media_type`` |
| a body over ``max_body_bytes`` (declared or streamed) | 413 ``request_too_large``, then close |
| a body not complete within ``body_timeout_s`` | 408 ``request_timeout`` |
| the client goes away while uploading | no response; counted as 499, one log line |

Before a 413 the guard reads and drops what is left of the upload, up to
:data:`DRAIN_FACTOR` times ``max_body_bytes`` and within ``body_timeout_s``: a server that
closes a socket with unread data makes TCP reset the connection, and a client still
uploading then loses the response it was sent. A body declared larger than that is answered
at once; its client may see a reset instead of the 413.

The body is read here (bounded) and handed to the route from memory, so a route never
waits on a slow upload. :func:`parse_json` turns bytes into a request object and refuses
what would otherwise surface as a 500 deeper in: invalid UTF-8, nesting deeper than
:data:`MAX_DEPTH`, lone surrogates (``"a\\ud800b"``) in any string.

:class:`TimedH11Protocol` is uvicorn's HTTP/1.1 protocol with two additions: a connection
that has not sent a complete request head within ``header_timeout_s`` of opening (or of
its previous response) is closed, so idle and half-sent connections do not pile up; and
TCP connections send without Nagle's delay, whatever socket uvicorn was given.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["DRAIN_FACTOR", "MAX_DEPTH", "Exposure", "Guard", "InvalidJSON", "HeadTimeout", "TimedH11Protocol",
           "TimedHttpToolsProtocol",
           "openai_error_body", "parse_json"]

log = logging.getLogger("deviceops.nn.serve")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
MAX_DEPTH = 64
DRAIN_FACTOR = 4
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def openai_error_body(message: str, kind: str, code: str | None,
                      param: str | None = None) -> dict[str, Any]:
    """An error object in OpenAI's shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class Exposure:
    """Who may reach the server and with what (the ``serve`` flags of the same names).

    Attributes:
        api_keys: accepted bearer keys; empty: no key needed.
        allowed_hosts: accepted ``Host`` names (no port), ``("*",)`` for any.
        max_body_bytes: largest request body.
        body_timeout_s: time allowed to upload a body once the head has arrived.
        cors_origins: origins a browser may call from (empty: no CORS headers at all).
        open_paths: paths served without a key (monitoring).
    """

    api_keys: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ("*",)
    max_body_bytes: int = 4 << 20
    body_timeout_s: float = 30.0
    cors_origins: tuple[str, ...] = ()
    open_paths: frozenset[str] = field(default_factory=lambda: frozenset({"/health"}))

    @classmethod
    def for_bind(cls, bind_host: str, *, api_keys: Iterable[str] = (),
                 allowed_hosts: Iterable[str] | None = None, **kw: Any) -> Exposure:
        """The defaults for a server bound to ``bind_host``: loopback names only when it is
        a loopback address, any host otherwise (unless ``allowed_hosts`` says)."""
        keys = tuple(k for k in api_keys if k)
        hosts: tuple[str, ...]
        if allowed_hosts is None:
            loop = bind_host in LOOPBACK_HOSTS or bind_host.startswith("127.")
            hosts = (*LOOPBACK_HOSTS, bind_host) if loop else ("*",)
        else:
            hosts = tuple(h.strip().lower() for h in allowed_hosts if h.strip())
            if not hosts:
                raise ValueError("allowed_hosts is empty: name at least one host, or '*'")
        return cls(api_keys=keys, allowed_hosts=tuple(dict.fromkeys(hosts)), **kw)

    def host_ok(self, host_header: str) -> bool:
        """Whether a ``Host`` header names an allowed host: the whole name, compared without
        case, with an optional numeric port (``localhost:8000``, ``[::1]:8000``); anything
        else after the name (``localhost.evil.com``, ``[::1].evil``, ``localhost:x``) is
        another host."""
        if "*" in self.allowed_hosts:
            return True
        name = _host_name(host_header)
        return name is not None and name in self.allowed_hosts

    def key_ok(self, authorization: str) -> bool:
        """Whether an ``Authorization`` header is ``Bearer <key>`` (scheme without case,
        one or more spaces) with one of :attr:`api_keys`, byte for byte."""
        if not self.api_keys:
            return True
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False
        try:  # the header's own bytes (read as latin-1), so a non-ASCII key matches too
            given = token.strip().encode("latin-1")
        except UnicodeEncodeError:  # text that did not come from a header: its UTF-8
            given = token.strip().encode()
        # every key compared, in constant time, so timing says nothing about which matched
        return any([hmac.compare_digest(given, k.encode()) for k in self.api_keys])


def _host_name(header: str) -> str | None:
    """The host of a ``Host`` header (lower case, without its port), or ``None`` when the
    header is not ``host[:port]``."""
    h = header.strip().lower()
    if h.startswith("["):  # [::1]:8000
        end = h.find("]")
        if end < 0:
            return None
        name, rest = h[1:end], h[end + 1:]
    elif h.count(":") == 1:
        name, _, port = h.partition(":")
        rest = ":" + port
    else:  # a name without a port (or a bare IPv6 address)
        name, rest = h, ""
    if rest and not (rest[0] == ":" and rest[1:].isascii() and (rest[1:].isdigit() or rest == ":")):
        return None
    return name


class _Refused(Exception):
    def __init__(self, status: int, message: str, kind: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code


class _Disconnected(Exception):
    pass


class Guard:
    """ASGI middleware enforcing an :class:`Exposure` on every HTTP request.

    Args:
        app: the application behind it.
        exposure: the rules.
        on_status: called with ``(path, status)`` for each request the guard answers
            itself (and ``499`` for an upload the client abandoned), for metrics.
    """

    def __init__(self, app: ASGIApp, exposure: Exposure,
                 on_status: Callable[[str, int], None] | None = None) -> None:
        self.app = app
        self.exposure = exposure
        self.on_status = on_status

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        try:
            self._check_head(scope)
            if scope.get("method") in _BODY_METHODS:
                body = await self._read_body(scope, receive)
                receive = _replay(body, receive)
        except _Refused as r:
            self._count(path, r.status)
            if r.status == 413:
                await self._drain(scope, receive)
            close = {"connection": "close"} if r.status in (408, 413) else None
            await JSONResponse(openai_error_body(r.message, r.kind, r.code),
                               status_code=r.status, headers=close)(scope, receive, send)
            return
        except _Disconnected:
            self._count(path, 499)
            log.info("%s %s: the client closed the connection while sending the body (499)",
                     scope.get("method"), path)
            return
        await self.app(scope, receive, send)

    def _count(self, path: str, status: int) -> None:
        if self.on_status is not None:
            self.on_status(path, status)

    def _check_head(self, scope: Scope) -> None:
        ex = self.exposure
        headers = _headers(scope)
        host = headers.get("host", "")
        if not ex.host_ok(host):
            raise _Refused(400, f"Host {host!r} is not allowed; the server accepts "
                           f"{', '.join(ex.allowed_hosts)} (serve --allowed-hosts)",
                           "invalid_request_error", "host_not_allowed")
        if scope.get("path") not in ex.open_paths and not ex.key_ok(
                headers.get("authorization", "")):
            raise _Refused(401, "Incorrect or missing API key: send 'Authorization: Bearer "
                           "<key>' with a key the server was started with (serve --api-key)",
                           "invalid_request_error", "invalid_api_key")
        if scope.get("method") in _BODY_METHODS:
            ctype = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if ctype != "application/json":
                raise _Refused(415, f"Content-Type must be application/json, got "
                               f"{ctype or 'none'!r}", "invalid_request_error",
                               "unsupported_media_type")
            declared = headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > ex.max_body_bytes:
                raise self._too_large()

    async def _drain(self, scope: Scope, receive: Receive) -> None:
        """Reads and drops the rest of a refused upload (bounded by :data:`DRAIN_FACTOR`
        and the body timeout) so that its client reads the refusal; see the module notes."""
        left = DRAIN_FACTOR * self.exposure.max_body_bytes
        declared = _headers(scope).get("content-length", "")
        if declared.isdigit() and int(declared) > left:
            return
        with anyio.move_on_after(self.exposure.body_timeout_s):
            while left > 0:
                msg = await receive()
                if msg["type"] == "http.disconnect" or not msg.get("more_body", False):
                    return
                left -= len(msg.get("body", b""))

    def _too_large(self) -> _Refused:
        return _Refused(413, f"request body over the server's limit of "
                        f"{self.exposure.max_body_bytes} bytes", "invalid_request_error",
                        "request_too_large")

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        parts: list[bytes] = []
        size = 0
        try:
            with anyio.fail_after(self.exposure.body_timeout_s):
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        raise _Disconnected
                    chunk = msg.get("body", b"")
                    size += len(chunk)
                    if size > self.exposure.max_body_bytes:
                        raise self._too_large()
                    parts.append(chunk)
                    if not msg.get("more_body", False):
                        return b"".join(parts)
        except TimeoutError:
            raise _Refused(408, f"the request body did not arrive within "
                           f"{self.exposure.body_timeout_s:g} s", "invalid_request_error",
                           "request_timeout") from None


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1")
            for k, v in scope.get("headers", ())}


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the disconnect, when it comes

    return replay


class InvalidJSON(ValueError):
    """A body :func:`parse_json` refuses; the message says why (a 400)."""


def parse_json(raw: bytes) -> Any:
    """Decode a request body, refusing what the routes must never see. Costs a walk over
    the decoded object: call it off the event loop for large bodies.

    Raises:
        InvalidJSON: not UTF-8, not JSON, nested deeper than :data:`MAX_DEPTH`, or a
            string holding a lone surrogate.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidJSON(f"the body is not UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        obj = json.loads(text)
    except RecursionError:
        raise InvalidJSON(f"JSON nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:
        raise InvalidJSON(f"the body is not valid JSON ({e})") from None
    _check(obj)
    return obj


def _check(obj: Any) -> None:
    """Depth and strings of a decoded body, iteratively (no recursion to exhaust)."""
    stack = [(obj, 0)]
    while stack:
        o, depth = stack.pop()
        if isinstance(o, str):
            _check_text(o)
        elif isinstance(o, (dict, list)):
            if depth >= MAX_DEPTH:
                raise InvalidJSON(f"JSON nested deeper than {MAX_DEPTH} levels")
            if isinstance(o, dict):
                for k, v in o.items():
                    _check_text(k)
                    stack.append((v, depth + 1))
            else:
                stack.extend((v, depth + 1) for v in o)


def _check_text(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidJSON(f"a string holds a lone surrogate (U+{ord(s[e.start]):04X} at "
                          f"index {e.start}); send valid Unicode") from None


class HeadTimeout:
    """A mixin for uvicorn's HTTP/1.1 protocols (h11's and httptools', which share the
    ``cycle`` / ``on_response_complete`` surface): it closes a connection whose request head
    does not arrive within :attr:`header_timeout_s` (after opening, or after its previous
    response), and sends without delay on TCP: asyncio turns Nagle's algorithm off only for
    sockets made with ``IPPROTO_TCP`` (not for a socket handed to uvicorn made with the
    defaults), and with it on, a response's body (or a stream's next chunk) waits for the
    client's delayed ACK of the head, about 40 ms on a keep-alive connection.

    ``serve --header-timeout`` sets :attr:`header_timeout_s` here, for both protocols."""

    cycle: Any
    loop: Any
    transport: Any

    header_timeout_s: float = 10.0

    def connection_made(self, transport: Any) -> None:
        _no_delay(transport)
        super().connection_made(transport)  # type: ignore[misc]
        self._head_timer: Any = None
        self._arm()

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._expire,
                                                    self.cycle)

    def _expire(self, cycle: Any) -> None:
        self._head_timer = None
        if self.cycle is cycle and self._between_requests() and not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]
        if self._between_requests():
            self._arm()  # bytes of a head that is not complete yet: the clock runs
        elif self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if self._head_timer is not None:  # a new clock for the next request's head
            self._head_timer.cancel()
            self._head_timer = None
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)  # type: ignore[misc]


class TimedH11Protocol(HeadTimeout, H11Protocol):
    """uvicorn's h11 protocol with :class:`HeadTimeout`."""


class TimedHttpToolsProtocol(HeadTimeout, HttpToolsProtocol):
    """uvicorn's httptools protocol (the fast parser ``serve`` uses) with
    :class:`HeadTimeout`."""


def _no_delay(transport: Any) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):  # not a TCP stream after all: nothing to turn off
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
