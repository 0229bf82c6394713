"""Recording what ran where: ``with deviceops.trace() as t: ...``.

While a trace is active every op that goes through :func:`deviceops._launch.launch`
is recorded with its name, stream, device, host enqueue time, and its start
and end on the device, taken from marks the stream's backend records around it
(``Backend.trace_mark``: CUDA timing events on the cuda backend; host timestamps
taken by the stream's worker on the cpu backend). ``t.save(path)`` writes the Chrome trace-event format that
chrome://tracing and https://ui.perfetto.dev open, one track per stream.

Tracing adds two events per op: use it to look, not to benchmark.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._stream import Stream

__all__ = ["Trace", "TraceRecord", "trace"]

current: Trace | None = None


@dataclass
class TraceRecord:
    """One traced op. Times are seconds on the host's ``perf_counter`` clock."""

    name: str
    stream: int
    device: str
    enqueued: float
    start: float | None = None
    end: float | None = None
    _marks: list[Any] = field(default_factory=list, repr=False)


class Trace:
    """The ops recorded by :func:`trace`; see :meth:`save` and :attr:`records`."""

    def __init__(self) -> None:
        self.records: list[TraceRecord] = []
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._clocks: dict[Any, dict[Any, Any]] = {}  # backend -> its per-trace clock state

    # called by launch() -------------------------------------------------------
    def begin(self, name: str, stream: Stream) -> TraceRecord:
        rec = TraceRecord(name, stream.id, str(stream.device), time.perf_counter())
        self._mark(rec, stream)
        with self._lock:
            self.records.append(rec)
        return rec

    def end(self, rec: TraceRecord, stream: Stream) -> None:
        self._mark(rec, stream)

    def _mark(self, rec: TraceRecord, stream: Stream) -> None:
        if stream.capture is not None:
            return
        backend = stream.backend
        clock = self._clocks.get(backend)
        if clock is None:
            clock = self._clocks[backend] = {}
        rec._marks.append(backend.trace_mark(stream, clock))

    def finish(self) -> None:
        """Resolve device timestamps (waits until the streams passed the recorded marks)."""
        for rec in self.records:
            if len(rec._marks) == 2:
                end = rec._marks[1]()  # the later mark first: once it resolves, so has the start
                start = rec._marks[0]()
                if start is not None and end is not None:
                    rec.start, rec.end = start, end
            rec._marks = []

    # output -------------------------------------------------------------------
    def to_chrome(self) -> dict[str, Any]:
        """The trace as a Chrome trace-event JSON object."""
        events: list[dict[str, Any]] = []
        for rec in self.records:
            pid = rec.device
            events.append({"name": rec.name, "ph": "i", "s": "t", "pid": "host", "tid": "enqueue",
                           "ts": (rec.enqueued - self._t0) * 1e6, "args": {"stream": rec.stream}})
            if rec.start is not None and rec.end is not None:
                events.append({"name": rec.name, "ph": "X", "pid": pid, "tid": f"stream {rec.stream}",
                               "ts": (rec.start - self._t0) * 1e6,
                               "dur": max(rec.end - rec.start, 0.0) * 1e6})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save(self, path: str | Path) -> Path:
        """Write the Chrome/Perfetto trace to ``path``; returns the path."""
        p = Path(path)
        p.write_text(json.dumps(self.to_chrome()))
        return p

    def streams(self) -> list[int]:
        """Ids of the streams that ran traced ops, in order of first use."""
        seen: dict[int, None] = {}
        for r in self.records:
            seen.setdefault(r.stream, None)
        return list(seen)


@contextlib.contextmanager
def trace() -> Iterator[Trace]:
    """Record every op launched inside the block; see :class:`Trace`.

    Device timestamps are resolved when the block exits (it waits for the
    traced work to finish).

    Example:
        >>> with deviceops.trace() as t:
        ...     deviceops.zip(api.ones((4,)), api.zeros((4,))).sync()
        >>> t.save("trace.json")
    """
    global current
    if current is not None:
        raise RuntimeError("deviceops.trace() is already active; traces do not nest")
    t = Trace()
    current = t
    try:
        yield t
    finally:
        current = None
        t.finish()
