"""Tenants: many independent jobs sharing devices, each with a priority and a bounded queue.

A :class:`Tenant` is a :class:`~deviceops.scheduling.SchedulingPolicy` that stands for one
user of the GPUs: a request handler, a training loop, a batch job. Work runs as a tenant
inside ``with deviceops.using(tenant):`` (a context variable: it follows the asyncio task
or thread that entered it, so each task of an app can be its own tenant), or when the
tenant is passed explicitly (``op.schedule(tenant)``). A tenant has:

* **streams of its priority.** ``priority`` is ``"high"``, ``"normal"``, ``"low"`` or an int
  in CUDA's convention (lower is more urgent; see :meth:`Device.new_stream
  <deviceops.Device.new_stream>`). ``"low"`` is the device's least urgent level (where
  CUDA puts every plain stream, the default policy's too), ``"high"`` its most urgent,
  ``"normal"`` half way. When SMs free up the GPU starts blocks of a more urgent stream's
  kernels first, so latency-sensitive tenants' small kernels slip between a big job's
  blocks instead of queueing behind the whole job. (Blocks already running are not
  preempted, so a tenant of the least urgent level, ``"low"``, gets streams that *yield*
  (:meth:`Device.new_stream <deviceops.Device.new_stream>`): the GEMM runs one block a
  tile there instead of a persistent grid, and a more urgent tenant's kernels start as
  soon as a tile ends rather than after the whole product. A low-priority tenant that
  wants the persistent grid passes its own streams.) The ``cpu`` backend holds a less urgent
  stream's next task back while a more urgent one has a task ready, so the same ordering
  is tested without a GPU.
* **a bound on queued work.** At most ``max_queued`` of the tenant's top-level ops (each
  ``await op`` or ``op.schedule()``, whatever DAG it holds) are in flight at once. The
  next one waits until the oldest completes: ``await op`` suspends its task (the event
  loop keeps running), ``op.schedule()`` and ``op.sync()`` block the calling thread. A
  tenant that floods the device with big jobs thus holds at most ``max_queued`` of them
  in the device's queues, and what it has not submitted yet never stands in front of
  another tenant's work. (``sync()`` waits for its own op, so each thread calling it holds
  at most one.)
* **a device.** A standalone tenant runs on the device it is given (the default device).
  A :class:`TenantPool` spreads its tenants over several devices (each new tenant goes to
  the device with the fewest tenants of its priority) and lets tenants of one priority
  share that device's streams of that priority, so 48 tenants need 4 streams, not 48 (the
  GPU has a bounded number of hardware queues: ``CUDA_DEVICE_MAX_CONNECTIONS``, 8 by
  default; streams beyond it share queues and wait on each other's work).

Top-level ops go to the tenant's own streams in turn; ``zip`` branches draw from its
branch streams (a pool tenant: all of its class's streams on its device).

Example:
    >>> pool = TenantPool(["cpu"])
    >>> small = pool.tenant("search", priority="high", max_queued=2)
    >>> big = pool.tenant("training", priority="low", max_queued=1)
    >>> async def handle(x):
    ...     with deviceops.using(small):
    ...         return await kernels.gemm(x, x)
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from deviceops._errors import SchedulingError

from ._policy import SchedulingPolicy

if TYPE_CHECKING:
    from deviceops._device import Device
    from deviceops._op import DeviceOp
    from deviceops._stream import Event, Stream

__all__ = ["PRIORITIES", "Tenant", "TenantPool", "priority_level"]

#: the named priorities, most urgent first
PRIORITIES = ("high", "normal", "low")

_ids = itertools.count(1)


def priority_level(device: Device, priority: str | int) -> int:
    """The stream priority (CUDA's convention, clamped to the device's range) that
    ``priority`` (``"high"``, ``"normal"``, ``"low"`` or an int) means on ``device``.

    Raises:
        ValueError: an unknown name. TypeError: neither a name nor an int.
    """
    least, greatest = device.stream_priorities
    if isinstance(priority, str):
        if priority == "low":
            return least
        if priority == "high":
            return greatest
        if priority == "normal":
            return int((least + greatest) / 2)
        raise ValueError(f"priority must be one of {PRIORITIES} or an int, got {priority!r}")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"priority must be one of {PRIORITIES} or an int, got {type(priority).__name__} "
                        f"{priority!r}")
    return max(greatest, min(least, priority))


class Tenant(SchedulingPolicy):
    """One user of the devices: its streams (at its priority) and its bound on queued work.

    Args:
        name: names the tenant in errors and ``repr``.
        priority: ``"high"``, ``"normal"`` (default), ``"low"`` or an int (CUDA's convention).
        device: where it runs (``None``: the default device at construction).
        streams: how many streams of its own (>= 1), or the streams themselves (all of one
            device; their priority is theirs).
        max_queued: top-level ops in flight at once (>= 1); the next waits for the oldest.
        branch_streams: the streams ``zip`` branches draw from (default: its own).
        auto_graph: replay a small DAG that repeats as a CUDA graph (default ``True``): a
            job ending in ``api.to_host`` whose kernel ops repeat with the same tensors is
            captured at its third run and replayed after, at a fraction of the host cost
            (:mod:`deviceops.graphs._auto` says what is eligible and what it keeps alive).

    Attributes:
        name, priority (the stream priority, an int), device, streams, branch_streams,
        max_queued, auto_graph.
    """

    counts_enqueued = True

    def __init__(self, name: str | None = None, *, priority: str | int = "normal",
                 device: Device | int | str | None = None, streams: int | Sequence[Stream] = 1,
                 max_queued: int = 4, branch_streams: Sequence[Stream] | None = None,
                 auto_graph: bool = True) -> None:
        from deviceops._device import default_device
        from deviceops._device import device as _device

        if isinstance(max_queued, bool) or not isinstance(max_queued, int) or max_queued < 1:
            raise SchedulingError(f"Tenant: max_queued must be an int >= 1, got {max_queued!r}")
        self.name = name if name is not None else f"tenant-{next(_ids)}"
        if isinstance(streams, int):
            if isinstance(streams, bool) or streams < 1:
                raise SchedulingError(f"Tenant {self.name!r}: streams must be >= 1, got {streams!r}")
            dev = default_device() if device is None else _device(device)
            self.priority = priority_level(dev, priority)
            yields = self.priority == dev.stream_priorities[0]  # a "low" tenant's streams yield SMs
            own: tuple[Stream, ...] = tuple(dev.new_stream(self.priority, yields=yields)
                                            for _ in range(streams))
        else:
            own = tuple(streams)
            if not own:
                raise SchedulingError(f"Tenant {self.name!r}: give at least one stream")
            dev = own[0].device
            if device is not None and _device(device) is not dev:
                raise SchedulingError(f"Tenant {self.name!r}: its streams live on {dev}, not {device}")
            self.priority = own[0].priority
        branches = own if branch_streams is None else tuple(branch_streams)
        if any(s.device is not dev for s in (*own, *branches)):
            raise SchedulingError(f"Tenant {self.name!r}: every stream must live on {dev}")
        self._device = dev
        self.streams = own
        self.branch_streams = branches
        self.max_queued = max_queued
        if not isinstance(auto_graph, bool):
            raise SchedulingError(f"Tenant {self.name!r}: auto_graph must be a bool, got {auto_graph!r}")
        self.auto_graph = auto_graph
        self._own = itertools.cycle(own).__next__
        self._branch = itertools.cycle(branches).__next__
        self._events: deque[Event] = deque()  # the in-flight top-level ops' completion events
        self._lock = threading.Lock()

    # -- SchedulingPolicy ------------------------------------------------------------------
    def next_stream(self) -> Stream:
        return self._branch()

    def stream_for(self, op: DeviceOp[Any]) -> Stream:
        """One of the tenant's own streams in turn, once it has room for another op
        (blocking the calling thread until then; ``await`` waits before asking)."""
        ev = self.backlog()
        while ev is not None:
            done = threading.Event()
            ev.when_complete(done.set)
            done.wait()
            ev = self.backlog()
        return self._own()

    def enqueued(self, stream: Stream, event: Event) -> None:
        with self._lock:
            self._events.append(event)

    def backlog(self) -> Event | None:
        """``None`` when the tenant may submit another op now; else the completion event
        of its oldest op in flight (wait for it, then ask again)."""
        with self._lock:
            evs = self._events
            _prune(evs)
            if len(evs) < self.max_queued:
                return None
            return evs[0]

    @property
    def in_flight(self) -> int:
        """Top-level ops submitted (``await``, ``schedule()``) and not yet complete."""
        with self._lock:
            _prune(self._events)
            return len(self._events)

    @property
    def device(self) -> Device:
        return self._device

    def __repr__(self) -> str:
        return (f"Tenant({self.name!r}, priority={self.priority}, device={self._device}, "
                f"streams={len(self.streams)}, max_queued={self.max_queued})")


def _prune(evs: deque[Event]) -> None:
    """Drop completed events (a failed one counts as complete: its future reports it)."""
    while evs:
        try:
            done = evs[0].query()
        except Exception:
            done = True
        if done:
            evs.popleft()
            continue
        # events of one stream complete in order; of several, the head may lag: look on
        for i in range(1, len(evs)):
            try:
                done = evs[i].query()
            except Exception:
                done = True
            if done:
                del evs[i]
                return
        return


class TenantPool:
    """Tenants spread over devices, sharing each device's streams per priority.

    Args:
        devices: the devices (``None``: every CUDA device, else ``cpu``).
        streams_per_priority: streams per device and priority level (>= 1), made when the
            first tenant of that level lands on the device.
        max_queued: the default bound of its tenants (see :class:`Tenant`).
        auto_graph: its tenants' default (see :class:`Tenant`).

    Each new tenant goes to the device with the fewest tenants of its priority (then the
    fewest tenants, then the first listed), and takes one of that level's streams in turn
    as its own; its ``zip`` branches draw from all of them.
    """

    def __init__(self, devices: Sequence[Device | int | str] | None = None, *,
                 streams_per_priority: int = 4, max_queued: int = 4, auto_graph: bool = True) -> None:
        from deviceops._device import backend, cuda_available
        from deviceops._device import device as _device

        if devices is None:
            devices = list(range(backend("cuda").device_count())) if cuda_available() else ["cpu"]
        devs = [_device(d) for d in devices]
        if not devs:
            raise SchedulingError("TenantPool: give at least one device")
        if len(set(devs)) != len(devs):
            raise SchedulingError(f"TenantPool: a device is named twice in {devs}")
        if streams_per_priority < 1:
            raise SchedulingError(f"TenantPool: streams_per_priority must be >= 1, got {streams_per_priority}")
        if max_queued < 1:
            raise SchedulingError(f"TenantPool: max_queued must be >= 1, got {max_queued}")
        self.devices = tuple(devs)
        self.streams_per_priority = streams_per_priority
        self.max_queued = max_queued
        self.auto_graph = auto_graph
        self.tenants: list[Tenant] = []
        self._streams: dict[tuple[Device, int], tuple[Stream, ...]] = {}
        self._lock = threading.Lock()

    def tenant(self, name: str | None = None, *, priority: str | int = "normal",
               max_queued: int | None = None, device: Device | int | str | None = None,
               auto_graph: bool | None = None) -> Tenant:
        """A new tenant on the least loaded device (or ``device``, one of the pool's)."""
        from deviceops._device import device as _device

        with self._lock:
            if device is not None:
                dev = _device(device)
                if dev not in self.devices:
                    raise SchedulingError(f"TenantPool: {dev} is not one of {[str(d) for d in self.devices]}")
            else:
                def load(d: Device) -> tuple[int, int, int]:
                    level = priority_level(d, priority)
                    same = sum(1 for t in self.tenants if t._device is d and t.priority == level)
                    return (same, sum(1 for t in self.tenants if t._device is d), self.devices.index(d))
                dev = min(self.devices, key=load)
            level = priority_level(dev, priority)
            key = (dev, level)
            pool = self._streams.get(key)
            if pool is None:
                yields = level == dev.stream_priorities[0]  # "low": background work yields SMs
                pool = self._streams[key] = tuple(dev.new_stream(level, yields=yields)
                                                  for _ in range(self.streams_per_priority))
            k = sum(1 for t in self.tenants if t._device is dev and t.priority == level)
            home = pool[k % len(pool)]
            t = Tenant(name, streams=(home,), branch_streams=pool,
                       max_queued=self.max_queued if max_queued is None else max_queued,
                       auto_graph=self.auto_graph if auto_graph is None else auto_graph)
            self.tenants.append(t)
            return t

    def __repr__(self) -> str:
        return f"TenantPool(devices={[str(d) for d in self.devices]!r}, tenants={len(self.tenants)})"
