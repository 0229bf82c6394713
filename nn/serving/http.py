"""The OpenAI-compatible HTTP application (Starlette) in front of an :class:`Engine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``"stream": true`` gives
server-sent events ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /health``
(200 once the model is loaded, 503 while loading or draining), ``GET /metrics``
(Prometheus text, :mod:`.metrics`); with an embedding model (``serve --embedding-model``),
``POST /v1/embeddings`` (:mod:`.embeddings`), beside the chat model or alone (then the
completion routes are not there: 404 ``unknown_url``).

**Choices.** ``"n": N`` (at most :data:`~.openai.MAX_N`) runs N engine requests on one
engine, choice ``i`` with seed ``seed + i`` (:func:`~.openai.choice_seed`); they share the
prompt's full KV blocks through the engine's prefix cache (prefilled once). The response
lists the choices by ``index``; streamed, each chunk carries one choice's delta, its
``choices[0].index`` naming it, and each choice ends with its own ``finish_reason`` chunk;
``usage.completion_tokens`` is their sum. A failure of any choice fails the response (500 /
503, or one error event). Time to first token and inter-token latency are observed per
choice.

Every bad request gets 400 and an OpenAI-style JSON error naming the field
(``{"error": {"message", "type": "invalid_request_error", "param", "code"}}``; parsing,
validation and the response bodies are :mod:`.openai`, the text of a token stream
:mod:`.detokenize`); a full
admission queue gets 429 and a loading or draining server 503, both with
``Retry-After``. A client that disconnects (streaming or not) cancels its generation,
which frees its KV slot. The model is loaded in a worker thread after start-up, so
``/health`` answers 503 until it is ready.

**One engine per device** (``serve --devices``, :mod:`.router`): ``load()`` returns a
:class:`~.router.Router`; each request goes to the engine with the least pending
tokens. ``/health`` then lists every engine (``{"status": "ok" | "degraded", "model",
"engines": [{"device", "state", "load", "running", "queued", "error"}]}``) and is 200 while
at least one serves (503, status ``"failed"``, when none does). When a device's engine
fails, its in-flight and queued requests get 503 (``"type": "server_unavailable"``,
``"code": "device_failed"``, ``Retry-After``; a stream already under way gets that error
as an SSE event, then ``data: [DONE]``) and new requests go to the other devices.
Without ``--devices`` the single engine is served on its own (no device labels; a step
failure is a 500 for the requests in that step, and the engine goes on).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread
from anyio.streams.memory import MemoryObjectSendStream
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .detokenize import Detokenizer
from .embeddings import EmbeddingService, embeddings_body, parse_embedding_request
from .engine import Engine, EngineClosed, EngineFailed, EngineOverloaded, RequestStream
from .guard import Exposure, Guard, InvalidJSON, parse_json
from .logprobs import Entry, choice_logprobs
from .metrics import CONTENT_TYPE, ServeMetrics
from .openai import (
    BadRequest,
    Job,
    Limits,
    PieceChunks,
    choice_body,
    choice_seed,
    completion_body,
    device_failed_message,
    error_response,
    finish_reason,
    parse_request,
    sse_event,
    stream_chunk,
    usage,
)
from .router import Replica, Router
from .tool_calls import ToolCallStream
from .tool_calls import parse as parse_tool_calls

__all__ = ["AppState", "BadRequest", "create_app"]

log = logging.getLogger("deviceops.nn.serve")

#: Request bodies up to this size are parsed, templated and tokenised on the event loop (at
#: most a few hundred microseconds); larger ones in a worker thread. A thread is no help for
#: a small body: it waits for the GIL of a busy loop (the interpreter's 5 ms switch
#: interval), which cost tens of milliseconds to first token under load.
INLINE_BODY_BYTES = 8192

@dataclass
class AppState:
    """What the app knows about its engines: loaded, failed to load, draining.

    ``router`` holds the engine(s) once loaded (:class:`~.router.Router`; one replica
    without ``--devices``).
    """

    model_name: str
    router: Router | None = None
    load_error: str | None = None
    draining: bool = False
    aborting: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    live: set[RequestStream] = field(default_factory=set)

    def abort_streams(self) -> int:
        """End every generation still running (shutdown past its drain time): each stream
        gets a final chunk with ``finish_reason: "abort"`` and ``[DONE]``; a non-streamed
        one its text so far. Returns how many were ended."""
        self.aborting = True
        live = list(self.live)
        for s in live:
            s.cancel()
        return len(live)

    @property
    def engine(self) -> Engine | None:
        """The first device's engine (the only one without ``--devices``), or ``None``."""
        return None if self.router is None else self.router.replicas[0].engine


