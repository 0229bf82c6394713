"""Data-parallel serving: one :class:`~deviceops.nn.Engine` per device behind a router.

``python -m deviceops.nn.serve --devices 0,1`` runs a fail-stop engine per device, each in
its own engine core process (:mod:`.core_process` routes over their clients with a
:class:`~.core_process.CoreRouter`); :func:`~.cli.load_engines` builds the same in one
process (tests). The HTTP layer (:mod:`.http`) asks the :class:`Router` where each
request goes.

**Routing rule.** A request goes to the serving engine with the least
:attr:`~deviceops.nn.Engine.pending_tokens`: for every request it holds, queued or
running, the prompt tokens not yet prefilled plus the new tokens it may still generate
(``max_tokens`` minus those generated). Prefill and decode tokens count the same; the
count is an upper bound (a request may stop early at EOS). Ties go to the device listed
first. If that engine's admission queue is full the next one is tried; 429 only when all
are full. The choice and the queueing happen in one synchronous stretch of the event
loop, so two requests arriving together see each other's load.

**Failure.** Per-device engines are built with ``fail_stop=True``: a step that raises (a
device error) ends every request that engine held, queued or running, with
:class:`~.requests.EngineFailed` — the HTTP layer answers 503 (``code``
``"device_failed"``, or an SSE error event for a stream already under way) — and the
engine is taken out of routing while the other devices keep serving. A device whose
model failed to load is listed as failed from the start. ``/health`` is 200 while at
least one engine serves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .engine import Engine
from .metrics import DeviceStats

__all__ = ["Replica", "Router"]


@dataclass(eq=False)
class Replica:
    """One device's engine, as the router sees it.

    Attributes:
        device: the device's name (``"cuda:1"``, ``"cpu:1"``): the ``device`` label and
            what ``/health`` lists.
        engine: its engine, or ``None`` when loading the model on that device failed.
        load_error: why loading failed (``"FileNotFoundError: ..."``), else ``None``.
        index: its position in the device list (breaks ties in routing).
    """

    device: str
    engine: Engine | None = None
    load_error: str | None = None
    index: int = 0

    @property
    def state(self) -> str:
        """``"serving"``, ``"failed"`` (load or step failure) or ``"closed"`` (draining)."""
        eng = self.engine
        if eng is None or eng.failure is not None:
            return "failed"
        return "closed" if eng.closed else "serving"

    @property
    def error(self) -> str | None:
        """What went wrong on this device (load or step error), else ``None``."""
        if self.load_error is not None:
            return f"loading the model failed: {self.load_error}"
        failure = self.engine.failure if self.engine is not None else None
        return None if failure is None else str(failure)

    @property
    def pending_tokens(self) -> int:
        """The engine's queued and running work in tokens (0 without an engine)."""
        return 0 if self.engine is None else self.engine.pending_tokens

    def describe(self) -> dict[str, Any]:
        """The ``/health`` entry: device, state, load (pending tokens), requests, error."""
        st = self.engine.stats() if self.engine is not None else None
        return {
            "device": self.device,
            "state": self.state,
            "load": st.pending_tokens if st is not None else 0,
            "running": st.running if st is not None else 0,
            "queued": st.queued if st is not None else 0,
            "error": self.error,
        }


class Router:
    """Least-loaded routing over one engine per device (module docstring).

    Args:
        replicas: the devices' engines, in the order given on the command line.
        per_device: ``True`` (``serve --devices``): ``/health`` lists the engines and
            ``/metrics`` labels the engine series by ``device``. ``False``: one engine
            served exactly as without a router (:meth:`single`).

    Example:
        >>> router = Router.over([Engine(m0, fail_stop=True), Engine(m1, fail_stop=True)],
        ...                      ["cuda:0", "cuda:1"])
        >>> replica = router.ranked()[0]   # the least-loaded serving engine
    """

    def __init__(self, replicas: Sequence[Replica], *, per_device: bool = True) -> None:
        if not replicas:
            raise ValueError("Router: no devices given (pass at least one Replica)")
        names = [r.device for r in replicas]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"Router: device {dup[0]!r} is listed twice; give each device once")
        self.replicas = list(replicas)
        for i, r in enumerate(self.replicas):
            r.index = i
        self.per_device = per_device

    @classmethod
    def over(cls, engines: Sequence[Engine], devices: Sequence[str] | None = None) -> Router:
        """A per-device router over ``engines``; ``devices`` names them (default: each
        engine's ``model.device``)."""
        if devices is None:
            devices = [str(getattr(e.model, "device", f"engine{i}")) for i, e in enumerate(engines)]
        if len(devices) != len(engines):
            raise ValueError(f"Router.over: {len(engines)} engines but {len(devices)} device names")
        return cls([Replica(d, e) for d, e in zip(devices, engines, strict=True)])

    @classmethod
    def single(cls, engine: Engine) -> Router:
        """One engine, served exactly as without ``--devices`` (no device labels)."""
        return cls([Replica(str(getattr(engine.model, "device", "default")), engine)],
                   per_device=False)

    @property
    def serving(self) -> list[Replica]:
        """The replicas whose engine serves now, in device order."""
        return [r for r in self.replicas if r.state == "serving"]

    def ranked(self) -> list[Replica]:
        """Serving replicas, least pending tokens first (ties: device order)."""
        return sorted(self.serving, key=lambda r: (r.pending_tokens, r.index))

    def pick(self) -> Replica | None:
        """The replica the next request goes to, or ``None`` when no engine serves."""
        ranked = self.ranked()
        return ranked[0] if ranked else None

    def unavailable_reason(self) -> str:
        """Why nothing serves, naming each device's state and error (for a 503)."""
        parts = [f"{r.device}: {r.state}" + (f" ({r.error})" if r.error else "")
                 for r in self.replicas]
        return "no device is serving the model; " + "; ".join(parts)

    def describe(self) -> list[dict[str, Any]]:
        """``/health``'s ``engines``: one entry per device."""
        return [r.describe() for r in self.replicas]

    def device_stats(self) -> list[DeviceStats]:
        """``/metrics``' per-device engine series."""
        return [DeviceStats(r.device, r.engine.stats() if r.engine is not None else None,
                            r.state == "serving", r.pending_tokens) for r in self.replicas]

    def close(self) -> None:
        """Close every engine (queued and running requests are cancelled)."""
        for r in self.replicas:
            if r.engine is not None:
                r.engine.close()
