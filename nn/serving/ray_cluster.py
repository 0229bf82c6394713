"""Model replicas as Ray actors, the cluster side: connecting to Ray, what a replica loads
(:class:`ReplicaSpec`), and starting and stopping a set of replicas (:class:`RayReplicas`).

A **replica** is a Ray actor (:class:`~.ray_replica._ReplicaServer`, :mod:`.ray_replica`)
that owns one fail-stop :class:`~deviceops.nn.Engine` over one model on one device:
``num_gpus=1`` on CUDA (Ray sets ``CUDA_VISIBLE_DEVICES``, so the engine runs on the actor's
device 0), or a cpu-backend engine for CPU replicas (``num_gpus=0``). :class:`RayReplicas`
starts and stops a set of them (ownership: actors it starts die with it, and with the
process that created it). The front side (routing, proxies) is :mod:`.ray_front` and
:mod:`.ray_remote`.

Ray is optional (``pip install 'deviceops[ray]'``) and imported lazily: :func:`import_ray`
raises :class:`RayMissing` naming the install command."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
from dataclasses import dataclass
from typing import Any

__all__ = ["INSTALL_HINT", "RayMissing", "RayReplicas", "ReplicaSpec",
           "import_ray", "init_ray"]

log = logging.getLogger("deviceops.nn.ray")

INSTALL_HINT = "pip install 'deviceops[ray]'"

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
        prefix_cache: the engine's prefix caching (``serve --no-prefix-cache``: off).
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
    prefix_cache: bool = True

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"ReplicaSpec: device {self.device!r} must be 'cuda' or 'cpu'")

    def actor_options(self) -> dict[str, Any]:
        """``ActorClass.options(...)`` for one replica."""
        return {"num_gpus": 1 if self.device == "cuda" else 0, "num_cpus": self.num_cpus,
                "max_restarts": self.max_restarts, "max_task_retries": 0,
                "max_concurrency": 100_000}


@functools.cache
def _actor_class() -> Any:
    from .ray_replica import _ReplicaServer

    ray = import_ray()
    return ray.remote(_ReplicaServer)


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
