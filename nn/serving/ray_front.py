"""The front of Ray replicas: routing, failure, scaling, ``/admin``.

``python -m deviceops.nn.serve --ray [ADDRESS] --replicas N`` serves the same HTTP API as
one engine (:mod:`.http`) with a :class:`RayRouter` over replicas that are Ray actors
(:mod:`.ray_cluster`), each hosting an engine core (:mod:`.ray_replica`). Each
:class:`RayReplica`'s ``engine`` is a :class:`~.ray_remote.RayCoreClient`: the engine-core
client local cores have (:mod:`.core_client`), speaking the same messages over TCP, so the
HTTP layer, routing and failure handling are one code path for local and Ray replicas.
Everything here runs in the server's asyncio event loop (Ray's awaitables are asyncio's).

**Routing.** As ``--devices``: a request goes to the serving replica with the fewest
pending tokens (prompt tokens not yet prefilled plus tokens still to generate), counted
here as requests are sent and their tokens come back, so the choice needs no round trip
and two requests arriving together see each other. A replica's admission limit is
``max_batch + max_queue`` requests in flight from this front; past it the next replica is
tried, 429 when all are full.

**Failure.** When a replica's connection drops (the actor died: killed, its process
crashed, or its engine failed and it exited), the replica leaves routing at once;
its in-flight requests end with :class:`~.core_client.CoreFailed` (an
:class:`~deviceops.nn.EngineFailed`: 503 ``device_failed`` with ``Retry-After``, or an SSE
error event then ``data: [DONE]`` for a stream under way); new requests go to the others.
The client then waits for Ray to restart the actor (``max_restarts``) and rejoins it
(state ``restarting`` meanwhile); an actor Ray will not restart stays listed as
``failed`` with the reason. ``/health`` lists every replica (``replica``, ``state``,
``node``, ``gpus``, ``load``, ``restarts``, ``error``) and ``/metrics`` labels the engine
series ``replica="r0"``.

**Scaling.** ``POST /admin/replicas`` (:func:`add_admin_routes`) with ``{"replicas": N}``
(scale to N), ``{"add": K}`` or ``{"remove": K | ["r1", ...]}`` and ``"wait"`` (default
true: answer once new replicas serve and removed ones are gone; false: 202 at once);
``GET /admin/replicas`` lists them. A replica being removed is *drained*: out of routing,
its in-flight requests finish, then its actor is killed; nothing is dropped. The route
needs ``Authorization: Bearer TOKEN`` with the token of ``--admin-token`` (or
``DEVICEOPS_ADMIN_TOKEN``); without a token configured it answers 403.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .core_client import CoreModel
from .core_process import CoreReplica
from .metrics import DeviceStats
from .ray_cluster import RayReplicas, ReplicaSpec
from .ray_remote import RayCoreClient, summary
from .router import Replica, Router

__all__ = ["RayReplica", "RayRouter", "add_admin_routes", "load_ray_router"]

log = logging.getLogger("deviceops.nn.serve")

#: Seconds a new replica may take to load its model before it is listed as failed.
START_TIMEOUT_S = 900.0


@dataclass(eq=False)
class RayReplica(CoreReplica):
    """One replica as the router sees it: ``device`` is its name (``"r0"``, the ``replica``
    label), ``engine`` its :class:`~.ray_remote.RayCoreClient` once its model has loaded."""

    actor: Any = None
    kind: str = "replica"
    dead_why = "the actor is dead and Ray will not restart it"

    @property
    def state(self) -> str:
        """``starting``, ``serving``, ``restarting``, ``draining`` or ``failed``."""
        if self.engine is None and self.load_error is None:
            return "starting"
        return super().state

    def describe(self) -> dict[str, Any]:
        """The ``/health`` entry."""
        eng = self.engine
        st = eng.stats() if eng is not None else None
        info = eng.info if eng is not None else {}
        return {"replica": self.device, "state": self.state, "node": info.get("node"),
                "device": info.get("device"),
                "gpus": info.get("gpu_ids", []), "pid": info.get("pid"),
                "load": st.pending_tokens if st is not None else 0,
                "running": st.running if st is not None else 0,
                "queued": st.queued if st is not None else 0,
                "restarts": eng.restarts if eng is not None else 0, "error": self.error}


class RayRouter(Router):
    """Least-loaded routing over Ray replicas, with restarts and scaling (module docstring).

    Args:
        replicas: the replicas (:class:`RayReplica`).
        pool: the :class:`~.ray_cluster.RayReplicas` that starts and kills actors (needed by
            :meth:`add` and :meth:`remove`).
        owns: :meth:`close` kills the pool's actors (the server's own replicas).
    """

    def __init__(self, replicas: Sequence[RayReplica], *, pool: RayReplicas | None = None,
                 owns: bool = False) -> None:
        super().__init__(replicas, per_device=True)
        self.pool = pool
        self.owns = owns
        self._model: CoreModel | None = None
        self._ops: set[asyncio.Task[Any]] = set()

    @classmethod
    def start(cls, spec: ReplicaSpec, replicas: int | None = None, *, address: str | None = None,
              ray_init: dict[str, Any] | None = None,
              timeout: float = START_TIMEOUT_S) -> RayRouter:
        """Start ``replicas`` actors and wait (blocking) until their models have loaded.

        Raises:
            RayMissing: Ray is not installed.
            RuntimeError: no replica loaded (each one's error in the message).
        """
        pool = RayReplicas(spec, replicas, address=address, ray_init=ray_init)
        return cls.attach(pool, owns=True, timeout=timeout)

    @classmethod
    def attach(cls, pool: RayReplicas, *, owns: bool = False,
               timeout: float = START_TIMEOUT_S) -> RayRouter:
        """A router over ``pool``'s running actors (blocking until their models loaded)."""
        ray = pool.ray
        reps = [RayReplica(name, actor=actor) for name, actor in pool.actors.items()]
        router = cls(reps, pool=pool, owns=owns)
        for r in reps:
            try:
                info = ray.get(r.actor.info.remote(router._model is None), timeout=timeout)
            except Exception as exc:
                r.load_error = summary(exc)
                log.error("replica %s did not start: %s", r.device, r.load_error)
                continue
            router._adopt(r, info)
        if all(r.engine is None for r in reps):
            if owns:
                pool.shutdown()
            raise RuntimeError("no replica started: " + "; ".join(
                f"{r.device}: {r.load_error}" for r in reps))
        return router

    def _adopt(self, r: RayReplica, info: dict[str, Any]) -> None:
        if self._model is None:
            self._model = CoreModel(info)
        r.engine = RayCoreClient(r.actor, info, name=r.device, model=self._model)
        log.info("replica %s serving on %s (node %s, pid %s)", r.device, info.get("device"),
                 info.get("node"), info.get("pid"))

    # -- the Router surface ------------------------------------------------------------
    def _reps(self) -> list[RayReplica]:
        return [r for r in self.replicas if isinstance(r, RayReplica)]

    def _ensure(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        del loop  # only asked for: attach() binds each proxy to the running loop
        for r in self._reps():
            if r.engine is not None:
                r.engine.attach()

    @property
    def serving(self) -> list[Replica]:
        """The replicas that serve now."""
        self._ensure()
        return [r for r in self.replicas if r.state == "serving"]

    def unavailable_reason(self) -> str:
        """Why nothing serves, naming each replica's state and error (for a 503)."""
        parts = [f"{r.device}: {r.state}" + (f" ({r.error})" if r.error else "")
                 for r in self.replicas]
        return "no replica is serving the model; " + "; ".join(parts)

    def describe(self) -> list[dict[str, Any]]:
        """``/health``'s ``engines``: one entry per replica."""
        self._ensure()
        return [r.describe() for r in self.replicas]

    def device_stats(self) -> list[DeviceStats]:
        """``/metrics``' per-replica series (label ``replica``)."""
        self._ensure()
        return [DeviceStats(r.device, r.engine.stats() if r.engine is not None else None,
                            r.state == "serving", r.pending_tokens, label="replica")
                for r in self.replicas]

    def close(self) -> None:
        """Stop listening to every replica (in-flight requests are cancelled); kill the
        actors when this router owns them."""
        for t in self._ops:
            t.cancel()
        for r in self.replicas:
            if r.engine is not None:
                r.engine.close()
        if self.owns and self.pool is not None:
            self.pool.shutdown()

    # -- scaling -----------------------------------------------------------------------
    def _pool(self) -> RayReplicas:
        if self.pool is None:
            raise ValueError("this router has no replica pool to start or stop replicas")
        return self.pool

    async def add(self, n: int, *, timeout: float = START_TIMEOUT_S) -> list[RayReplica]:
        """Start ``n`` replicas; return once their models loaded (they then serve).

        A replica that fails to start stays listed as ``failed`` with its error.

        Raises:
            ValueError: the cluster has no room for them now (:meth:`RayReplicas.spawn`).
        """
        pool = self._pool()
        first = max((r.index for r in self.replicas), default=-1) + 1
        new = [RayReplica(name, actor=actor, index=first + i)
               for i, (name, actor) in enumerate(pool.spawn(n))]
        self.replicas.extend(new)

        async def join(r: RayReplica) -> None:
            try:
                info = await asyncio.wait_for(r.actor.info.remote(self._model is None), timeout)
            except Exception as exc:
                r.load_error = summary(exc)
                log.error("replica %s did not start: %s", r.device, r.load_error)
                return
            self._adopt(r, info)
            self._ensure()

        await asyncio.gather(*(join(r) for r in new))
        return new

    async def remove(self, names: Sequence[str], *, timeout: float | None = None) -> list[str]:
        """Drain replicas ``names`` (out of routing; in-flight requests finish), then kill
        their actors and forget them.

        Raises:
            ValueError: an unknown name, or no serving replica would be left.
        """
        pool = self._pool()
        byname = {r.device: r for r in self._reps()}
        unknown = [n for n in names if n not in byname]
        if unknown:
            raise ValueError(f"no replica named {unknown[0]!r} (replicas: "
                             f"{', '.join(byname)})")
        going = [byname[n] for n in dict.fromkeys(names)]
        if not [r for r in self.serving if r not in going]:
            raise ValueError("removing these replicas would leave none serving; add one first")
        for r in going:
            if r.engine is not None:
                r.engine.drain()
        with anyio.move_on_after(timeout):
            while any(r.engine is not None and r.engine.in_flight and r.state == "draining"
                      for r in going):
                await anyio.sleep(0.01)
        for r in going:
            if r.engine is not None:
                r.engine.close()
            pool.kill(r.device)
            if r in self.replicas:
                self.replicas.remove(r)
        return [r.device for r in going]

    async def scale(self, n: int, *, timeout: float | None = None) -> tuple[list[str], list[str]]:
        """Add or remove replicas until ``n`` are kept (failed ones are removed first,
        then the least loaded). Returns ``(added, removed)`` names."""
        if n < 1:
            raise ValueError(f"replicas={n}: at least 1 must stay")
        kept = [r for r in self.replicas if r.state != "draining"]
        if n > len(kept):
            new = await self.add(n - len(kept), timeout=START_TIMEOUT_S if timeout is None
                                 else timeout)
            return [r.device for r in new], []
        order = sorted(kept, key=lambda r: (r.state == "serving", r.pending_tokens, -r.index))
        gone = await self.remove([r.device for r in order[:len(kept) - n]], timeout=timeout)
        return [], gone


def load_ray_router(model: str = "smollm2", *, address: str | None = None,
                    replicas: int | None = None, device: str | None = None,
                    dtype: str | None = None, max_batch: int = 32, max_seq: int = 2048,
                    max_queue: int | None = None, prefill_chunk: int = 512,
                    num_cpus: float = 1.0, max_restarts: int = 4,
                    ray_init: dict[str, Any] | None = None,
                    prefix_cache: bool = True) -> RayRouter:
    """Connect to Ray, start the replicas and wait until they serve (``serve --ray``).

    Args:
        model: ``"smollm2"`` or a ``.gguf`` path present on every node.
        address: the cluster (``None``: a local one; ``"auto"``; ``"host:6379"``).
        replicas: how many (``None``: one per cluster GPU, or one CPU replica).
        device: ``"cuda"`` or ``"cpu"`` replicas (``None``: cuda when the cluster has GPUs).
        dtype, max_batch, max_seq, max_queue, prefill_chunk: per replica, as ``serve``.
        num_cpus, max_restarts: Ray's, per replica.
        ray_init: more ``ray.init`` arguments when this call connects.
        prefix_cache: the engines' prefix caching (``serve --no-prefix-cache``: off).
    """
    from .cli import _check_model

    _check_model(model)
    if device is None:
        from .ray_cluster import init_ray

        ray = init_ray(address, **(ray_init or {}))
        device = "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    spec = ReplicaSpec(model, device, dtype, max_batch, max_seq, max_queue, prefill_chunk,
                       num_cpus, max_restarts, prefix_cache)
    return RayRouter.start(spec, replicas, address=address, ray_init=ray_init)


# -- /admin/replicas ----------------------------------------------------------------------
def _err(status: int, message: str, code: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error"
                                   if status < 500 else "server_error", "param": param,
                                   "code": code}}, status_code=status)


