"""Model replicas as Ray actors: the replica side (the front side is :mod:`._ray_front`).

A **replica** is a Ray actor (:class:`_ReplicaServer`) that owns one fail-stop
:class:`~deviceops.nn.Engine` over one model on one device: ``num_gpus=1`` on CUDA (Ray
sets ``CUDA_VISIBLE_DEVICES``, so the engine runs on the actor's device 0), or a cpu-backend
engine for CPU replicas (``num_gpus=0``). :class:`RayReplicas` starts and stops a set of them
(ownership: actors it starts die with it, and with the process that created it).

**One token stream per front, not per request.** Ray streaming generators carry the tokens
back (``num_returns="streaming"``), but a generator item costs a report RPC and ~1 ms of
latency on a small host, so one generator per request would cost an RPC per token. Instead
each front (*subscriber*) opens one :meth:`_ReplicaServer.pump` generator per replica;
the replica runs every request it submitted as a local task that drives the engine, and
the pump yields, whenever something happened, one item for all of them: ``(events,
stats)``, with ``events`` a list of ``(request id, new tokens, finish reason or None,
error or None)`` and ``stats`` the engine's :class:`~._requests.EngineStats` (``None`` when
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

Ray is optional (``pip install 'deviceops[ray]'``) and imported lazily: :func:`import_ray`
raises :class:`RayMissing` naming the install command.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import itertools
import logging
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._requests import EngineClosed, EngineFailed, EngineOverloaded, RequestStream

__all__ = ["INSTALL_HINT", "FrontModel", "RayMissing", "RayReplicas", "ReplicaSpec",
           "import_ray", "init_ray"]

log = logging.getLogger("deviceops.nn.ray")

INSTALL_HINT = "pip install 'deviceops[ray]'"

#: Seconds between the pump's checks for changed engine stats while nothing happens.
PUMP_IDLE_S = 0.25


class RayMissing(ImportError):
    """Ray is not installed; the message says what to install."""


def import_ray() -> Any:
    """The ``ray`` module.

    Raises:
        RayMissing: Ray is not installed (the message names ``pip install 'deviceops[ray]'``).
    """
    try:
        import ray
    except ImportError as exc:
        raise RayMissing(
            f"Ray is not installed; serving or generating on a Ray cluster needs it: "
            f"{INSTALL_HINT} (Ray >= 2.60)") from exc
    return ray


def init_ray(address: str | None = None, **kw: Any) -> Any:
    """Connect to a Ray cluster once per process and return the ``ray`` module.

    Args:
        address: as ``ray.init`` takes it: ``None`` or ``""`` starts a local cluster (or
            joins the one ``RAY_ADDRESS`` names), ``"auto"`` joins the cluster running on
            this machine, ``"host:6379"`` a remote head (GCS address). Ray Client addresses
            (``ray://``) are not supported: the token streams need a driver connection.
        **kw: more ``ray.init`` arguments (``num_cpus``, ``object_store_memory``, ...),
            used only when this call starts the connection.

    Raises:
        RayMissing: Ray is not installed.
        ValueError: a Ray Client address (``ray://...``).
    """
    ray = import_ray()
    if address and address.startswith("ray://"):
        raise ValueError(f"Ray address {address!r}: Ray Client (ray://) is not supported, "
                         "use the head's GCS address (host:6379) or 'auto' on a cluster node")
    if not ray.is_initialized():
        if not address:
            kw.setdefault("include_dashboard", False)
        ray.init(address=address or None, **kw)
    return ray


@dataclass(frozen=True)
class ReplicaSpec:
    """What each replica loads and how Ray places it.

    Attributes:
        model: ``"smollm2"`` or a path to a ``.gguf`` file (present on every node).
        device: ``"cuda"`` (one GPU per replica, ``num_gpus=1``) or ``"cpu"`` (cpu backend).
        dtype, max_batch, max_seq, max_queue, prefill_chunk: the engine's, as
            ``python -m deviceops.nn.serve`` takes them (per replica).
        num_cpus: CPUs Ray reserves per replica.
        max_restarts: times Ray restarts a replica that died (``-1``: always).
    """

    model: str = "smollm2"
    device: str = "cuda"
    dtype: str | None = None
    max_batch: int = 32
    max_seq: int = 2048
    max_queue: int | None = None
    prefill_chunk: int = 512
    num_cpus: float = 1.0
    max_restarts: int = 4

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"ReplicaSpec: device {self.device!r} must be 'cuda' or 'cpu'")

    def actor_options(self) -> dict[str, Any]:
        """``ActorClass.options(...)`` for one replica."""
        return {"num_gpus": 1 if self.device == "cuda" else 0, "num_cpus": self.num_cpus,
                "max_restarts": self.max_restarts, "max_task_retries": 0,
                "max_concurrency": 100_000}


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
        from .serve import _build_engine

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
            template = getattr(model, "_template", None)
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
        """The engine's :class:`~._requests.EngineStats` now."""
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


@functools.cache
def _actor_class() -> Any:
    ray = import_ray()
    return ray.remote(_ReplicaServer)


class FrontModel:
    """The tokenizer side of a replica's model, rebuilt in the front (no weights).

    Provides what the HTTP layer and the batch driver use of a ``CausalLM``: ``encode``,
    ``decode``, ``apply_chat_template``, ``tokenizer``, ``config``, ``device``.
    """

    def __init__(self, info: dict[str, Any]) -> None:
        from tokenizers import Tokenizer

        from .tokenizer import ChatTemplate

        self.config = info["config"]
        self.tokenizer = Tokenizer.from_str(info["tokenizer"])
        self.device = info.get("device", "ray")
        self._template = None
        src = info.get("chat_template")
        if src:
            self._template = ChatTemplate(src, bos_token=self._token_text(self.config.bos_token_id),
                                          eos_token=self._token_text(self.config.eos_token_id))

    def _token_text(self, tid: int | None) -> str:
        if tid is None:
            return ""
        t = self.tokenizer.id_to_token(int(tid))
        return "" if t is None else str(t)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, exactly as the replica's ``CausalLM.encode``."""
        if not isinstance(text, str):
            raise TypeError(f"encode: text must be a str, got {type(text).__name__}")
        ids = [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False).ids]
        if self.config.add_bos_token and self.config.bos_token_id is not None:
            ids = [self.config.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special tokens kept)."""
        return str(self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False))

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> str:
        """The prompt text of a conversation (``add_generation_prompt=True``).

        Raises:
            ValueError: the checkpoint has no chat template, or a message is malformed.
        """
        if self._template is None:
            raise ValueError("apply_chat_template: this checkpoint has no chat template")
        return self._template.render(messages, add_generation_prompt=True)


class RayReplicas:
    """A set of replica actors on a Ray cluster (started here, owned by this process).

    Args:
        spec: what each replica loads (:class:`ReplicaSpec`).
        replicas: how many to start now (``None``: one per GPU of the cluster for CUDA
            replicas, one for CPU replicas).
        address: the cluster (:func:`init_ray`); used when Ray is not yet connected.
        ray_init: more ``ray.init`` arguments (a local cluster's ``num_cpus``, ...).

    Raises:
        RayMissing: Ray is not installed.
        ValueError: CUDA replicas on a cluster with fewer GPUs than replicas.

    Example:
        >>> pool = RayReplicas(ReplicaSpec("smollm2", "cuda"), 2, address="auto")
        >>> nn.batch_generate(prompts, 64, ray=pool)
        >>> pool.shutdown()
    """

    def __init__(self, spec: ReplicaSpec, replicas: int | None = None, *,
                 address: str | None = None, ray_init: dict[str, Any] | None = None) -> None:
        self.ray = init_ray(address, **(ray_init or {}))
        self.spec = spec
        self.actors: dict[str, Any] = {}
        self._names = itertools.count()
        if replicas is None:
            replicas = max(1, self.cluster_gpus()) if spec.device == "cuda" else 1
        if replicas < 1:
            raise ValueError(f"RayReplicas: replicas={replicas} must be at least 1")
        self.spawn(replicas)

    def cluster_gpus(self) -> int:
        """GPUs the cluster has (all nodes)."""
        return int(self.ray.cluster_resources().get("GPU", 0))

    def spawn(self, n: int) -> list[tuple[str, Any]]:
        """Start ``n`` more replica actors (not waiting for their model to load).

        Returns:
            ``(name, actor handle)`` pairs; names are ``r0``, ``r1``, ... never reused.

        Raises:
            ValueError: CUDA replicas beyond the cluster's GPUs, or not enough free CPUs or
                GPUs for ``n`` more now (a replica Ray cannot place would wait for
                resources forever; an autoscaling cluster must be scaled first).
        """
        self.check_room(n)
        cls = _actor_class().options(**self.spec.actor_options())
        out = []
        for _ in range(n):
            name = f"r{next(self._names)}"
            actor = cls.remote(self.spec)
            self.actors[name] = actor
            out.append((name, actor))
        return out

    def check_room(self, n: int) -> None:
        """Raise ``ValueError`` unless the cluster can place ``n`` more replicas now
        (:meth:`spawn`)."""
        if self.spec.device == "cuda":
            gpus, want = self.cluster_gpus(), len(self.actors) + n
            if want > gpus:
                raise ValueError(
                    f"{want} CUDA replicas need {want} GPUs (one each) but the Ray cluster has "
                    f"{gpus}; start fewer replicas, add GPU nodes, or use CPU replicas "
                    "(--device cpu)")
        need = {"CPU": self.spec.num_cpus * n}
        if self.spec.device == "cuda":
            need["GPU"] = float(n)
        free = self.ray.available_resources()
        short = [k for k, v in need.items() if free.get(k, 0.0) + 1e-6 < v]
        if short:
            raise ValueError(
                f"{n} more replica(s) need " + ", ".join(f"{v:g} {k}" for k, v in need.items())
                + " but the Ray cluster has " + ", ".join(
                    f"{free.get(k, 0.0):g} {k}" for k in need) + " free; free some, add nodes, "
                "or lower the CPUs each replica reserves (--replica-cpus)")

    def kill(self, name: str) -> None:
        """Stop replica ``name`` for good (no restart); its requests end."""
        actor = self.actors.pop(name, None)
        if actor is not None:
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)

    def shutdown(self) -> None:
        """Stop every replica of this set."""
        for name in list(self.actors):
            self.kill(name)

    def __enter__(self) -> RayReplicas:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
