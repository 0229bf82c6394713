"""Storage: the memory behind tensor views, and its hazard record.

A :class:`Storage` is shared by every view of one array and records who touched
its memory last:

* ``write``: ``(stream, seq)`` of the last op that wrote it;
* ``reads``: ``{stream: seq}`` of ops that read it since.

:func:`ordered` makes the executing stream wait on exactly the events that
order it after conflicting work on other streams (read-after-write,
write-after-read, write-after-write), makes the op's device call and updates the
record: the one hazard step of every op, capture included.

When a storage dies while a stream other than the one it was allocated on may
still use it, its memory is parked (:func:`sweep` releases it once those streams
are past the use), so the allocator cannot hand it out again too early — CuPy's
pool reuses freed blocks on the allocating stream immediately. A small array that
dies unused by other streams and unreferenced is kept as a spare for the next
allocation of its shape and dtype on its stream.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._device import Device
    from ._stream import Stream

__all__ = ["Storage", "ordered", "parked_count", "sweep"]


class Storage:
    """The memory behind one or more tensor views, and its hazard record."""

    __slots__ = ("__weakref__", "alloc_stream", "base", "device", "fail", "reads", "spare_key",
                 "ver", "write")

    def __init__(self, base: Any, device: Device, alloc_stream: Stream | None,
                 spare_key: tuple[tuple[int, ...], int] | None = None) -> None:
        self.base = base
        self.device = device
        self.alloc_stream = alloc_stream
        # given by allocate(): the key under which the array may be kept for reuse on
        # alloc_stream when this storage dies unreferenced (see _spare)
        self.spare_key = spare_key
        self.write: tuple[Stream, int] | None = None
        self.reads: dict[Stream, int] = {}
        # [(op name, error)] of the device work that last wrote this memory and
        # failed (cpu backend), else [None]: ops reading it fail too, naming that
        # op. A cell, so that queued tasks hold it without keeping the storage alive.
        self.fail: list[tuple[str, BaseException] | None] = [None]
        # [writes of this memory that have run] (cpu backend: counted by the worker as each
        # writing task finishes; a task reading it sees the count of the writes before it).
        # A cell for the same reason as ``fail``. The cpu GEMM keys its float32 weight
        # copies by it (the kernel families' ``_cpu`` modules).
        self.ver: list[int] = [0]

    @property
    def failed(self) -> tuple[str, BaseException] | None:
        """``(op name, error)`` if the device work that last wrote this memory failed."""
        return self.fail[0]

    def pending(self) -> list[tuple[Stream, int]]:
        """Accesses by streams other than the allocating one."""
        out = [(s, q) for s, q in self.reads.items() if s is not self.alloc_stream]
        w = self.write
        if w is not None and w[0] is not self.alloc_stream:
            out.append(w)
        return out

    def __del__(self) -> None:
        s = self.alloc_stream
        if s is None:
            return
        reads, w = self.reads, self.write
        if (w is None or w[0] is s) and (not reads or (len(reads) == 1 and s in reads)):
            # no use by another stream: the memory goes back at once
            if self.spare_key is not None:
                _spare(s, self.spare_key, self.base)
            return
        try:
            uses = self.pending()
        except Exception:
            return
        if uses:
            _parked.append((self.base, uses))


# (array kept alive, [(stream, seq) that must complete first])
_parked: list[tuple[Any, list[tuple[Stream, int]]]] = []

# Spare arrays (backends with ``spare_arrays``): a small array whose storage dies with no
# use by another stream, and which nothing else references (no view, no exported handle,
# no MemoryPointer: reference counts), is kept on its stream and handed to the next
# allocation of the same shape and dtype there. Work on one stream is ordered, so reuse
# needs no wait (as for the memory pool's per-stream free lists); it saves the pool round
# trip and the array construction. Bounded per stream.
SPARE_MAX_BYTES = 256 * 1024
_SPARE_PER_KEY = 4
_SPARE_KEYS = 32
_refcount = sys.getrefcount


def _spare(stream: Stream, key: tuple[tuple[int, ...], int], base: Any) -> None:
    try:
        # the storage's attribute, this argument and getrefcount's own: nothing else
        if _refcount(base) != 3 or _refcount(base.data) != 2:
            return
        spare = stream.spare
        got = spare.get(key)
        if got is None:
            if len(spare) < _SPARE_KEYS:
                spare[key] = [base]
        elif len(got) < _SPARE_PER_KEY:
            got.append(base)
    except Exception:  # interpreter shutdown, an array without .data: just free it
        pass


def sweep() -> None:
    """Release parked memory whose cross-stream uses have completed."""
    if not _parked:
        return
    keep = []
    for base, uses in _parked:
        left = []
        for s, q in uses:
            ev = s._last_event
            if ev is None or ev.seq < q or ev.capture is not None:
                if s.capture is not None:
                    left.append((s, q))
                    continue
                ev = s.record_event()
            if not ev.query():
                left.append((s, q))
        if left:
            keep.append((base, left))
    _parked[:] = keep


def parked_count() -> int:
    """Number of parked allocations (for tests and diagnostics)."""
    return len(_parked)


def ordered(stream: Stream, reads: Sequence[Storage], writes: Sequence[Storage],
            call: Callable[..., None], *args: Any) -> int:
    """``call(*args)``, ordered over the storages ``reads`` / ``writes``: the hazard step of
    every op. Returns the op's sequence number on ``stream``.

    Before the call, ``stream`` waits (events, only where needed) for the work of other
    streams that last wrote what it reads or writes (read-after-write, write-after-write)
    and that read what it writes (write-after-read). After it, the op is counted on
    ``stream`` and the records are updated: ``reads`` were read at this point of
    ``stream``, ``writes`` written (their earlier reads are then superseded). While
    ``stream`` is captured, the capture notes every storage. If ``call`` raises, nothing
    is counted or recorded.

    Written out as one function (no helper calls): it runs once per op on every path.
    """
    for st in reads:
        w = st.write
        if w is not None and w[0] is not stream:
            stream.wait_for(w[0], w[1])
    for st in writes:
        w = st.write
        if w is not None and w[0] is not stream:
            stream.wait_for(w[0], w[1])
        if st.reads:
            for s, q in st.reads.items():
                if s is not stream:
                    stream.wait_for(s, q)
    enter = stream.enter_device
    if enter is None:
        call(*args)
    else:  # cuda: the stream's device current for the driver calls, the thread's given back
        prev = enter()
        try:
            call(*args)
        finally:
            if prev >= 0:
                stream.exit_device(prev)  # type: ignore[misc]
    seq = stream.seq + 1  # (Stream.bump)
    stream.seq = seq
    for st in reads:
        st.reads[stream] = seq
    for st in writes:
        st.write = (stream, seq)
        if st.reads:
            st.reads = {}
    cap = stream.capture
    if cap is not None:
        for st in reads:
            cap.note(st, False)
        for st in writes:
            cap.note(st, True)
    return seq
