"""The replica actor: an engine core (:mod:`.core`) hosted by a Ray actor.

A replica (:class:`_ReplicaServer`, started by :class:`~.ray_cluster.RayReplicas`) loads
its model and fail-stop engine as ``python -m deviceops.nn.serve`` would (:mod:`.cli`) and
runs an :class:`~.core.EngineCore` on the actor's event loop, bound to a TCP port of its
node. Fronts speak to it exactly as to a local core — the same messages
(:mod:`.protocol`), the same client (:class:`~.core_client.CoreClient`, through
:class:`~.ray_remote.RayCoreClient`), the same routing and failure handling; Ray only
places, starts and restarts the process, and tells a front where the core listens
(:meth:`_ReplicaServer.info`, ``"address"``). The core's port is reachable by anything that
reaches the node, as Ray's own ports are: run replicas on a network you trust.

**Failure.** The engine is fail-stop: when a step fails, the core reports it to its fronts
and exits the process (status 1) a moment later, so that Ray restarts the replica on a
fresh device context (``max_restarts``); its fronts ask the restarted actor for the new
address and rejoin. A replica whose model fails to load raises in its constructor; Ray
marks the actor dead.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from typing import Any

from .core import EngineCore, tune_await
from .ray_cluster import ReplicaSpec
from .requests import EngineFailed

__all__: list[str] = []

log = logging.getLogger("deviceops.nn.ray")


class _ReplicaServer:
    """The replica actor: one fail-stop engine served by an engine core (module docstring).

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
                                    fail_stop=True, prefix_cache=spec.prefix_cache)
        tune_await()
        import ray

        self.core = EngineCore(self.engine, f"tcp://{ray.util.get_node_ip_address()}:*",
                               device=str(getattr(self.engine.model, "device", spec.device)))
        self._task: asyncio.Task[None] | None = None
        gc.collect()
        gc.freeze()  # a full cyclic GC would otherwise walk the start-up heap mid-step

    async def _serving(self) -> str:
        """Start the core on this actor's loop (once); its bound address."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.core.serve())
        return await self.core.wait_bound()

    # -- calls -------------------------------------------------------------------------
    async def info(self, tokenizer: bool = True) -> dict[str, Any]:
        """The core's :class:`~.protocol.Ready` info (limits, device, pid; the tokenizer
        side when asked) with ``address`` (where the core listens), ``node`` and
        ``gpu_ids``.

        Raises:
            EngineFailed: the engine failed (the replica is about to restart).
        """
        import ray

        if self.engine.failure is not None:
            raise EngineFailed(str(self.engine.failure))
        address = await self._serving()
        return self.core.info(tokenizer) | {
            "address": address, "node": ray.util.get_node_ip_address(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    async def stats(self) -> Any:
        """The engine's :class:`~.requests.EngineStats` now."""
        return self.engine.stats()
