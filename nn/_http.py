"""The OpenAI-compatible HTTP application (Starlette) in front of an :class:`Engine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``"stream": true`` gives
server-sent events ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /health``
(200 once the model is loaded, 503 while loading or draining), ``GET /metrics``
(Prometheus text, :mod:`._metrics`).

Every bad request gets 400 and an OpenAI-style JSON error naming the field
(``{"error": {"message", "type": "invalid_request_error", "param", "code"}}``); a full
admission queue gets 429 and a loading or draining server 503, both with
``Retry-After``. A client that disconnects (streaming or not) cancels its generation,
which frees its KV slot. The model is loaded in a worker thread after start-up, so
``/health`` answers 503 until it is ready.

**One engine per device** (``serve --devices``, :mod:`._router`): ``load()`` returns a
:class:`~._router.Router`; each request goes to the engine with the least pending
tokens. ``/health`` then lists every engine (``{"status": "ok" | "degraded", "model",
"engines": [{"device", "state", "load", "running", "queued", "error"}]}``) and is 200 while
at least one serves (503, status ``"failed"``, when none does). When a device's engine
fails, its in-flight and queued requests get 503 (``"type": "server_unavailable"``,
``"code": "device_failed"``, ``Retry-After``; a stream already under way gets that error
as an SSE event, then ``data: [DONE]``) and new requests go to the other devices.
Without ``--devices`` the single engine is served exactly as before (a step failure is a
500 for the requests in that step, and the engine goes on).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ._engine import Engine, EngineClosed, EngineFailed, EngineOverloaded, RequestStream
from ._metrics import CONTENT_TYPE, ServeMetrics
from ._router import Replica, Router

__all__ = ["AppState", "BadRequest", "create_app"]

log = logging.getLogger("deviceops.nn.serve")

_ROLES = ("system", "user", "assistant", "tool")


class BadRequest(Exception):
    """A request the server refuses with 400, naming the offending field (``param``)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def _error(status: int, message: str, param: str | None = None, *,
           kind: str = "invalid_request_error", retry_after: int | None = None,
           code: str | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _device_failed_message(replica: Replica, exc: EngineFailed, serving: int) -> str:
    cause = exc.__cause__
    what = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)
    kind = getattr(replica, "kind", "device")  # "replica" for Ray replicas (serve --ray)
    return (f"{kind} {replica.device} failed while handling this request ({what}); it was "
            f"taken out of service and the request was not completed. Retry it: "
            f"{serving} other {kind}(s) are serving")


@dataclass
class AppState:
    """What the app knows about its engines: loaded, failed to load, draining.

    ``router`` holds the engine(s) once loaded (:class:`~._router.Router`; one replica
    without ``--devices``).
    """

    model_name: str
    router: Router | None = None
    load_error: str | None = None
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def engine(self) -> Engine | None:
        """The first device's engine (the only one without ``--devices``), or ``None``."""
        return None if self.router is None else self.router.replicas[0].engine


@dataclass
class _Job:
    ids: list[int]
    max_tokens: int
    stream: bool
    temperature: float
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: list[str]
    ignore_eos: bool = False
    include_usage: bool = False


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _text_content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for p in content:
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                raise BadRequest(f"messages[{i}].content", "only text content parts are supported")
            parts.append(p["text"])
        return "".join(parts)
    raise BadRequest(f"messages[{i}].content", "content must be a string or a list of text parts")


def _prompt_ids(body: dict[str, Any], chat: bool, model: Any) -> list[int]:
    if chat:
        msgs = body.get("messages")
        if msgs is None:
            raise BadRequest("messages", "'messages' is required")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("messages", "'messages' must be a non-empty list of messages")
        clean = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise BadRequest(f"messages[{i}]", "each message must be an object")
            if m.get("role") not in _ROLES:
                raise BadRequest(f"messages[{i}].role", f"role must be one of {list(_ROLES)}")
            clean.append({"role": m["role"], "content": _text_content(m.get("content"), i)})
        try:
            return list(model.encode(model.apply_chat_template(clean)))
        except ValueError as exc:  # no template, or the template refused the conversation
            raise BadRequest("messages", str(exc)) from exc
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest("prompt", "'prompt' is required")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt", "'prompt' is empty")
        return list(model.encode(prompt))
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return [int(t) for t in prompt]
    raise BadRequest("prompt", "'prompt' must be a non-empty string or list of token ids "
                               "(one prompt per request)")


