"""The replica actor: one fail-stop engine serving the fronts that subscribe to it.

A replica (:class:`_ReplicaServer`, started by :class:`~.ray_cluster.RayReplicas`) loads
its model and engine as ``python -m deviceops.nn.serve`` would (:mod:`.cli`) and runs every
request a front submits as a local task that drives the engine.

**One token stream per front, not per request.** Ray streaming generators carry the tokens
back (``num_returns="streaming"``), but a generator item costs a report RPC and ~1 ms of
latency on a small host, so one generator per request would cost an RPC per token. Instead
each front (*subscriber*) opens one :meth:`_ReplicaServer.pump` generator per replica;
the replica runs every request it submitted as a local task that drives the engine, and
the pump yields, whenever something happened, one item for all of them: ``(events,
stats)``, with ``events`` a list of ``(request id, new tokens, finish reason or None,
error or None)`` and ``stats`` the engine's :class:`~.requests.EngineStats` (``None`` when
unchanged). A decode step of 64 rows is one item, not 64. Submissions
(:meth:`_ReplicaServer.submit`) and cancellations are fire-and-forget actor calls; their
outcome arrives through the pump.

**Epochs.** A subscriber's requests carry its epoch. A pump or submit with a newer epoch
supersedes the older one: its requests are cancelled and its pump ends. The front bumps
the epoch when it re-attaches (a new event loop, or after the replica was restarted), so a
front's stale work never lingers in a replica. Ray does not order the calls of one caller
to an async actor, so a cancel that overtakes its submit is remembered.

**Failure.** Every engine is fail-stop. When a step fails (a device error) the replica
reports ``("failed", message)`` for every request it held, then exits the process (status
1) a moment later, so that Ray restarts it on a fresh device context (``max_restarts``).
A replica whose model fails to load raises in its constructor; Ray marks the actor dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .ray_cluster import ReplicaSpec
from .requests import EngineClosed, EngineFailed, EngineOverloaded, RequestStream

__all__ = ["PUMP_IDLE_S"]

log = logging.getLogger("deviceops.nn.ray")

#: Seconds between the pump's checks for changed engine stats while nothing happens.
PUMP_IDLE_S = 0.25


@dataclass(eq=False)
class _Sub:
    """One front's requests on this replica (its epoch, outbox and running tasks)."""

    name: str
    epoch: int
    out: dict[int, list[Any]] = field(default_factory=dict)  # rid -> [tokens, reason, error]
    streams: dict[int, RequestStream] = field(default_factory=dict)
    tasks: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    cancelled: set[int] = field(default_factory=set)  # cancels that overtook their submit
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    live: bool = True

    def push(self, rid: int, tok: int) -> None:
        e = self.out.get(rid)
        if e is None:
            self.out[rid] = [[tok], None, None]
        else:
            e[0].append(tok)
        self.wake.set()

    def end(self, rid: int, reason: str, error: tuple[str, str] | None = None,
            tokens: Sequence[int] = ()) -> None:
        e = self.out.get(rid)
        if e is None:
            self.out[rid] = [list(tokens), reason, error]
        else:
            e[0].extend(tokens)
            e[1], e[2] = reason, error
        self.wake.set()

    def take(self) -> list[tuple[int, list[int], str | None, tuple[str, str] | None]]:
        out, self.out = self.out, {}
        return [(rid, e[0], e[1], e[2]) for rid, e in out.items()]


def _cause(exc: BaseException) -> str:
    c = exc.__cause__
    return str(exc) if c is None else f"{type(c).__name__}: {c}"


