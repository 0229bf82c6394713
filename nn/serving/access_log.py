"""The server's request log and start-up messages (``python -m deviceops.nn.serve``).

* :class:`AccessLog`, an ASGI middleware: one INFO line per HTTP request, when its response
  has been sent in full (a stream included)::

      POST /v1/chat/completions 200 12 tokens 0.84 s
      GET /health 503 - 0.001 s

  method, path, status, the tokens generated (``-`` for a request that generated nothing:
  the route handler puts its request stream in the ASGI scope under
  :data:`SCOPE_KEY`), and the time from the request's arrival to its last byte.
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

__all__ = ["SCOPE_KEY", "AccessLog", "ListeningFilter", "request_line"]

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


class AccessLog:
    """ASGI middleware logging one line per HTTP request at INFO (see the module docstring).

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
            self.log.info("%s", request_line(str(scope.get("method", "?")),
                                             str(scope.get("path", "?")), status[0], tokens,
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
