"""The one primitive every op that touches device memory goes through.

``launch(ctx, name, reads, writes, cpu_fn, cuda_fn)``:

1. orders ``ctx.stream`` after conflicting work of other streams on the
   tensors read and written (events, only where needed);
2. enqueues the work: ``cpu_fn()`` on the cpu stream's worker, or
   ``cuda_fn(native_stream)`` right now on the calling thread, which enqueues
   CUDA work on that CuPy stream;
3. counts the op on the stream and updates the tensors' hazard records;
4. reports it to an active :func:`deviceops.trace`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from . import _trace
from ._tensor import Tensor, after_access, before_access

if TYPE_CHECKING:
    from ._context import ExecutionContext

__all__ = ["launch"]


def launch(
    ctx: ExecutionContext,
    name: str,
    reads: Sequence[Tensor],
    writes: Sequence[Tensor],
    cpu_fn: Callable[[], None],
    cuda_fn: Callable[[Any], None],
) -> int:
    """Enqueue one unit of device work on ``ctx.stream``; return its sequence number."""
    stream = ctx.stream
    rs = [t._storage for t in reads]
    ws = [t._storage for t in writes]
    before_access(stream, rs, ws)
    tracer = _trace.current
    if tracer is not None:
        token = tracer.begin(name, stream)
    if stream.device.is_cpu:
        stream.enqueue(cpu_fn, name)  # type: ignore[attr-defined]
    else:
        try:
            cuda_fn(stream.native)  # type: ignore[attr-defined]
        except Exception as exc:
            from ._cuda_backend import raise_driver_error

            raise_driver_error(exc, name, str(stream.device))
            raise
    seq = stream.bump()
    after_access(stream, seq, rs, ws)
    if tracer is not None:
        tracer.end(token, stream)
    return seq