@dataclass(eq=False)
class _Choice:
    """One choice of a request: its index, stream, detokenizer, and (not streamed) the text
    and log-probability entries so far."""

    index: int
    stream: RequestStream
    detok: Detokenizer
    text: str = ""
    entries: list[Entry] = field(default_factory=list)


class _AllTokens:
    """What the access log reads of a request with several choices: every choice's tokens."""

    def __init__(self, streams: list[RequestStream]) -> None:
        self.streams = streams

    @property
    def tokens(self) -> list[int]:
        return [t for s in self.streams for t in s.tokens]


async def _body(request: Request) -> bytes | None:
    """The request's body, or ``None`` (logged) when the client closed the connection while
    sending it: the route answers 499."""
    try:
        return await request.body()
    except ClientDisconnect:
        log.info("%s: the client closed the connection while sending the body (499)",
                 request.url.path)
        return None


class _ClientGone(BaseException):
    """Sending an event failed (the client went away) inside a choice's producer: not the
    step's failure, which the producer catches as ``Exception``; re-raised as ``cause``."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(cause)
        self.cause = cause


class _Direct:
    """A producer's ``out`` that sends each event at once (a response with one choice: no
    queue and no second task between the tokens and the socket)."""

    def __init__(self, emit: Callable[[bytes], Awaitable[None]]) -> None:
        self._emit = emit

    async def send(self, ev: bytes) -> None:
        try:
            await self._emit(ev)
        except Exception as exc:
            raise _ClientGone(exc) from exc

    async def __aenter__(self) -> _Direct:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


class _EventStream(StreamingResponse):
    """A ``text/event-stream`` response whose events ``run(emit)`` sends (one task sends; the
    choices' producers run in ``run``'s task group, never across a generator's ``yield``)."""

    def __init__(self, run: Callable[[Callable[[bytes], Awaitable[None]]], Awaitable[None]],
                 headers: dict[str, str]) -> None:
        super().__init__(_no_body(), media_type="text/event-stream", headers=headers)
        self._run = run

    async def stream_response(self, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})

        async def emit(chunk: bytes) -> None:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

        await self._run(emit)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _no_body() -> AsyncIterator[bytes]:
    return
    yield b""  # an async generator that yields nothing (the body is _EventStream._run's)


def _context_bound(limits: Limits, router: Router) -> Limits:
    """``limits`` with ``max_prompt_chars`` lowered to what can fit the context: no token
    decodes to more characters than its longest vocabulary entry has, so a prompt longer
    than ``max_seq`` times that cannot fit in ``max_seq`` tokens and is refused before it is
    tokenised (tokenising a huge text holds the GIL for seconds)."""
    eng = next((r.engine for r in router.replicas if r.engine is not None), None)
    tok = getattr(getattr(eng, "model", None), "tokenizer", None)
    if eng is None or tok is None or not hasattr(tok, "get_vocab"):
        return limits
    longest = max((len(p) for p in tok.get_vocab()), default=0)
    if longest <= 0:
        return limits
    return dataclasses.replace(limits, max_prompt_chars=min(
        limits.max_prompt_chars, int(eng.max_seq) * longest))