def _parse(body: Any, chat: bool, state: AppState, engine: Engine) -> _Job:
    if not isinstance(body, dict):
        raise BadRequest(None, "the request body must be a JSON object")
    name = body.get("model")
    if name is not None and name != state.model_name:
        raise BadRequest("model", f"unknown model {name!r}; this server serves "
                                  f"{state.model_name!r} (GET /v1/models)")
    n = body.get("n", 1)
    if n != 1 or not _is_int(n):
        raise BadRequest("n", "only n=1 is supported")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream", "'stream' must be a boolean")
    temperature = body.get("temperature", 1.0)
    if temperature is None:
        temperature = 1.0
    if not _is_num(temperature) or not 0.0 <= float(temperature) <= 2.0:
        raise BadRequest("temperature", f"'temperature' must be a number in [0, 2], got "
                                        f"{temperature!r}")
    top_p = body.get("top_p")
    if top_p is not None and (not _is_num(top_p) or not 0.0 < float(top_p) <= 1.0):
        raise BadRequest("top_p", f"'top_p' must be a number in (0, 1], got {top_p!r}")
    top_k = body.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k < 0):
        raise BadRequest("top_k", f"'top_k' must be an integer >= 0, got {top_k!r}")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**63):
        raise BadRequest("seed", f"'seed' must be an integer in [0, 2**63), got {seed!r}")
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop] if stop else []
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop):
        stops = list(stop)
    else:
        raise BadRequest("stop", "'stop' must be a string or a list of up to 4 non-empty strings")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest("ignore_eos", "'ignore_eos' must be a boolean")
    opts = body.get("stream_options")
    if opts is not None and not (isinstance(opts, dict)
                                 and isinstance(opts.get("include_usage", False), bool)):
        raise BadRequest("stream_options", "'stream_options' must be an object like "
                                           '{"include_usage": true}')
    include_usage = bool(opts and opts.get("include_usage"))
    ids = _prompt_ids(body, chat, engine.model)
    what = "messages" if chat else "prompt"
    vocab = engine.steps.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise BadRequest(what, f"token ids must be in [0, {vocab})")
    if not ids:
        raise BadRequest(what, f"'{what}' encodes to no tokens")
    room = engine.max_seq - len(ids)
    if room < 1:
        raise BadRequest(what, f"the prompt has {len(ids)} tokens; the context is "
                               f"{engine.max_seq} tokens (shorten it)")
    key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    max_tokens = body.get(key)
    if max_tokens is None:
        max_tokens = min(room, 512 if chat else 16)
    if not _is_int(max_tokens) or max_tokens < 1:
        raise BadRequest(key, f"'{key}' must be an integer >= 1, got {max_tokens!r}")
    if max_tokens > room:
        raise BadRequest(key, f"'{key}'={max_tokens} plus the prompt's {len(ids)} tokens exceeds "
                              f"the context of {engine.max_seq} tokens (at most {room})")
    return _Job(ids, int(max_tokens), stream, float(temperature),
                None if top_p is None else float(top_p), top_k, seed, stops, ignore_eos,
                include_usage)


def _text_decoder(model: Any) -> Callable[[list[int]], str]:
    """ids -> text: the model's tokenizer (special tokens kept, as ``CausalLM.decode``), or
    the model's own one-argument ``decode``."""
    tok = getattr(model, "tokenizer", None)
    if tok is not None and hasattr(tok, "decode"):
        return lambda ids: str(tok.decode(ids, skip_special_tokens=False))
    return lambda ids: str(model.decode(ids))


