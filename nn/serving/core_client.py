"""The front's side of an engine core: :class:`CoreClient`, an engine-shaped proxy of one
core process (:mod:`.core`), and :class:`CoreStream`, one request's tokens from it.

The HTTP layer (:mod:`.http`) and the router (:mod:`.router`) use a :class:`CoreClient`
exactly as an in-process :class:`~deviceops.nn.Engine`: ``stream`` (an async iterator of
new token ids with ``cancel``, ``tokens``, ``finish_reason``, ``logprob``), ``stats``,
``pending_tokens``, ``failure``, ``closed``, ``close``, ``max_seq``, ``sampling_features``,
``steps.vocab_size``/``eos_ids`` and ``model`` (the tokenizer and chat template, rebuilt
from the core's :class:`~.protocol.Ready`; no weights).

**Messages.** Requests go out as :class:`~.protocol.Submit` on a ZeroMQ ``DEALER`` socket;
cancellations are batched into one :class:`~.protocol.Cancel` per loop iteration. One
receiver task reads the core's :class:`~.protocol.Step` messages (a step's tokens for
every request of this front, as arrays) and wakes the consumers that got tokens.

**Load.** :attr:`CoreClient.pending_tokens` is counted here, with no round trip: each
request in flight counts its prompt until its first token is back, plus
``max_new_tokens`` minus the tokens received. ``max_batch + max_queue`` requests in
flight make :meth:`CoreClient.stream` raise :class:`~deviceops.nn.EngineOverloaded`.

**Failure.** When the core's connection drops (the process died: kill -9, a crash) or it
reports that its engine failed, every request in flight ends with :class:`CoreFailed`
(an :class:`~deviceops.nn.EngineFailed`: a 503 ``device_failed``, or an SSE error event
for a stream under way), :attr:`CoreClient.failure` is set (the router sends new requests
elsewhere) and the client opens a fresh socket to the same address: when the restarted
core answers its :class:`~.protocol.Hello`, the failure clears and
:attr:`CoreClient.restarts` counts it. A fresh socket (not ZeroMQ's own reconnect) makes
sure no message queued for the dead core reaches the new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import pickle
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._args import check_adjustments, check_max_new_tokens, check_sampling, check_stop
from ..tokenizer import TextCodec
from .protocol import (
    PHASE_NAMES,
    Bye,
    Cancel,
    Failed,
    Hello,
    Ready,
    Step,
    Submit,
    decode_front,
    encode,
    pack_i32,
    unpack_i32,
    unpack_i64,
)
from .requests import (
    STAT_FIELDS,
    EngineClosed,
    EngineFailed,
    EngineOverloaded,
    EngineStats,
    SamplingParams,
    TokenLogprob,
    TokenStream,
    check_kv_budget,
    prompt_ids,
)

__all__ = ["CoreClient", "CoreFailed", "CoreModel", "CoreStream", "handshake"]

log = logging.getLogger("deviceops.nn.serve")


#: Seconds between hellos to a core that is being restarted.
HELLO_S = 0.5


class CoreFailed(EngineFailed):
    """The engine core holding this request died or failed; retry the request (it is 503)."""


class _CoreLost(RuntimeError):
    """Why a core went out of service (the ``__cause__`` of :class:`CoreFailed`)."""


def handshake(address: str, *, timeout_s: float, alive: Any = None) -> dict[str, Any]:
    """Connect to the core at ``address`` (blocking), say :class:`~.protocol.Hello` and
    return its :class:`~.protocol.Ready` info (with the tokenizer side).

    Args:
        address: the core's ZeroMQ address.
        timeout_s: how long to wait for the answer (a model loads first).
        alive: called every 0.1 s while waiting; return ``None`` to go on waiting or a
            string to give up with (the core process exited, and why).

    Raises:
        RuntimeError: the core did not answer in time, or ``alive`` said why not.
    """
    import time

    import zmq

    ctx: Any = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, f"hs-{os.getpid()}-{uuid.uuid4().hex[:8]}".encode())
    try:
        sock.connect(address)
        sock.send(encode(Hello(info=True)))
        deadline = time.monotonic() + timeout_s
        while True:
            if sock.poll(100):
                msg = decode_front(sock.recv())
                if isinstance(msg, Ready):
                    sock.send(encode(Bye()))
                    return msg.info
                continue
            why = alive() if alive is not None else None
            if why is not None:
                raise RuntimeError(why)
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine core at {address} did not answer within "
                                   f"{timeout_s:g} s")
    finally:
        sock.close(0)


@dataclass(eq=False)
class _Req:
    rid: int
    prompt_len: int
    max_new: int
    want_logprobs: bool = False
    out: list[int] = field(default_factory=list)
    buf: deque[int] = field(default_factory=deque)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    reason: str | None = None
    error: BaseException | None = None
    done: bool = False
    waiter: asyncio.Future[None] | None = None

    @property
    def finished(self) -> bool:
        return self.done


class CoreStream(TokenStream):
    """One request's new token ids from an engine core (what ``Engine.stream`` returns)."""

    _req: _Req

    @property
    def id(self) -> int:
        """The front-wide request id."""
        return self._req.rid

    @property
    def prompt_tokens(self) -> int:
        """Number of prompt tokens."""
        return self._req.prompt_len

    @property
    def finish_reason(self) -> str | None:
        """``"stop"``, ``"length"``, ``"cancelled"`` or ``"error"`` once finished."""
        return self._req.reason

    async def _wait(self) -> None:
        fut = self._req.waiter = asyncio.get_running_loop().create_future()
        await fut


