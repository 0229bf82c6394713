"""The server's request log and start-up messages (``python -m deviceops.nn.serve``).

* :class:`AccessLog`, an ASGI middleware: one INFO line per HTTP request, when its response
  has been sent in full (a stream included)::

      POST /v1/chat/completions 200 12 tokens 0.84 s
      GET /v1/models 200 - 0.001 s

  method, path, status, the tokens generated (``-`` for a request that generated nothing:
  the route handler puts its request stream in the ASGI scope under
  :data:`SCOPE_KEY`), and the time from the request's arrival to its last byte. Polls of
  ``/health`` (a readiness loop asks every second) are logged at DEBUG when they answer
  200 or 503 (ready, not ready), so the default level shows only the requests that did
  something; any other status of theirs is logged at INFO.
* :class:`ListeningFilter`: uvicorn logs "Uvicorn running on http://...", which reads as if
  the server could serve while the model is still loading (seconds; ``/health`` is 503 until
  then). The filter rewords it to "listening on http://...: loading the model"; the app logs
  "ready: ..." once the model is loaded (:mod:`.http`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["POLLED_PATHS", "SCOPE_KEY", "AccessLog", "ListeningFilter", "request_level",
           "request_line"]

SCOPE_KEY = "deviceops.request"  # the RequestStream of a generation request (set by :mod:`.http`)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger("deviceops.nn.serve")


def request_line(method: str, path: str, status: int, tokens: int | None, seconds: float) -> str:
    """The access-log line: ``POST /v1/completions 200 12 tokens 0.84 s``."""
    tok = "-" if tokens is None else f"{tokens} tokens"
    return f"{method} {path} {status} {tok} {seconds:.3f} s"


#: paths whose 200/503 answers are polls, logged at DEBUG (the module docstring)
POLLED_PATHS = frozenset({"/health"})


def request_level(path: str, status: int) -> int:
    """The level of a request's line: DEBUG for a poll of :data:`POLLED_PATHS` answering
    200 or 503, else INFO."""
    return logging.DEBUG if path in POLLED_PATHS and status in (200, 503) else logging.INFO


class AccessLog:
    """ASGI middleware logging one line per HTTP request (see the module docstring): at
    INFO, polls of ``/health`` at DEBUG (:func:`request_level`).

    Args:
        app: the ASGI application.
        logger: where the lines go (default: ``deviceops.nn.serve``).
    """

    def __init__(self, app: ASGIApp, logger: logging.Logger | None = None) -> None:
        self.app = app
        self.log = logger or log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [500]  # if the app raises before it starts a response

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            stream = scope.get(SCOPE_KEY)
            tokens = None if stream is None else len(stream.tokens)
            path = str(scope.get("path", "?"))
            self.log.log(request_level(path, status[0]), "%s",
                         request_line(str(scope.get("method", "?")), path, status[0], tokens,
                                      time.perf_counter() - t0))


class ListeningFilter(logging.Filter):
    """Rewords uvicorn's "Uvicorn running on ..." (see the module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg
        if isinstance(msg, str) and msg.startswith("Uvicorn running on "):
            msg = msg.replace("Uvicorn running on ", "listening on ", 1).replace(
                "(Press CTRL+C to quit)",
                "- loading the model; requests get 503 until the 'ready' line (CTRL+C quits)")
            record.msg = msg
            record.color_message = msg  # (uvicorn's colour formatter prefers this one)
        return True