class _ReplicaServer:
    """The replica actor: one fail-stop engine, requests run as local tasks (module docstring).

    Args:
        spec: what to load (:class:`ReplicaSpec`).
    """

    def __init__(self, spec: ReplicaSpec) -> None:
        from .cli import _build_engine

        device: str | int = "cpu" if spec.device == "cpu" else 0  # Ray picked the GPU
        self.spec = spec
        self.engine = _build_engine(spec.model, device=device, dtype=spec.dtype,
                                    max_batch=spec.max_batch, max_seq=spec.max_seq,
                                    max_queue=spec.max_queue, prefill_chunk=spec.prefill_chunk,
                                    fail_stop=True)
        self._subs: dict[str, _Sub] = {}
        self._exiting = False
        gc.collect()
        gc.freeze()  # a full cyclic GC would otherwise walk the start-up heap mid-step

    # -- calls -------------------------------------------------------------------------
    async def info(self, tokenizer: bool = True) -> dict[str, Any]:
        """What a front needs: limits, device, node; the tokenizer when asked.

        Raises:
            EngineFailed: the engine failed (the replica is about to restart).
        """
        import ray

        eng = self.engine
        if eng.failure is not None:
            raise EngineFailed(str(eng.failure))
        model = eng.model
        out: dict[str, Any] = {
            "vocab_size": eng.steps.vocab_size, "eos_ids": sorted(eng.steps.eos_ids),
            "max_seq": eng.max_seq, "max_batch": eng.max_batch, "max_queue": eng.max_queue,
            "device": str(getattr(model, "device", self.spec.device)), "pid": os.getpid(),
            "node": ray.util.get_node_ip_address(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        }
        if tokenizer:
            template = getattr(model, "chat_template", None)
            out |= {"tokenizer": model.tokenizer.to_str(), "config": model.config,
                    "chat_template": None if template is None else template.source}
        return out

    async def submit(self, sub: str, epoch: int, rid: int, ids: list[int], max_new: int,
                     sampling: tuple[float, int | None, float | None, int | None],
                     stop: list[int] | None, ignore_eos: bool, stream: bool) -> None:
        """Queue request ``rid`` of front ``sub``; its tokens come through :meth:`pump`."""
        s = self._sub(sub, epoch)
        if s is None:
            return  # a superseded front's late call
        if rid in s.cancelled:
            s.cancelled.discard(rid)
            s.end(rid, "cancelled")
            return
        t, k, p, seed = sampling
        try:
            rs = self.engine.stream(ids, max_new, temperature=t, top_k=k, top_p=p, seed=seed,
                                    stop=stop, ignore_eos=ignore_eos)
        except EngineFailed as exc:
            s.end(rid, "error", ("failed", _cause(exc)))
            self._engine_failed()
            return
        except EngineOverloaded as exc:
            s.end(rid, "error", ("overloaded", str(exc)))
            return
        except EngineClosed as exc:
            s.end(rid, "error", ("closed", str(exc)))
            return
        except (ValueError, TypeError) as exc:
            s.end(rid, "error", ("invalid", str(exc)))
            return
        s.streams[rid] = rs
        s.tasks[rid] = asyncio.get_running_loop().create_task(self._run(s, rid, rs, stream))

    async def cancel(self, sub: str, rids: list[int]) -> None:
        """Cancel front ``sub``'s requests ``rids`` (their slots are freed at once)."""
        s = self._subs.get(sub)
        if s is None:
            return
        for rid in rids:
            rs = s.streams.get(rid)
            if rs is not None:
                rs.cancel()
            elif rid not in s.tasks:
                s.cancelled.add(rid)

    async def unsubscribe(self, sub: str, epoch: int) -> None:
        """Front ``sub`` (at ``epoch`` or before) is gone: cancel its requests, end its pump."""
        s = self._subs.get(sub)
        if s is not None and s.epoch <= epoch:
            self._drop(s)

    async def pump(self, sub: str, epoch: int) -> AsyncIterator[Any]:
        """Front ``sub``'s event stream (call with ``num_returns="streaming"``): items
        ``(events, stats)`` as the module docstring says, until superseded or unsubscribed."""
        s = self._sub(sub, epoch)
        if s is None:
            return
        last = None
        try:
            while s.live:
                if not s.out:
                    s.wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(s.wake.wait(), PUMP_IDLE_S)
                    if not s.live:
                        break
                events = s.take()
                st = self.engine.stats()
                if events or st != last:
                    yield events, (None if st == last else st)
                    last = st
        finally:
            if self._subs.get(sub) is s:
                self._drop(s)

    async def stats(self) -> Any:
        """The engine's :class:`~.requests.EngineStats` now."""
        return self.engine.stats()

    # -- inside ------------------------------------------------------------------------
    def _sub(self, name: str, epoch: int) -> _Sub | None:
        s = self._subs.get(name)
        if s is not None and s.epoch == epoch:
            return s
        if s is not None and s.epoch > epoch:
            return None
        if s is not None:
            self._drop(s)
        s = self._subs[name] = _Sub(name, epoch)
        return s

    def _drop(self, s: _Sub) -> None:
        s.live = False
        s.wake.set()
        if self._subs.get(s.name) is s:
            del self._subs[s.name]
        for rs in list(s.streams.values()):
            rs.cancel()

    async def _run(self, s: _Sub, rid: int, rs: RequestStream, stream: bool) -> None:
        toks: list[int] = []
        try:
            async for tok in rs:
                if stream:
                    s.push(rid, tok)
                else:
                    toks.append(tok)
            s.end(rid, rs.finish_reason or "cancelled", None, toks)
        except EngineFailed as exc:
            s.end(rid, "error", ("failed", _cause(exc)), toks)
            self._engine_failed()
        except Exception as exc:  # this request's step failed; the engine goes on
            s.end(rid, "error", ("error", f"{type(exc).__name__}: {exc}"), toks)
        finally:
            rs.cancel()
            s.streams.pop(rid, None)
            s.tasks.pop(rid, None)

    def _engine_failed(self) -> None:
        """The engine is out of service: exit soon (the pumps flush the errors first) so
        that Ray restarts this replica in a fresh process."""
        if self._exiting:
            return
        self._exiting = True
        log.error("replica engine failed (%s); exiting for a restart", self.engine.failure)
        asyncio.get_running_loop().call_later(1.0, os._exit, 1)