class _Steps:
    """The two facts the HTTP layer reads from ``engine.steps``."""

    def __init__(self, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.vocab_size = int(vocab_size)
        self.eos_ids = frozenset(int(t) for t in eos_ids)


class CoreModel(TextCodec):
    """The tokenizer side of a core's model, rebuilt in the front from its
    :class:`~.protocol.Ready` (no weights): ``encode``, ``decode``, ``apply_chat_template``
    (:class:`~deviceops.nn.tokenizer.TextCodec`, the same code as the core's),
    ``tokenizer``, ``config``, ``device``."""

    def __init__(self, info: dict[str, Any]) -> None:
        from tokenizers import Tokenizer

        self.config = pickle.loads(info["config"])
        self.tokenizer = Tokenizer.from_str(info["tokenizer"])
        self.device = info.get("device", "core")
        self._init_chat_template(info.get("chat_template"))
        # the copy that reads special-token text as text, made now rather than in the first
        # request (a second deserialisation: seconds for Gemma 3's 262k-token vocabulary)
        self.encode_untrusted("")


class CoreClient:
    """An engine-shaped proxy of one engine core, used from one asyncio loop.

    Args:
        address: the core's ZeroMQ address.
        info: its :class:`~.protocol.Ready` info with the tokenizer side (:func:`handshake`).
        name: the device's name (``"cuda:0"``), used in messages and ``/health``.
        model: the tokenizer-side model to share (default: rebuilt from ``info``).

    Call :meth:`attach` from the running loop before use (the HTTP app does when the
    cores are ready); the client then keeps its connection, and after a failure rejoins
    the restarted core by itself (module docstring).
    """

    def __init__(self, address: str, info: dict[str, Any], *, name: str,
                 model: Any = None) -> None:
        self.address = address
        self.name = name
        self.info = dict(info)
        self.model = model if model is not None else CoreModel(info)
        self.steps = _Steps(info["vocab_size"], info["eos_ids"])
        self.max_seq = int(info["max_seq"])
        self.max_batch = int(info["max_batch"])
        self.max_queue = int(info["max_queue"])
        self.sampling_features = frozenset(info.get("features", ()))
        self.restarts = 0
        self.dead: str | None = None  # set by the supervisor: the core will not come back
        self.draining = False
        self.phases: dict[str, float] = dict.fromkeys(PHASE_NAMES, 0.0)
        self._closed = False
        self._failure: CoreFailed | None = None
        self._reqs: dict[int, _Req] = {}
        self._ids = itertools.count(1)
        self._stats: EngineStats | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ctx: Any = None
        self._sock: Any = None
        self._mon: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._cancels: list[int] = []
        self._session = 0

    # -- the Engine surface ------------------------------------------------------------
    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 32, *,
               temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
               stop: Sequence[int] | None = None, seed: int | None = None,
               ignore_eos: bool = False, presence_penalty: float | None = None,
               frequency_penalty: float | None = None, logit_bias: Any = None,
               logprobs: int | None = None, grammar: str | None = None) -> CoreStream:
        """Send one request to the core; return the async iterator of its new tokens.

        Arguments as ``Engine.stream``. Raises before sending: ``ValueError`` /
        ``TypeError`` for bad arguments, :class:`~deviceops.nn.EngineOverloaded` when
        ``max_batch + max_queue`` requests are in flight, :class:`CoreFailed` while the
        core is out of service, :class:`~deviceops.nn.EngineClosed` once closed or
        draining.
        """
        if self._failure is not None:
            raise CoreFailed(str(self._failure)) from self._failure.__cause__
        if self.closed:
            raise EngineClosed(f"engine core {self.name}: closed; it accepts no new requests")
        try:
            self.attach()  # (once per event loop)
        except RuntimeError as exc:
            raise RuntimeError(f"engine core {self.name}: used from a running asyncio event "
                               f"loop only ({exc})") from None
        ids = self._ids_of(prompt)
        max_new = check_max_new_tokens(max_new_tokens, "Engine")
        t, k, p, sd = check_sampling(temperature, top_k, top_p, seed, "Engine")
        stops = check_stop(stop, "Engine")
        pres, freq, bias, lp = check_adjustments(presence_penalty, frequency_penalty,
                                                 logit_bias, logprobs, self.steps.vocab_size,
                                                 "Engine")
        if grammar is not None and not isinstance(grammar, str):
            raise TypeError(f"Engine: grammar must be a str (llguidance's formats: "
                            f"deviceops.nn.serving.grammar), got {type(grammar).__name__}")
        asked = SamplingParams(presence_penalty=pres, frequency_penalty=freq, logit_bias=bias,
                               logprobs=lp, grammar=grammar).features()
        lacking = sorted(asked - self.sampling_features)
        if lacking:
            raise ValueError(f"Engine: {', '.join(lacking)} not supported by this model "
                             f"(the core declares {sorted(self.sampling_features)})")
        check_kv_budget(len(ids), max_new, self.max_seq, int(self.info.get("kv_blocks_total", 0)),
                        int(self.info.get("kv_block_size", 16)))
        if len(self._reqs) >= self.max_batch + self.max_queue:
            raise EngineOverloaded(
                f"engine core {self.name}: {len(self._reqs)} requests in flight (max_batch "
                f"{self.max_batch} + max_queue {self.max_queue}); retry later")
        req = _Req(next(self._ids), len(ids), max_new, lp is not None)
        self._reqs[req.rid] = req
        self._send(Submit(req.rid, pack_i32(ids), max_new, t, k or None, p, sd,
                          sorted(stops), bool(ignore_eos), pres or None, freq or None,
                          dict(bias) or None, lp, grammar))
        return CoreStream(self, req)

    async def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 32,
                       **sampling: Any) -> list[int]:
        """All new tokens of one prompt (as ``Engine.generate`` for one prompt)."""
        s = self.stream(prompt, max_new_tokens, **sampling)
        try:
            return [t async for t in s]
        finally:
            s.cancel()

    def stats(self) -> EngineStats:
        """The core's last reported stats, with this front's pending tokens."""
        import dataclasses

        st = self._stats or EngineStats(0, 0, 0, 0, 0, self.max_batch, 0, 0, 0, 0, 0, 0)
        return dataclasses.replace(st, pending_tokens=self.pending_tokens,
                                   host_phases=tuple(self.phases.items()))

    @property
    def pending_tokens(self) -> int:
        """Work in flight from this front, in tokens: for each request, its prompt until
        the first token is back, plus the tokens it may still generate."""
        n = 0
        for r in self._reqs.values():
            got = len(r.out)
            n += (0 if got else r.prompt_len) + max(0, r.max_new - got)
        return n

    @property
    def in_flight(self) -> int:
        """Requests sent and not finished."""
        return len(self._reqs)

    @property
    def failure(self) -> CoreFailed | None:
        """Why the core is out of service (died, failed, restarting), else ``None``."""
        return self._failure

    @property
    def closed(self) -> bool:
        """Closed, draining, or dead for good: no new requests."""
        return self._closed or self.draining or self.dead is not None

    def drain(self) -> None:
        """Take no new requests; those in flight finish."""
        self.draining = True

    def close(self) -> None:
        """Cancel every request in flight, say :class:`~.protocol.Bye`, close the socket."""
        if self._closed:
            return
        self._closed = True
        for req in list(self._reqs.values()):
            self._end(req, "cancelled")
        self._cancels.clear()
        if self._sock is not None:
            with contextlib.suppress(Exception):
                self._sock.send(encode(Bye()))
        self._teardown()

    # -- connection --------------------------------------------------------------------
    def attach(self) -> None:
        """Open the connection from the running asyncio loop (idempotent).

        Raises:
            RuntimeError: called outside a running asyncio event loop, or from a second
                loop while the first still runs.
        """
        loop = asyncio.get_running_loop()
        if self._loop is loop or self._closed:
            return
        if self._loop is not None:
            if not self._loop.is_closed() and self._loop.is_running():
                raise RuntimeError(f"engine core {self.name}: already attached to another "
                                   "running event loop")
            self._abandon()  # a new loop (a new asyncio.run): the old one's work cannot go on
        self._loop = loop
        if self._failure is not None:
            self._reopen()
        else:
            self._open()

    def _abandon(self) -> None:
        """End the requests of the loop this client leaves and drop its socket (its tasks
        died with that loop)."""
        for req in list(self._reqs.values()):
            self._end(req, "error", EngineClosed(
                f"engine core {self.name}: the event loop of this request ended"))
        self._cancels.clear()
        self._tasks = []
        self._session += 1
        for sock in (self._sock, self._mon):
            if sock is not None:
                with contextlib.suppress(Exception):
                    sock.close(0)
        self._sock = self._mon = None
        self._ctx = None

    def _open(self) -> None:
        import zmq
        import zmq.asyncio

        self._session += 1
        session = self._session
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        sock = self._sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.IDENTITY, f"f{os.getpid()}-{uuid.uuid4().hex[:12]}".encode())
        # a monitor address of its own: pyzmq's default names it after the socket's file
        # descriptor, which the next socket may reuse while this monitor is still closing
        mon = self._mon = sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED,
            addr=f"inproc://deviceops-core-monitor-{uuid.uuid4().hex}")
        sock.connect(self.address)
        assert self._loop is not None
        self._tasks = [self._loop.create_task(self._receive(sock, session)),
                       self._loop.create_task(self._monitor(sock, mon, session))]
        if self._failure is not None:  # waiting for a restarted core: say hello until it is
            self._tasks.append(self._loop.create_task(self._hello_until_back(sock, session)))

    def _teardown(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._tasks = []
        sock, self._sock = self._sock, None
        mon, self._mon = self._mon, None
        if sock is not None:
            with contextlib.suppress(Exception):
                sock.disable_monitor()
            sock.close(0)
        if mon is not None:
            mon.close(0)

    async def _hello_until_back(self, sock: Any, session: int) -> None:
        """While the core is out of service, say hello every :data:`HELLO_S` (the monitor's
        connect event alone could be missed); the restarted core answers the first one it
        gets, the others are answered again and change nothing."""
        while session == self._session and self._failure is not None and self.dead is None:
            sock.send(encode(Hello(info=False)))
            await asyncio.sleep(HELLO_S)

    async def _monitor(self, sock: Any, mon: Any, session: int) -> None:
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        try:
            while True:
                ev = await recv_monitor_message(mon)
                if session != self._session:
                    return
                if ev["event"] == zmq.EVENT_CONNECTED:
                    sock.send(encode(Hello(info=False)))
                elif ev["event"] == zmq.EVENT_DISCONNECTED:
                    self._lost(_CoreLost("the engine core process ended (its connection "
                                         "closed)"))
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the monitor itself broke: treat as a lost core
            if session == self._session and not self._closed:
                self._lost(_CoreLost(f"watching the connection failed: {exc!r}"))
        finally:
            if mon is not self._mon:
                mon.close(0)

    async def _receive(self, sock: Any, session: int) -> None:
        while True:
            payload = await sock.recv()
            if session != self._session:
                return
            try:
                msg = decode_front(payload)
            except Exception as exc:
                log.warning("engine core %s: dropping a malformed message: %s", self.name, exc)
                continue
            if isinstance(msg, Step):
                self._deliver(msg)
            elif isinstance(msg, Ready):
                self._ready(msg.info)
            elif isinstance(msg, Failed):
                self._lost(_CoreLost(f"its engine failed ({msg.message})"))
                return

    def _ready(self, info: dict[str, Any]) -> None:
        self.info |= info
        self.sampling_features = frozenset(self.info.get("features", ()))
        if self._failure is not None:
            self._failure = None
            self._stats = None
            self.restarts += 1
            log.info("engine core %s is back (restart %d, pid %s)", self.name, self.restarts,
                     info.get("pid"))

    def _deliver(self, m: Step) -> None:
        fields: dict[str, Any] = dict(zip(STAT_FIELDS, m.stats, strict=True))
        self._stats = EngineStats(**fields)
        self.phases = dict(zip(PHASE_NAMES, m.phases, strict=False))
        reqs = self._reqs
        if m.rids:
            toks = unpack_i32(m.tokens)
            at = 0
            for rid, n in zip(unpack_i64(m.rids), unpack_i32(m.counts), strict=True):
                req = reqs.get(rid)
                got = toks[at:at + n]
                at += n
                if req is None:
                    continue  # cancelled here already
                req.out.extend(got)
                req.buf.extend(got)
                self._notify(req)
        if m.logprobs:
            for rid, tok, lp, top in m.logprobs:
                req = reqs.get(rid)
                if req is not None:
                    req.logprobs.append(TokenLogprob(tok, lp, tuple((int(a), float(b))
                                                                    for a, b in top)))
        for f in m.done:
            req = reqs.get(f.rid)
            if req is not None:
                self._end(req, f.reason, None if f.kind is None else self._error(f.kind,
                                                                                f.message))

    def _error(self, kind: str, msg: str | None) -> BaseException:
        text = msg or kind
        if kind == "failed":
            exc = CoreFailed(f"engine core {self.name} failed: {text}")
            exc.__cause__ = _CoreLost(text)
            return exc
        if kind == "overloaded":
            return EngineOverloaded(text)
        if kind == "closed":
            return EngineClosed(text)
        if kind == "invalid":
            return ValueError(text)
        return RuntimeError(text)

    def _lost(self, cause: _CoreLost) -> None:
        """The core is out of service: end its requests, reconnect on a fresh socket."""
        if self._failure is not None or self._closed:
            return
        self._failure = CoreFailed(f"engine core {self.name} is out of service: {cause}")
        self._failure.__cause__ = cause
        log.error("engine core %s is out of service: %s", self.name, cause)
        for req in list(self._reqs.values()):
            err = CoreFailed(str(self._failure))  # one per request: each is raised once
            err.__cause__ = cause
            self._end(req, "error", err)
        self._cancels.clear()
        self._teardown()
        if self._loop is not None and not self._loop.is_closed():
            self._reopen()

    def _reopen(self) -> None:
        """Connect again after a loss: a fresh socket to the same address, whose hellos the
        restarted core answers (a Ray replica's client asks the actor for its new address
        first: :mod:`.ray_remote`)."""
        self._open()

    # -- requests ----------------------------------------------------------------------
    def _send(self, msg: Any) -> None:
        self._sock.send(encode(msg))

    def _ids_of(self, prompt: str | Sequence[int]) -> list[int]:
        return prompt_ids(prompt, self.model.encode, self.steps.vocab_size, self.max_seq)

    def _notify(self, req: _Req) -> None:
        fut = req.waiter
        if fut is not None:
            req.waiter = None
            if not fut.done():
                with contextlib.suppress(RuntimeError):  # its loop is closed
                    fut.set_result(None)

    def _end(self, req: _Req, reason: str, error: BaseException | None = None) -> None:
        if req.done:
            return
        req.done, req.reason, req.error = True, reason, error
        self._reqs.pop(req.rid, None)
        self._notify(req)

    def _cancel(self, req: _Req) -> None:
        if req.done:
            return
        self._end(req, "cancelled")
        if self._failure is None and not self._closed and self._sock is not None:
            self._cancels.append(req.rid)
            if len(self._cancels) == 1 and self._loop is not None and not self._loop.is_closed():
                try:
                    self._loop.call_soon(self._flush_cancels)
                except RuntimeError:  # not the loop's thread
                    self._loop.call_soon_threadsafe(self._flush_cancels)

    def _flush_cancels(self) -> None:
        rids, self._cancels = self._cancels, []
        if rids and self._sock is not None:
            self._send(Cancel(rids))
