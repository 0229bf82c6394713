"""The front's side of a Ray replica: :class:`RayCoreClient`, the engine-core client
(:class:`~.core_client.CoreClient`) of the core a replica actor hosts (:mod:`.ray_replica`).

A replica speaks the engine core's protocol over TCP, so a Ray replica and a local core are
one code path for the HTTP layer, the router, batch generation and failure handling. The
one difference is where the core listens: a restarted actor binds a new port. So when a
replica's connection drops (the actor died, was killed, its engine failed), the client ends
the requests in flight with :class:`~.core_client.CoreFailed` (a 503 ``device_failed``, as
for a local core), then asks the actor for its ``info`` until Ray has restarted it
(:attr:`~.core_client.CoreClient.restarts` counts it) and connects to the new address. If
Ray will not restart it (``ActorDiedError``: killed for good, restarts used up, its model
failed to load), :attr:`~.core_client.CoreClient.dead` says why and the client stays closed.
A node lost without its TCP connection closing is noticed only when Ray reports the actor
dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from .core_client import CoreClient
from .ray_cluster import import_ray

__all__ = ["REJOIN_CALL_S", "RayCoreClient", "summary"]

log = logging.getLogger("deviceops.nn.ray")

#: Seconds one call to a restarting replica may take before it is tried again.
REJOIN_CALL_S = 60.0


def summary(exc: BaseException) -> str:
    """A one-line account of a (Ray) error: its first line and the line saying why."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    why = [ln for ln in lines[1:] if "because" in ln or ln.startswith("The actor")]
    text = " ".join(lines[:1] + why[:1]) or type(exc).__name__
    return f"{type(exc).__name__}: {text[:400]}"


class RayCoreClient(CoreClient):
    """The client of a replica actor's engine core (module docstring).

    Args:
        actor: the replica's actor handle.
        info: the replica's :meth:`~.ray_replica._ReplicaServer.info` (with ``address``).
        name: the replica's name (``"r0"``).
        model: the tokenizer-side model to share (default: rebuilt from ``info``).
    """

    def __init__(self, actor: Any, info: dict[str, Any], *, name: str,
                 model: Any = None) -> None:
        super().__init__(str(info["address"]), info, name=name, model=model)
        self.actor = actor
        self._rejoin_task: asyncio.Task[None] | None = None

    def _reopen(self) -> None:
        assert self._loop is not None
        if self._rejoin_task is None or self._rejoin_task.done():
            self._rejoin_task = self._loop.create_task(self._rejoin())

    async def _rejoin(self) -> None:
        """Ask the actor where its core listens until Ray has restarted it, then connect."""
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
            self.address = str(info["address"])
            self._open()  # its hellos are answered by the restarted core: the failure clears
            return

    def close(self) -> None:
        """As :meth:`~.core_client.CoreClient.close`, and stop waiting for a restart."""
        task, self._rejoin_task = self._rejoin_task, None
        if task is not None and not task.done():
            with contextlib.suppress(RuntimeError):  # its loop is closed
                task.cancel()
        super().close()