class _Detok:
    """Incremental detokenizer with stop strings (text held back while it may start one)."""

    def __init__(self, model: Any, eos: frozenset[int], stops: Sequence[str]) -> None:
        self.decode = _text_decoder(model)
        self.eos, self.stops = eos, list(stops)
        self.ids: list[int] = []
        self.text = ""  # all text decoded so far
        self.sent = 0  # characters of text already emitted
        self.stopped = False

    def push(self, tok: int) -> str:
        if tok not in self.eos:
            self.ids.append(tok)
            text = self.decode(self.ids)
            if not text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait
                self.text = text
        return self._emit(final=False)

    def finish(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        end = len(self.text)
        for s in self.stops:
            i = self.text.find(s)
            if i >= 0:
                self.stopped, end = True, min(end, i)
        if not self.stopped and not final:
            for s in self.stops:  # hold back a suffix that could begin a stop string
                for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(s[:k]):
                        end = min(end, len(self.text) - k)
                        break
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out


def create_app(load: Callable[[], Engine | Router], *, model_name: str = "smollm2",
               retry_after: int = 1) -> Starlette:
    """The Starlette app; ``load()`` runs in a worker thread at start-up.

    Args:
        load: builds the :class:`Engine` (its ``model`` provides ``encode``, ``decode``
            and ``apply_chat_template``), or a :class:`~._router.Router` over one engine
            per device (``serve --devices``; module docstring).
        model_name: the id clients pass as ``"model"`` and ``/v1/models`` lists.
        retry_after: seconds sent in ``Retry-After`` with 429/503.

    Returns:
        The application; ``app.state.serve`` is its :class:`AppState` and
        ``app.state.metrics`` its :class:`~._metrics.ServeMetrics`.
    """
    state = AppState(model_name)

    def engine_stats() -> Any:
        router = state.router
        if router is None:
            return None
        if router.per_device:
            return router.device_stats()
        eng = router.replicas[0].engine
        return None if eng is None else eng.stats()

    metrics = ServeMetrics(engine_stats)

    async def _load() -> None:
        try:
            got = await anyio.to_thread.run_sync(load, abandon_on_cancel=True)
            state.router = got if isinstance(got, Router) else Router.single(got)
            if state.router.per_device:
                log.info("ready: model %s loaded; serving on %s", model_name, ", ".join(
                    f"{r.device} ({r.state})" for r in state.router.replicas))
            else:
                log.info("ready: model %s loaded; serving", model_name)
        except Exception as exc:  # reported by /health; the server stays up
            state.load_error = f"{type(exc).__name__}: {exc}"
            log.exception("loading the model failed")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_load)
            try:
                yield
            finally:
                state.draining = True
                if state.router is not None:
                    state.router.close()  # whatever is still running is cancelled
                tg.cancel_scope.cancel()

    def unavailable() -> JSONResponse | None:
        if state.draining:
            return _error(503, "the server is shutting down", kind="server_unavailable",
                          retry_after=retry_after)
        if state.router is None:
            msg = (f"the model failed to load: {state.load_error}" if state.load_error
                   else "the model is loading")
            return _error(503, msg, kind="server_unavailable", retry_after=retry_after)
        if state.router.per_device and not state.router.serving:
            return _error(503, state.router.unavailable_reason(), kind="server_unavailable",
                          retry_after=retry_after, code="device_failed")
        return None

    async def health(request: Request) -> Response:
        router = state.router
        if router is not None and router.per_device:  # one entry per device's engine
            serving = len(router.serving)
            if state.draining:
                status = "draining"
            elif serving == 0:
                status = "failed"
            else:
                status = "ok" if serving == len(router.replicas) else "degraded"
            ok = status in ("ok", "degraded")
            return JSONResponse(
                {"status": status, "model": model_name, "engines": router.describe()},
                status_code=200 if ok else 503,
                headers=None if ok else {"Retry-After": str(retry_after)})
        bad = unavailable()
        if bad is not None:
            status = "draining" if state.draining else ("failed" if state.load_error else "loading")
            return JSONResponse({"status": status, "error": state.load_error}, status_code=503,
                                headers={"Retry-After": str(retry_after)})
        return JSONResponse({"status": "ok", "model": model_name})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": state.created,
             "owned_by": "deviceops"}]})

    async def metrics_route(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def completions(request: Request) -> Response:
        return await _complete(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await _complete(request, chat=True)

    async def _complete(request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            resp = await _handle(request, chat)
        except Exception as exc:  # a bug, not the client's fault: 500, the server goes on
            log.exception("request failed")
            resp = _error(500, f"internal error: {type(exc).__name__}", kind="server_error")
        metrics.requests.labels(endpoint, str(resp.status_code)).inc()
        return resp

    async def _handle(request: Request, chat: bool) -> Response:
        t0 = time.perf_counter()
        bad = unavailable()
        if bad is not None:
            return bad
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            return _error(400, f"malformed JSON body: {exc}")
        # from here to queueing nothing awaits: the load each engine reports is current
        router = state.router
        assert router is not None
        bad = unavailable()  # an engine may have failed while the body was read
        if bad is not None:
            return bad
        ranked = router.ranked() if router.per_device else router.replicas[:1]
        assert ranked and ranked[0].engine is not None
        try:
            job = _parse(body, chat, state, ranked[0].engine)
        except BadRequest as exc:
            return _error(400, exc.message, exc.param)
        full: list[EngineOverloaded] = []
        for replica in ranked:  # least loaded first; the next one when its queue is full
            engine = replica.engine
            assert engine is not None
            try:
                s = engine.stream(job.ids, job.max_tokens, temperature=job.temperature,
                                  top_k=job.top_k, top_p=job.top_p, seed=job.seed,
                                  ignore_eos=job.ignore_eos)
                break
            except EngineOverloaded as exc:
                full.append(exc)
            except EngineFailed:
                continue  # taken out of service: the next device
            except EngineClosed:
                return _error(503, "the server is shutting down", kind="server_unavailable",
                              retry_after=retry_after)
            except (ValueError, TypeError) as exc:
                return _error(400, str(exc), "messages" if chat else "prompt")
        else:
            if full and len(ranked) == 1:
                return _error(429, str(full[0]), kind="rate_limit_exceeded",
                              retry_after=retry_after)
            if full:
                return _error(429, f"every device's admission queue is full ({len(full)} "
                                   f"devices); retry later. {full[0]}",
                              kind="rate_limit_exceeded", retry_after=retry_after)
            return _error(503, router.unavailable_reason(), kind="server_unavailable",
                          retry_after=retry_after, code="device_failed")
        metrics.prompt_tokens.inc(len(job.ids))
        request.scope["deviceops.request"] = s  # the access log counts its tokens (serve)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        detok = _Detok(engine.model, engine.steps.eos_ids, job.stop)
        if job.stream:
            return StreamingResponse(
                _sse(s, detok, job, chat, rid, t0, replica), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, failed = "", None
        async with anyio.create_task_group() as tg:
            async def watch() -> None:  # a client that goes away cancels its generation
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                s.cancel()
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:
                async for piece in _tokens(s, detok, t0):
                    text += piece
            except Exception as exc:  # the step failed: 500, the server goes on
                failed = exc
            finally:
                s.cancel()
                tg.cancel_scope.cancel()
        if isinstance(failed, EngineFailed):  # its device failed: retry elsewhere
            log.error("generation %s failed with device %s: %r", rid, replica.device,
                      failed.__cause__)
            return _error(503, _device_failed_message(replica, failed, len(router.serving)),
                          kind="server_unavailable", retry_after=retry_after,
                          code="device_failed")
        if failed is not None:
            log.error("generation %s failed: %r", rid, failed)
            return _error(500, f"generation failed: {failed}", kind="server_error")
        reason = _reason(s, detok)
        if reason == "cancelled":
            return Response(status_code=499)  # nobody is listening
        usage = _usage(s, job)
        created = int(time.time())
        if chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            obj = "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": model_name,
                             "choices": [choice], "usage": usage})

    async def _tokens(s: RequestStream, detok: _Detok, t0: float) -> AsyncIterator[str]:
        """Text pieces as tokens arrive; records TTFT/ITL; stops at a stop string."""
        last = None
        try:
            async for tok in s:
                now = time.perf_counter()
                if last is None:
                    metrics.ttft.observe(now - t0)
                else:
                    metrics.itl.observe(now - last)
                last = now
                metrics.generated_tokens.inc()
                piece = detok.push(tok)
                if piece:
                    yield piece
                if detok.stopped:
                    s.cancel()
                    break
            tail = detok.finish()
            if tail:
                yield tail
        finally:
            s.cancel()
            reason = _reason(s, detok)
            metrics.finished.labels(reason).inc()
            if last is not None:
                metrics.duration.observe(time.perf_counter() - t0)

    async def _sse(s: RequestStream, detok: _Detok, job: _Job, chat: bool, rid: str,
                   t0: float, replica: Replica) -> AsyncIterator[bytes]:
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(piece: str | None, reason: str | None, first: bool = False) -> bytes:
            if chat:
                delta: dict[str, Any] = {}
                if first:
                    delta["role"] = "assistant"
                if piece:
                    delta["content"] = piece
                choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                          "finish_reason": reason}
            else:
                choice = {"index": 0, "text": piece or "", "logprobs": None,
                          "finish_reason": reason}
            payload = {"id": rid, "object": obj, "created": created, "model": model_name,
                       "choices": [choice]}
            return b"data: " + json.dumps(payload).encode() + b"\n\n"

        try:
            if chat:
                yield chunk(None, None, first=True)
            try:
                async for piece in _tokens(s, detok, t0):
                    yield chunk(piece, None)
            except EngineFailed as exc:  # its device failed: a 503 error event, then [DONE]
                log.error("generation %s failed with device %s: %r", rid, replica.device,
                          exc.__cause__)
                n = len(state.router.serving) if state.router is not None else 0
                err = {"error": {"message": _device_failed_message(replica, exc, n),
                                 "type": "server_unavailable", "param": None,
                                 "code": "device_failed"}}
                yield b"data: " + json.dumps(err).encode() + b"\n\n"
            except Exception as exc:  # the step failed: an error event, then [DONE]
                log.error("generation %s failed: %r", rid, exc)
                err = {"error": {"message": f"generation failed: {exc}", "type": "server_error"}}
                yield b"data: " + json.dumps(err).encode() + b"\n\n"
            else:
                yield chunk(None, _reason(s, detok))
                if job.include_usage:
                    payload = {"id": rid, "object": obj, "created": created, "model": model_name,
                               "choices": [], "usage": _usage(s, job)}
                    yield b"data: " + json.dumps(payload).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            s.cancel()  # client gone (generator closed) or done: the slot is freed

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.serve = state
    app.state.metrics = metrics
    return app


def _reason(s: RequestStream, detok: _Detok) -> str:
    if detok.stopped:
        return "stop"
    return s.finish_reason or "cancelled"


def _usage(s: RequestStream, job: _Job) -> dict[str, int]:
    n = len(s.tokens)
    return {"prompt_tokens": len(job.ids), "completion_tokens": n,
            "total_tokens": len(job.ids) + n}