def _finished(task: asyncio.Task[Any]) -> None:
    """A background admin change ended: log its outcome."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.error("admin: changing the replicas failed: %s: %s", type(exc).__name__, exc)
    else:
        added, removed = task.result()
        log.info("admin: replicas added %s, removed %s", added, removed)


def add_admin_routes(app: Any, token: str | None) -> None:
    """Add ``GET``/``POST /admin/replicas`` to a ``serve --ray`` app (module docstring).

    Args:
        app: the Starlette app of :func:`~.http.create_app` (its router a :class:`RayRouter`
            once loaded).
        token: the bearer token the route requires; ``None`` or empty: the route answers 403.
    """
    async def admin(request: Request) -> Response:
        if not token:
            return _err(403, "the admin API is disabled; start the server with --admin-token "
                             "TOKEN (or DEVICEOPS_ADMIN_TOKEN) to enable it", "admin_disabled")
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
            return JSONResponse({"error": {
                "message": "missing or wrong admin token (Authorization: Bearer TOKEN)",
                "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}},
                status_code=401, headers={"WWW-Authenticate": "Bearer"})
        router = app.state.serve.router
        if not isinstance(router, RayRouter):
            return _err(503, "the replicas are still starting", "loading")
        if request.method == "GET":
            return JSONResponse({"replicas": router.describe()})
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            return _err(400, f"malformed JSON body: {exc}", "invalid_json")
        keys = [k for k in ("replicas", "add", "remove") if isinstance(body, dict) and k in body]
        if len(keys) != 1:
            return _err(400, "give exactly one of 'replicas' (scale to N), 'add' (K more) or "
                             "'remove' (K, or a list of names)", "invalid_request")
        key, val = keys[0], body[keys[0]]
        wait = body.get("wait", True)
        ints_ok = isinstance(val, int) and not isinstance(val, bool) and val >= 1
        names_ok = key == "remove" and isinstance(val, list) and val and all(
            isinstance(v, str) for v in val)
        if not (ints_ok or names_ok) or not isinstance(wait, bool):
            return _err(400, f"'{key}' must be an integer >= 1" + (
                " or a list of replica names" if key == "remove" else "") +
                "; 'wait' a boolean", "invalid_request", key)

        async def op() -> tuple[list[str], list[str]]:
            if key == "replicas":
                return await router.scale(val)
            if key == "add":
                return [r.device for r in await router.add(val)], []
            if isinstance(val, int):
                kept = [r for r in router.replicas if r.state != "draining"]
                order = sorted(kept, key=lambda r: (r.state == "serving", r.pending_tokens,
                                                    -r.index))
                names = [r.device for r in order[:val]]
            else:
                names = list(val)
            return [], await router.remove(names)

        if not wait:
            kept = len([r for r in router.replicas if r.state != "draining"])
            more = val if key == "add" else (val - kept if key == "replicas" else 0)
            try:
                if more > 0:  # refuse now what cannot be placed, not after the 202
                    router._pool().check_room(more)
            except ValueError as exc:
                return _err(400, str(exc), "invalid_request", key)
            task = asyncio.get_running_loop().create_task(op())
            router._ops.add(task)
            task.add_done_callback(router._ops.discard)
            task.add_done_callback(_finished)
            return JSONResponse({"accepted": True, "replicas": router.describe()},
                                status_code=202)
        try:
            added, removed = await op()
        except ValueError as exc:
            return _err(400, str(exc), "invalid_request", key)
        return JSONResponse({"added": added, "removed": removed,
                             "replicas": router.describe()})

    app.router.routes.append(Route("/admin/replicas", admin, methods=["GET", "POST"]))