def create_app(load: Callable[[], Engine | Router] | None, *, model_name: str = "smollm2",
               retry_after: int = 1, exposure: Exposure | None = None,
               limits: Limits | None = None, tokenize_threads: int = 4,
               on_load_error: Callable[[str], None] | None = None,
               load_first: bool = False, embedding: EmbeddingService | None = None) -> Starlette:
    """The Starlette app; ``load()`` runs in a worker thread at start-up.

    Args:
        load: builds the :class:`Engine` (its ``model`` provides ``encode``, ``decode``
            and ``apply_chat_template``), or a :class:`~.router.Router` over one engine
            per device (``serve --devices``; module docstring); ``None``: no chat model
            (an embedding model alone: ``embedding`` is needed).
        model_name: the id clients pass as ``"model"`` and ``/v1/models`` lists (without
            a chat model: the embedding model's name).
        retry_after: seconds sent in ``Retry-After`` with 429/503.
        exposure: keys, hosts, body limit and CORS (:class:`~.guard.Exposure`; default: any
            host, no key, 4 MB JSON bodies).
        limits: messages and prompt characters accepted (:class:`~.openai.Limits`).
        tokenize_threads: worker threads that parse, template and tokenise requests at
            once (the event loop never does).
        on_load_error: called with the one-line reason when ``load()`` raises (``serve``
            exits with it); without it the app stays up and ``/health`` reports it.
        load_first: finish ``load()`` before the app starts serving (for a quick load,
            such as attaching to running engine cores: no request sees "loading").
        embedding: the embedding model served at ``POST /v1/embeddings``
            (:mod:`.embeddings`), loaded in a worker thread at start-up like ``load``.

    Raises:
        ValueError: neither ``load`` nor ``embedding`` is given.

    Returns:
        The application; ``app.state.serve`` is its :class:`AppState` and
        ``app.state.metrics`` its :class:`~.metrics.ServeMetrics`.
    """
    if load is None and embedding is None:
        raise ValueError("create_app: nothing to serve; give load (a chat model) or embedding "
                         "(an embedding model), or both")
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
    limits = limits or Limits()
    bounds = [limits]  # [0]: the limits in force (tightened by the context once loaded)
    tokenizing = anyio.CapacityLimiter(tokenize_threads)

    async def _load() -> None:
        assert load is not None
        try:
            got = await anyio.to_thread.run_sync(load, abandon_on_cancel=True)
            state.router = got if isinstance(got, Router) else Router.single(got)
            attach = getattr(state.router, "attach", None)
            if attach is not None:  # engine-core clients connect from this loop
                attach()
            bounds[0] = _context_bound(limits, state.router)
            gc.collect()
            gc.freeze()  # a full collection would otherwise walk the loaded heap mid-stream
            if state.router.per_device:
                log.info("ready: model %s loaded; serving on %s", model_name, ", ".join(
                    f"{r.device} ({r.state})" for r in state.router.replicas))
            else:
                log.info("ready: model %s loaded; serving", model_name)
        except Exception as exc:  # reported by /health; the server stays up
            state.load_error = f"{type(exc).__name__}: {exc}"
            if on_load_error is not None:  # a RuntimeError's message says it all
                why = str(exc) if type(exc) is RuntimeError else state.load_error
                on_load_error(why.splitlines()[0])
            else:
                log.exception("loading the model failed")

    async def _load_embedding() -> None:
        assert embedding is not None
        try:
            await embedding.load()
        except Exception:  # reported by /health; the server stays up
            if on_load_error is not None:
                on_load_error(f"embedding model {embedding.name}: {embedding.load_error}"
                              .splitlines()[0])
            else:
                log.exception("loading the embedding model failed")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            if embedding is not None:
                tg.start_soon(_load_embedding)
            if load is not None and load_first:
                await _load()
            elif load is not None:
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
            return error_response(503, "the server is shutting down", kind="server_unavailable",
                          retry_after=retry_after)
        if state.router is None:
            msg = (f"the model failed to load: {state.load_error}" if state.load_error
                   else "the model is loading")
            return error_response(503, msg, kind="server_unavailable", retry_after=retry_after)
        if state.router.per_device and not state.router.serving:
            return error_response(503, state.router.unavailable_reason(), kind="server_unavailable",
                          retry_after=retry_after, code="device_failed")
        return None

    async def health(request: Request) -> Response:
        if load is None:  # an embedding model alone
            assert embedding is not None
            status = "draining" if state.draining else embedding.status
            if status == "ok":
                return JSONResponse({"status": "ok", "model": embedding.name})
            return JSONResponse({"status": status, "error": embedding.load_error},
                                status_code=503, headers={"Retry-After": str(retry_after)})
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
        assert router is not None
        only = router.replicas[0]
        if only.state != "serving":  # an engine core that died and is being restarted
            return JSONResponse({"status": only.state, "model": model_name,
                                 "error": only.error}, status_code=503,
                                headers={"Retry-After": str(retry_after)})
        body: dict[str, Any] = {"status": "ok", "model": model_name}
        if getattr(only, "process", None) is not None:  # an engine core: its pid, restarts
            body["engines"] = router.describe()
        if embedding is not None:
            body["embedding_model"] = {"model": embedding.name, "status": embedding.status,
                                       "error": embedding.load_error}
        return JSONResponse(body)

    def served() -> list[str]:
        """The model ids: the chat model's, then the embedding model's."""
        ids = [model_name] if load is not None else []
        return ids + ([embedding.name] if embedding is not None else [])

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": mid, "object": "model", "created": state.created, "owned_by": "deviceops"}
            for mid in served()]})

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
            resp = error_response(500, f"internal error: {type(exc).__name__}", kind="server_error")
        metrics.requests.labels(endpoint, str(resp.status_code)).inc()
        return resp

    async def _handle(request: Request, chat: bool) -> Response:
        t0 = time.perf_counter()
        bad = unavailable()
        if bad is not None:
            return bad
        raw = await _body(request)
        if raw is None:
            return Response(status_code=499)
        router = state.router
        assert router is not None
        bad = unavailable()  # an engine may have failed while the body was read
        if bad is not None:
            return bad
        first = router.ranked() if router.per_device else router.replicas[:1]
        assert first and first[0].engine is not None
        try:  # decoding, templating, tokenising in a worker thread: the loop goes on serving
            if len(raw) <= INLINE_BODY_BYTES:  # parsed here: a worker thread would wait
                job = _parse(raw, chat, first[0].engine)  # for the GIL of a busy loop
            else:
                job = await anyio.to_thread.run_sync(_parse, raw, chat, first[0].engine,
                                                     limiter=tokenizing)
        except InvalidJSON as exc:
            return error_response(400, f"malformed JSON body: {exc}")
        except BadRequest as exc:
            return error_response(exc.status, exc.message, exc.param, code=exc.code)
        # from here to queueing nothing awaits: the load each engine reports is current
        bad = unavailable()
        if bad is not None:
            return bad
        ranked = router.ranked() if router.per_device else router.replicas[:1]
        assert ranked and ranked[0].engine is not None
        full: list[EngineOverloaded] = []
        for replica in ranked:  # least loaded first; the next one when its queue is full
            engine = replica.engine
            assert engine is not None
            try:
                streams = _start(engine, job)
                break
            except EngineOverloaded as exc:
                full.append(exc)
            except EngineFailed:
                continue  # taken out of service: the next device
            except EngineClosed:
                return error_response(503, "the server is shutting down", kind="server_unavailable",
                              retry_after=retry_after)
            except (ValueError, TypeError) as exc:
                return error_response(400, str(exc), "messages" if chat else "prompt")
        else:
            if full and len(ranked) == 1:
                return error_response(429, str(full[0]), kind="rate_limit_exceeded",
                              retry_after=retry_after)
            if full:
                return error_response(429, f"every device's admission queue is full ({len(full)} "
                                   f"devices); retry later. {full[0]}",
                              kind="rate_limit_exceeded", retry_after=retry_after)
            return error_response(503, router.unavailable_reason(), kind="server_unavailable",
                          retry_after=retry_after, code="device_failed")
        metrics.prompt_tokens.inc(len(job.ids))
        state.live.update(streams)
        # the access log counts the tokens generated (serve): every choice's
        request.scope["deviceops.request"] = streams[0] if len(streams) == 1 else _AllTokens(
            streams)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        choices = [_Choice(i, st, Detokenizer(engine.model, engine.steps.eos_ids, job.stop))
                   for i, st in enumerate(streams)]
        if job.stream:
            return _EventStream(
                lambda emit: _sse(choices, job, chat, rid, t0, replica, emit),
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        failed: BaseException | None = None
        async with anyio.create_task_group() as tg:
            async def watch() -> None:  # a client that goes away cancels its generations
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                for c in choices:
                    c.stream.cancel()
                tg.cancel_scope.cancel()

            async def collect(c: _Choice) -> None:
                nonlocal failed
                c.text = job.echo or ""
                try:
                    async for piece, got in _tokens(c.stream, c.detok, job, t0):
                        c.text += piece
                        c.entries += got
                except Exception as exc:  # the step failed: 500 (503: its device), server goes on
                    if failed is None or isinstance(exc, EngineFailed):
                        failed = exc
                    for other in choices:  # the response fails as a whole
                        other.stream.cancel()
                finally:
                    c.stream.cancel()

            tg.start_soon(watch)
            try:
                async with anyio.create_task_group() as each:
                    for c in choices:
                        each.start_soon(collect, c)
            finally:
                for c in choices:
                    c.stream.cancel()
                tg.cancel_scope.cancel()
        state.live.difference_update(streams)
        if isinstance(failed, EngineFailed):  # its device failed: retry elsewhere
            log.error("generation %s failed with device %s: %r", rid, replica.device,
                      failed.__cause__)
            return error_response(503, device_failed_message(replica, failed, len(router.serving)),
                          kind="server_unavailable", retry_after=retry_after,
                          code="device_failed")
        if failed is not None:
            log.error("generation %s failed: %r", rid, failed)
            return error_response(500, f"generation failed: {failed}", kind="server_error")
        bodies = []
        for c in choices:
            reason = finish_reason(c.stream, c.detok.stopped)
            if reason == "cancelled" and state.aborting:
                reason = "abort"  # shut down past the drain time: the text so far
            elif reason == "cancelled":
                return Response(status_code=499)  # nobody is listening
            lp = None if job.logprobs is None else choice_logprobs(c.entries, c.detok.decode,
                                                                   chat)
            content: str | None = c.text
            calls: list[dict[str, Any]] = []
            if job.tool_names:  # the reply's <tool_call> blocks become tool_calls
                content, calls = parse_tool_calls(c.text, job.tool_names)
                if calls and reason == "stop":
                    reason = "tool_calls"
            bodies.append(choice_body(c.index, chat, content, reason, lp, calls or None))
        return JSONResponse(completion_body(rid, chat, model_name, bodies, usage(streams, job)))

    def _start(engine: Engine, job: Job) -> list[RequestStream]:
        """Queue the job's ``n`` choices on ``engine`` (choice ``i`` with seed
        :func:`~.openai.choice_seed`); none stays queued when one is refused."""
        out: list[RequestStream] = []
        try:
            for i in range(job.n):
                out.append(engine.stream(job.ids, job.max_tokens, temperature=job.temperature,
                                         top_k=job.top_k, top_p=job.top_p,
                                         seed=choice_seed(job.seed, i),
                                         ignore_eos=job.ignore_eos, **job.features()))
        except BaseException:
            for st in out:
                st.cancel()
            raise
        return out

    def _parse(raw: bytes, chat: bool, engine: Engine) -> Job:
        # a key "role" is the only way these bytes appear in JSON text (inside a string the
        # quotes are escaped): too many messages are refused before decoding builds them
        n = raw.count(b'"role"')
        if chat and n > bounds[0].max_messages:
            raise BadRequest("messages", f"{n} messages; this server accepts at most "
                             f"{bounds[0].max_messages} (serve --max-messages)")
        return parse_request(parse_json(raw), chat, model_name, engine, bounds[0])

    async def _tokens(s: RequestStream, detok: Detokenizer, job: Job, t0: float
                      ) -> AsyncIterator[tuple[str, list[Entry]]]:
        """Text pieces as tokens arrive, each with the log-probability entries of the tokens
        consumed since the previous piece (with ``logprobs``; :mod:`.logprobs`); records
        TTFT/ITL; stops at a stop string."""
        last = None
        pending: list[Entry] = []
        i = 0
        take_ready = getattr(s, "take_ready", None)
        try:
            async for first in s:
                now = time.perf_counter()
                if last is None:
                    metrics.ttft.observe(now - t0)
                else:
                    metrics.itl.observe(now - last)
                last = now
                # a consumer that fell behind takes every token already here in one piece
                toks = [first, *take_ready()] if take_ready is not None else [first]
                metrics.generated_tokens.inc(len(toks))
                piece = ""
                for tok in toks:
                    offset = len(detok.text)
                    piece += detok.push(tok)
                    if job.logprobs is not None and tok not in detok.eos:
                        tl = s.logprob(i)
                        if tl is not None:
                            pending.append((tl, offset))
                    i += 1
                    if detok.stopped:
                        break
                if piece:
                    yield piece, pending
                    pending = []
                if detok.stopped:
                    s.cancel()
                    break
            tail = detok.finish()
            if tail or pending:
                yield tail, pending
        finally:
            s.cancel()
            reason = finish_reason(s, detok.stopped)
            metrics.finished.labels(reason).inc()
            if last is not None:
                metrics.duration.observe(time.perf_counter() - t0)

    async def _sse(choices: list[_Choice], job: Job, chat: bool, rid: str, t0: float,
                   replica: Replica, emit: Callable[[bytes], Awaitable[None]]) -> None:
        """The server-sent events of a streamed completion, ending with ``[DONE]``: each
        choice's chunks (``choices[0].index`` names it) as its tokens arrive."""
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        failed: list[BaseException] = []
        streams = [c.stream for c in choices]

        async def produce(c: _Choice, out: MemoryObjectSendStream[bytes] | _Direct) -> None:
            detok = c.detok
            plain = PieceChunks(rid, chat, model_name, created, c.index)

            def chunk(piece: str | None, reason: str | None, first: bool = False,
                      entries: list[Entry] | None = None,
                      calls: list[dict[str, Any]] | None = None) -> bytes:
                if piece and reason is None and not first and calls is None and (
                        job.logprobs is None):
                    return plain(piece)  # every token's chunk but the last: the template's
                lp = None if job.logprobs is None or entries is None else choice_logprobs(
                    entries, detok.decode, chat)
                return stream_chunk(rid, chat, model_name, created, piece, reason, first, lp,
                                    calls, index=c.index)

            # with tools: text that may open a <tool_call> waits; each closed call is one delta
            tcs = ToolCallStream(job.tool_names) if job.tool_names else None

            def pieces(piece: str, got: list[Entry]) -> Iterator[bytes]:
                if tcs is None:
                    yield chunk(piece, None, entries=got)
                    return
                text, calls = tcs.push(piece)
                if text or got:
                    yield chunk(text, None, entries=got)
                first_index = tcs.calls - len(calls)  # a call's index in the whole reply
                for k, call in enumerate(calls):
                    yield chunk(None, None, calls=[{"index": first_index + k, **call}])

            async with out:
                try:
                    if chat:
                        await out.send(chunk(None, None, first=True))
                    elif job.echo:
                        await out.send(chunk(job.echo, None))  # completions echo: the prompt first
                    async for piece, got in _tokens(c.stream, detok, job, t0):
                        for ev in pieces(piece, got):
                            await out.send(ev)
                    if tcs is not None:
                        rest, _ = tcs.finish()
                        if rest:
                            await out.send(chunk(rest, None))
                except Exception as exc:  # the step failed: one error event for the response
                    failed.append(exc)
                    for st in streams:
                        st.cancel()
                    return
                finally:
                    c.stream.cancel()
                if failed:
                    return  # another choice failed: the response ends with its error
                reason = finish_reason(c.stream, detok.stopped)
                if tcs is not None and tcs.calls and reason == "stop":
                    reason = "tool_calls"
                await out.send(chunk(None, "abort" if reason == "cancelled" and state.aborting
                                     else reason))

        try:
            if len(choices) == 1:  # one choice: its events go out from this task, unqueued
                try:
                    await produce(choices[0], _Direct(emit))
                except _ClientGone as gone:
                    raise gone.cause from None
            else:
                send, receive = anyio.create_memory_object_stream[bytes](math.inf)
                async with anyio.create_task_group() as tg:
                    for c in choices:
                        tg.start_soon(produce, c, send.clone())
                    send.close()
                    async with receive:
                        async for ev in receive:
                            await emit(ev)
            if failed:
                exc = next((e for e in failed if isinstance(e, EngineFailed)), failed[0])
                if isinstance(exc, EngineFailed):  # its device failed: a 503 error event
                    log.error("generation %s failed with device %s: %r", rid, replica.device,
                              exc.__cause__)
                    n = len(state.router.serving) if state.router is not None else 0
                    await emit(sse_event({"error": {
                        "message": device_failed_message(replica, exc, n),
                        "type": "server_unavailable", "param": None, "code": "device_failed"}}))
                else:  # the step failed: an error event, then [DONE]
                    log.error("generation %s failed: %r", rid, exc)
                    await emit(sse_event({"error": {"message": f"generation failed: {exc}",
                                                    "type": "server_error"}}))
            elif job.include_usage:
                await emit(sse_event({"id": rid, "object": obj, "created": created,
                                      "model": model_name, "choices": [],
                                      "usage": usage(streams, job)}))
            await emit(b"data: [DONE]\n\n")
        finally:
            state.live.difference_update(streams)
            for st in streams:
                st.cancel()  # client gone or done: the slots are freed

    async def model_route(request: Request) -> Response:
        mid = request.path_params["model_id"]
        if mid not in served():
            names = " and ".join(map(repr, served()))
            return error_response(404, f"The model {mid!r} does not exist; this server serves "
                                  f"{names}", "model", code="model_not_found")
        return JSONResponse({"id": mid, "object": "model", "created": state.created,
                             "owned_by": "deviceops"})

    async def embeddings(request: Request) -> Response:
        try:
            resp = await _embed(request)
        except Exception as exc:  # a bug, not the client's fault: 500, the server goes on
            log.exception("request failed")
            resp = error_response(500, f"internal error: {type(exc).__name__}", kind="server_error")
        metrics.requests.labels("embeddings", str(resp.status_code)).inc()
        return resp

    async def _embed(request: Request) -> Response:
        assert embedding is not None
        if state.draining:
            return error_response(503, "the server is shutting down", kind="server_unavailable",
                                  retry_after=retry_after)
        enc = embedding.encoder
        if enc is None:
            msg = (f"the embedding model failed to load: {embedding.load_error}"
                   if embedding.load_error else "the embedding model is loading")
            return error_response(503, msg, kind="server_unavailable", retry_after=retry_after)
        raw = await _body(request)
        if raw is None:
            return Response(status_code=499)

        def parse() -> Any:
            return parse_embedding_request(parse_json(raw), embedding.name, enc, limits)

        try:  # tokenising a large body in a worker thread: the loop goes on serving
            job = (parse() if len(raw) <= INLINE_BODY_BYTES
                   else await anyio.to_thread.run_sync(parse, limiter=tokenizing))
        except InvalidJSON as exc:
            return error_response(400, f"malformed JSON body: {exc}")
        except BadRequest as exc:
            return error_response(exc.status, exc.message, exc.param, code=exc.code)
        vectors = await embedding.embed(job)  # in a worker thread, one forward at a time

        def render() -> bytes:
            return bytes(JSONResponse(embeddings_body(embedding.name, vectors, job)).body)

        # a body of many vectors is rendered in a worker thread too (json.dumps holds the loop)
        content = render() if vectors.size <= 16384 else await anyio.to_thread.run_sync(
            render, limiter=tokenizing)
        return Response(content, media_type="application/json")

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        if status == 404:
            msg = f"no route {request.method} {request.url.path}; see GET /v1/models"
            return error_response(404, msg, code="unknown_url")
        if status == 405:
            return error_response(405, f"{request.method} is not allowed on "
                                  f"{request.url.path}", code="method_not_allowed")
        detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
        return error_response(status, str(detail), kind="invalid_request_error"
                              if status < 500 else "server_error")

    def guard_status(path: str, status: int) -> None:
        endpoint = {"/v1/chat/completions": "chat", "/v1/completions": "completions",
                    "/v1/embeddings": "embeddings"}.get(path, "other")
        metrics.requests.labels(endpoint, str(status)).inc()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model_route, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
    ]
    if load is not None:
        routes += [Route("/v1/completions", completions, methods=["POST"]),
                   Route("/v1/chat/completions", chat_completions, methods=["POST"])]
    if embedding is not None:
        routes.append(Route("/v1/embeddings", embeddings, methods=["POST"]))
    exposure = exposure or Exposure()
    middleware = [Middleware(Guard, exposure=exposure, on_status=guard_status)]
    if exposure.cors_origins:  # outermost: a browser's preflight carries no key
        middleware.insert(0, Middleware(
            CORSMiddleware, allow_origins=list(exposure.cors_origins),
            allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"]))
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={HTTPException: http_error})
    app.state.serve = state
    app.state.metrics = metrics
    return app
