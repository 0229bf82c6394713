"""An engine-shaped proxy of one Ray replica: :class:`RemoteEngine` and :class:`RemoteStream`.

The HTTP layer (:mod:`.http`) and the batch driver (:mod:`.ray_batch`) use a replica
actor (:mod:`.ray_replica`) through a :class:`RemoteEngine`, which has the surface they use of an
:class:`~deviceops.nn.Engine`: ``stream`` (an async iterator of new token ids with
``cancel``, ``tokens``, ``finish_reason``), ``stats``, ``pending_tokens``, ``failure``,
``closed``, ``close``, ``max_seq``, ``steps.vocab_size``/``eos_ids`` and ``model`` (the
tokenizer and chat template, rebuilt from the replica's; no weights).

**How tokens come back.** The proxy subscribes to the replica's
:meth:`~.ray_replica._ReplicaServer.pump` (a Ray streaming generator) from the asyncio loop that
first uses it, with a fresh subscriber name and epoch; each item carries the events of
all its requests since the last one and the engine's stats. Requests are sent with a
fire-and-forget ``submit`` call, cancellations batched into one ``cancel`` call per loop
iteration. Used from another loop later (a new ``asyncio.run``), it re-subscribes with a
new epoch and the replica drops the old subscription's work.

**Load.** :attr:`RemoteEngine.pending_tokens` is counted here: each request in flight
counts its prompt until its first token is back, plus ``max_new_tokens`` minus the
tokens received. It is exact up to what is still on the wire and needs no round trip, so
routing stays one synchronous decision. ``max_batch + max_queue`` requests in flight make
:meth:`RemoteEngine.stream` raise :class:`~deviceops.nn.EngineOverloaded`.

**Failure.** When the pump fails (the actor died, was killed, its node was lost) or the
replica reports that its engine failed, every request in flight ends with
:class:`ReplicaFailed` (an :class:`~deviceops.nn.EngineFailed`), :attr:`RemoteEngine.failure`
is set (new requests are refused with it) and the proxy asks the actor for its ``info``
until Ray has restarted it, then subscribes again (:attr:`RemoteEngine.restarts` counts
it). If Ray will not restart it (``ActorDiedError``: killed for good, restarts used up, its
model failed to load), :attr:`RemoteEngine.dead` says why and the proxy stays closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._args import check_max_new_tokens, check_sampling, check_stop
from .ray_cluster import FrontModel, import_ray
from .requests import EngineClosed, EngineFailed, EngineOverloaded, EngineStats, TokenStream

__all__ = ["RemoteEngine", "RemoteStream", "ReplicaFailed", "ReplicaLost", "summary"]

log = logging.getLogger("deviceops.nn.ray")

#: Seconds one call to a restarting replica may take before it is tried again.
REJOIN_CALL_S = 60.0


class ReplicaFailed(EngineFailed):
    """The replica holding this request died or failed; retry the request (it is 503)."""


class ReplicaLost(RuntimeError):
    """Why a replica went out of service (the ``__cause__`` of :class:`ReplicaFailed`; its
    own ``__cause__`` is Ray's error when the actor died)."""


def summary(exc: BaseException) -> str:
    """A one-line account of a (Ray) error: its first line and the line saying why."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    why = [ln for ln in lines[1:] if "because" in ln or ln.startswith("The actor")]
    text = " ".join(lines[:1] + why[:1]) or type(exc).__name__
    return f"{type(exc).__name__}: {text[:400]}"


@dataclass(eq=False)
class _Req:
    rid: int
    prompt_len: int
    max_new: int
    out: list[int] = field(default_factory=list)
    buf: deque[int] = field(default_factory=deque)
    reason: str | None = None
    error: BaseException | None = None
    done: bool = False
    waiter: asyncio.Future[None] | None = None  # a consumer waiting for tokens or the end

    @property
    def finished(self) -> bool:
        return self.done


class RemoteStream(TokenStream):
    """One request's new token ids from a replica (what ``Engine.stream`` returns there)."""

    _req: _Req

    @property
    def id(self) -> int:
        """The proxy-wide request id."""
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


class RemoteEngine:
    """An engine-shaped proxy of one replica actor, used from one asyncio loop at a time.

    Args:
        actor: the replica's actor handle.
        info: the replica's :meth:`~.ray_replica._ReplicaServer.info`.
        name: the replica's name (``"r0"``), used in messages.
        model: a :class:`~.ray_cluster.FrontModel` to share (default: built from ``info``).

    The proxy subscribes to the replica's pump on first use in a running loop (again,
    with a new epoch, when used from another loop), and after a failure rejoins the
    restarted actor by itself (module docstring).
    """

    def __init__(self, actor: Any, info: dict[str, Any], *, name: str,
                 model: FrontModel | None = None) -> None:
        self.actor = actor
        self.name = name
        self.info = info
        self.model = model if model is not None else FrontModel(info)
        self.steps = _Steps(info["vocab_size"], info["eos_ids"])
        self.max_seq = int(info["max_seq"])
        self.max_batch = int(info["max_batch"])
        self.max_queue = int(info["max_queue"])
        self.sub = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.restarts = 0
        self.dead: str | None = None  # why Ray will not bring the actor back
        self.draining = False
        self._closed = False
        self._failure: ReplicaFailed | None = None
        self._reqs: dict[int, _Req] = {}
        self._ids = itertools.count(1)
        self._epoch = 0
        self._stats: EngineStats | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._cancels: list[int] = []

    # -- the Engine surface ------------------------------------------------------------
    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 32, *,
               temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
               stop: Sequence[int] | None = None, seed: int | None = None,
               ignore_eos: bool = False, stream: bool = True) -> RemoteStream:
        """Send one request to the replica; return the async iterator of its new tokens.

        Arguments as ``Engine.stream``; ``stream=False`` has the replica send the tokens
        once, at the end (batch generation). Raises before sending: ``ValueError`` /
        ``TypeError`` for bad arguments, :class:`EngineOverloaded` when
        ``max_batch + max_queue`` requests are in flight, :class:`ReplicaFailed` while the
        replica is out of service, :class:`EngineClosed` once closed or draining.
        """
        self.attach()
        if self._failure is not None:
            raise ReplicaFailed(str(self._failure)) from self._failure.__cause__
        if self.closed:
            raise EngineClosed(f"replica {self.name}: closed; it accepts no new requests")
        ids = self._ids_of(prompt)
        max_new = check_max_new_tokens(max_new_tokens, "Engine")
        t, _, _, _ = check_sampling(temperature, top_k, top_p, seed, "Engine")
        stops = check_stop(stop, "Engine")
        if len(self._reqs) >= self.max_batch + self.max_queue:
            raise EngineOverloaded(
                f"replica {self.name}: {len(self._reqs)} requests in flight (max_batch "
                f"{self.max_batch} + max_queue {self.max_queue}); retry later")
        req = _Req(next(self._ids), len(ids), max_new)
        self._reqs[req.rid] = req
        self.actor.submit.remote(self.sub, self._epoch, req.rid, ids, max_new,
                                 (t, top_k, top_p, seed), sorted(stops) or None,
                                 bool(ignore_eos), bool(stream))
        return RemoteStream(self, req)

    async def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 32,
                       **sampling: Any) -> list[int]:
        """All new tokens of one prompt (as ``Engine.generate`` for one prompt)."""
        s = self.stream(prompt, max_new_tokens, stream=False, **sampling)
        try:
            return [t async for t in s]
        finally:
            s.cancel()

    def stats(self) -> EngineStats:
        """The replica's last reported stats, with this front's pending tokens."""
        st = self._stats or EngineStats(0, 0, 0, 0, 0, self.max_batch, 0, 0, 0, 0, 0, 0)
        return dataclasses.replace(st, pending_tokens=self.pending_tokens)

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
    def failure(self) -> ReplicaFailed | None:
        """Why the replica is out of service (dead or restarting), else ``None``."""
        return self._failure

    @property
    def closed(self) -> bool:
        """Closed, draining, or dead for good: no new requests."""
        return self._closed or self.draining or self.dead is not None

    def drain(self) -> None:
        """Take no new requests; those in flight finish."""
        self.draining = True

    def close(self) -> None:
        """Cancel every request in flight and stop listening to the replica."""
        self._closed = True
        for req in list(self._reqs.values()):
            self._cancel(req)
        self._flush_cancels()
        if self._task is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._task = None
        try:
            self.actor.unsubscribe.remote(self.sub, self._epoch)
        except Exception:  # the actor or Ray is already gone
            log.debug("unsubscribing from %s failed", self.name, exc_info=True)

    # -- the pump ----------------------------------------------------------------------
    def attach(self) -> None:
        """Make sure this loop listens to the replica (pump) or waits for its restart.

        Raises:
            RuntimeError: called outside a running asyncio event loop.
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(f"replica {self.name}: a Ray replica is used from a running "
                               "asyncio event loop (Ray's awaitables are asyncio's)") from None
        if self._closed or self.dead is not None:
            return
        if self._loop is loop and self._task is not None and not self._task.done():
            return
        if self._loop is not None and self._loop is not loop:
            for req in list(self._reqs.values()):  # the old loop's requests cannot go on
                self._end(req, "error", EngineClosed(
                    f"replica {self.name}: the event loop of this request ended"))
        self._loop = loop
        self._epoch += 1
        coro = self._rejoin() if self._failure is not None else self._pump(self._epoch)
        self._task = loop.create_task(coro)

    async def _pump(self, epoch: int) -> None:
        try:
            gen = self.actor.pump.options(num_returns="streaming").remote(self.sub, epoch)
            async for ref in gen:
                events, st = await ref
                if epoch != self._epoch:
                    return
                self._deliver(events, st)
            raise RuntimeError("the replica ended its event stream")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if epoch == self._epoch and not self._closed:
                self._lost(exc)

    def _deliver(self, events: list[Any], st: EngineStats | None) -> None:
        if st is not None:
            self._stats = st
        failed: tuple[str, str] | None = None
        for rid, toks, reason, err in events:
            req = self._reqs.get(rid)
            if req is None:
                continue  # cancelled here already
            if toks:
                req.out.extend(toks)
                req.buf.extend(toks)
            if reason is not None:
                self._end(req, reason, None if err is None else self._error(err))
                if err is not None and err[0] == "failed":
                    failed = err
            else:
                self._notify(req)
        if failed is not None:
            self._lost(ReplicaLost(failed[1]), f"its engine failed ({failed[1]})")

    def _error(self, err: tuple[str, str]) -> BaseException:
        kind, msg = err
        if kind == "failed":
            exc = ReplicaFailed(f"replica {self.name} failed: {msg}")
            exc.__cause__ = ReplicaLost(msg)
            return exc
        if kind == "overloaded":
            return EngineOverloaded(msg)
        if kind == "closed":
            return EngineClosed(msg)
        if kind == "invalid":
            return ValueError(msg)
        return RuntimeError(msg)

    def _lost(self, exc: BaseException, what: str | None = None) -> None:
        """The replica is out of service: end its requests, then wait for Ray's restart."""
        if self._failure is not None:
            return
        why = what or summary(exc)
        self._failure = ReplicaFailed(f"replica {self.name} is out of service: {why}")
        cause = ReplicaLost(why)
        cause.__cause__ = exc
        self._failure.__cause__ = cause
        log.error("replica %s is out of service: %s", self.name, why)
        for req in list(self._reqs.values()):
            err = ReplicaFailed(str(self._failure))  # one per request: each is raised once
            err.__cause__ = cause
            self._end(req, "error", err)
        self._epoch += 1
        if not self._closed and self._loop is not None:
            self._task = self._loop.create_task(self._rejoin())

    async def _rejoin(self) -> None:
        ray = import_ray()
        delay = 0.2
        while not self._closed:
            try:
                info = await asyncio.wait_for(self.actor.info.remote(False), REJOIN_CALL_S)
            except ray.exceptions.ActorDiedError as exc:
                self.dead = summary(exc)
                log.error("replica %s will not come back: %s", self.name, self.dead)
                return
            except asyncio.CancelledError:
                raise
            except Exception:  # restarting, or its engine failed and it is about to exit
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)
                continue
            self.info |= info
            self.restarts += 1
            self._failure = None
            self._stats = None
            self._epoch += 1
            log.info("replica %s is back (restart %d, pid %s)", self.name, self.restarts,
                     info.get("pid"))
            assert self._loop is not None
            self._task = self._loop.create_task(self._pump(self._epoch))
            return

    # -- requests ----------------------------------------------------------------------
    def _ids_of(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.model.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            raise TypeError(f"Engine: prompt must be a str or a list of token ids, got "
                            f"{type(prompt).__name__}")
        if not ids:
            raise ValueError("Engine: prompt is empty (it must have at least one token)")
        bad = [t for t in ids if not 0 <= t < self.steps.vocab_size]
        if bad:
            raise ValueError(f"Engine: prompt token ids {bad[:4]} outside "
                             f"[0, {self.steps.vocab_size})")
        if len(ids) > self.max_seq:
            raise ValueError(f"Engine: prompt has {len(ids)} tokens, more than max_seq="
                             f"{self.max_seq} (shorten the prompt)")
        return ids

    def _notify(self, req: _Req) -> None:
        fut = req.waiter
        if fut is not None:
            req.waiter = None
            if not fut.done():
                # RuntimeError: its event loop is closed, nobody waits any more
                with contextlib.suppress(RuntimeError):
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
        if self._failure is None and not self._closed:
            self._cancels.append(req.rid)
            if len(self._cancels) == 1 and self._loop is not None and not self._loop.is_closed():
                try:
                    self._loop.call_soon(self._flush_cancels)
                except RuntimeError:  # not the loop's thread
                    self._loop.call_soon_threadsafe(self._flush_cancels)

    def _flush_cancels(self) -> None:
        rids, self._cancels = self._cancels, []
        if rids:
            try:
                self.actor.cancel.remote(self.sub, rids)
            except Exception:
                log.debug("cancelling on %s failed", self.name, exc_info=True)
