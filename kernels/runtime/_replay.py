"""Bound launches: the driver calls of one kernel op, recorded once and replayed.

What a kernel op does on the ``cuda`` backend is a pure function of its plan key (the
launcher's static parameters, its arguments' signatures and alias pattern: see
:mod:`._spec`), the arguments' device pointers and the stream. So the first execution
for a given (stream, pointers) runs the op's launch body with a recorder switched on; the
recorder keeps what the body handed to the driver (:mod:`._driver`: function, grid,
block, shared memory, the packed parameter block) and what it declared to the hazard
tracker (:func:`deviceops.extend.launch`: the storages read and written). Later
executions with the same key replay that: one hazard step over the same storages (taken
from the op's arguments, so nothing of the user's is kept alive), the recorded driver
calls, one sequence number. That is the per-call work issue 12 asks for: resolving
arguments, hazards, the workspace lookup, the driver call.

Rules that keep a replay exactly equal to a fresh execution:

* only launchers whose device work all goes through :mod:`._driver` opt in
  (``KernelSpec(..., replay=True)``); work submitted any other way (a CuPy call inside
  the body) would not be recorded, so such a launcher keeps ``replay=False``;
* a recording is dropped if the body raised, launched nothing it declared, or touched a
  storage that is neither an argument nor alive only through a weak reference (a
  workspace); a replay whose weakly held storage died records afresh;
* never while capturing a graph or tracing (those take the full path), never on the
  ``cpu`` backend;
* the parameter blocks are owned by the record (never freed under a replay).

| piece        | where                                                    |
|--------------|----------------------------------------------------------|
| recorder     | :func:`recording` (``_driver.recorder``, ``extend.set_launch_recorder``) |
| replay       | :meth:`Record.run`                                       |
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from deviceops import _env
from deviceops.extend import Storage, Stream, ordered, set_launch_recorder

from . import _driver
from ._driver import driver_launch, replay_calls

__all__ = ["Record", "enabled", "record", "recording", "stats"]

# DEVICEOPS_REPLAY=0 turns replays off (every execution runs the launch body); tests
# switch it with monkeypatch to compare a replay with a fresh execution.
enabled = _env.get("DEVICEOPS_REPLAY") != "0"
_counts = [0, 0]  # records made, replays run


def stats() -> dict[str, int]:
    """Records made and replays run so far in this process (diagnostics and tests)."""
    return {"recorded": _counts[0], "replayed": _counts[1]}


class Record:
    """The recorded driver calls and hazard sets of one (plan, stream, pointers)."""

    __slots__ = ("calls", "extra_r", "extra_w", "one", "rpos", "wpos")

    def __init__(self, calls: list[tuple[Any, ...]], rpos: tuple[int, ...], wpos: tuple[int, ...],
                 extra_r: tuple[weakref.ref[Storage], ...],
                 extra_w: tuple[weakref.ref[Storage], ...]) -> None:
        self.calls = calls
        self.rpos = rpos
        self.wpos = wpos
        self.extra_r = extra_r
        self.extra_w = extra_w
        # one plain launch (the common case): the driver call and its arguments before the
        # stream (function, grid, block, shared memory), so that a replay makes it directly
        self.one: tuple[Any, ...] | None = None
        if len(calls) == 1 and len(calls[0]) == 7 and calls[0][6] is None:
            ln, g, b, smem = calls[0][:4]
            self.one = (driver_launch(), ln._fptr, g[0], g[1], g[2], b[0], b[1], b[2], smem)

    def run(self, stream: Stream, args: tuple[Any, ...], native_ptr: int) -> bool:
        """Replay on ``stream`` (the recording's); ``False`` (nothing done) if stale."""
        rs = [args[i]._storage for i in self.rpos]
        ws = [args[i]._storage for i in self.wpos]
        if self.extra_r or self.extra_w:
            for refs, into in ((self.extra_r, rs), (self.extra_w, ws)):
                for r in refs:
                    st = r()
                    if st is None:
                        return False
                    into.append(st)
        one = self.one
        if one is None:
            ordered(stream, rs, ws, replay_calls, self.calls, native_ptr)
        else:
            try:
                ordered(stream, rs, ws, *one, native_ptr, self.calls[0][4], 0)
            except Exception:
                # nothing was launched or recorded: the general replay retries on a context
                # error or raises DriverError naming the kernel
                ordered(stream, rs, ws, replay_calls, self.calls, native_ptr)
        _counts[1] += 1
        return True


@contextmanager
def recording() -> Iterator[tuple[list[tuple[Any, ...]], list[tuple[list[Storage], list[Storage]]]]]:
    """Switch the recorders on for the body of one op; yields (driver calls, hazard sets)."""
    calls: list[tuple[Any, ...]] = []
    sets: list[tuple[list[Storage], list[Storage]]] = []
    if _driver.recorder is not None:
        raise RuntimeError("kernel replay: recordings do not nest")  # (an op body runs no op)
    _driver.recorder = calls
    prev = set_launch_recorder(sets)
    try:
        yield calls, sets
    finally:
        _driver.recorder = None
        set_launch_recorder(prev)


def record(calls: list[tuple[Any, ...]], sets: list[tuple[list[Storage], list[Storage]]],
           args: tuple[Any, ...]) -> Record | None:
    """A :class:`Record` of one recorded body over ``args``, or ``None`` if not replayable."""
    if not calls or not sets:
        return None
    where: dict[int, int] = {}
    for i, a in enumerate(args):
        if a is not None:
            where.setdefault(id(a._storage), i)
    rpos: list[int] = []
    wpos: list[int] = []
    extra_r: list[weakref.ref[Storage]] = []
    extra_w: list[weakref.ref[Storage]] = []
    for rs, ws in sets:
        for sts, pos, extra in ((rs, rpos, extra_r), (ws, wpos, extra_w)):
            for st in sts:
                at = where.get(id(st))
                if at is not None:
                    if at not in pos:
                        pos.append(at)
                elif all(r() is not st for r in extra):  # (a workspace): held weakly
                    extra.append(weakref.ref(st))
    _counts[0] += 1
    return Record(calls, tuple(rpos), tuple(wpos), tuple(extra_r), tuple(extra_w))

