"""The one primitive every op that touches device memory goes through.

``launch(ctx, name, reads, writes, cpu_fn, cuda_fn)``:

1. orders ``ctx.stream`` after conflicting work of other streams on the
   tensors read and written (events, only where needed);
2. enqueues the work: ``cpu_fn()`` on the cpu stream's worker, or
   ``cuda_fn(native_stream)`` right now on the calling thread, which enqueues
   CUDA work on that CuPy stream;
3. counts the op on the stream and updates the tensors' hazard records;
4. reports it to an active :func:`deviceops.trace`.

On the cpu backend the work also keeps the tensors' failure records: a task
that raises marks the tensors it writes as failed (naming the op); a task that
reads a failed tensor raises instead of computing on garbage, naming the failed
producer (at enqueue already when the failure is known then). On cuda a device
fault is sticky and reported by every later synchronization.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from . import _trace
from ._storage import ordered
from ._tensor import Storage, Tensor

if TYPE_CHECKING:
    from ._context import ExecutionContext
    from ._stream import Stream

__all__ = ["launch", "ordered", "set_launch_recorder"]

# While a kernel op's body is being recorded for replay (deviceops.kernels.runtime._replay), each
# launch appends the storages it reads and writes here (set_launch_recorder).
_recorder: list[tuple[list[Storage], list[Storage]]] | None = None


def set_launch_recorder(rec: list[tuple[list[Storage], list[Storage]]] | None
                        ) -> list[tuple[list[Storage], list[Storage]]] | None:
    """Install ``rec`` (or ``None``): every :func:`launch` appends ``(reads, writes)`` (the
    storages) to it. Returns the previous recorder."""
    global _recorder
    prev, _recorder = _recorder, rec
    return prev


def launch(
    ctx: ExecutionContext,
    name: str,
    reads: Sequence[Tensor],
    writes: Sequence[Tensor],
    cpu_fn: Callable[[], None],
    cuda_fn: Callable[[Any], None],
) -> int:
    """Enqueue one unit of device work on ``ctx.stream``; return its sequence number.

    The backend runs one of the two halves (:meth:`Backend.submit`: ``cpu_fn()`` on a cpu
    stream's worker, ``cuda_fn(native_stream)`` now on cuda).
    """
    stream = ctx.stream
    rs = [t._storage for t in reads]
    ws = [t._storage for t in writes]
    tracer = _trace.current
    if tracer is None:
        seq = ordered(stream, rs, ws, stream.backend.submit, stream, name, rs, ws, cpu_fn, cuda_fn)
    else:
        seq = ordered(stream, rs, ws, _traced_submit, tracer, stream, name, rs, ws, cpu_fn, cuda_fn)
    if _recorder is not None:
        _recorder.append((rs, ws))
    return seq


def _traced_submit(tracer: Any, stream: Stream, name: str, rs: list[Storage], ws: list[Storage],
                   cpu_fn: Callable[[], None], cuda_fn: Callable[[Any], None]) -> None:
    """:meth:`Backend.submit` between the trace's marks of the op."""
    token = tracer.begin(name, stream)
    stream.backend.submit(stream, name, rs, ws, cpu_fn, cuda_fn)
    tracer.end(token, stream)
