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
from ._errors import LaunchError
from ._tensor import Storage, Tensor, after_access, before_access

if TYPE_CHECKING:
    from ._context import ExecutionContext

__all__ = ["launch"]

# While a kernel op's body is being recorded for replay (deviceops.kernels._replay), each
# launch appends the storages it reads and writes here.
recorder: list[tuple[list[Storage], list[Storage]]] | None = None


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
        for st in rs:
            if st.fail[0] is not None:
                raise poisoned_input(name, st.fail[0])
        stream.enqueue(_guarded(cpu_fn, name, rs, ws, stream.seq + 1), name)  # type: ignore[attr-defined]
    else:
        try:
            cuda_fn(stream.native)  # type: ignore[attr-defined]
        except Exception as exc:
            from ._cuda_backend import raise_driver_error

            raise_driver_error(exc, name, str(stream.device))
            raise
    seq = stream.bump()
    after_access(stream, seq, rs, ws)
    if recorder is not None:
        recorder.append((rs, ws))
    if tracer is not None:
        tracer.end(token, stream)
    return seq


def poisoned_input(name: str, failed: tuple[str, BaseException]) -> LaunchError:
    """The error of an op ``name`` that reads memory whose producer ``failed``."""
    producer, exc = failed
    err = LaunchError(
        f"{name}: an input was produced by {producer}, which failed on the device "
        f"({type(exc).__name__}: {exc}); not computing on its garbage. Fix the failing op, "
        "or overwrite the tensor before using it again.",
        op=name,
    )
    err.__cause__ = exc
    return err


def _guarded(fn: Callable[[], None], name: str, rs: list[Storage],
             ws: list[Storage], seq: int) -> Callable[[], None]:
    """cpu: ``fn`` that refuses failed inputs and marks its outputs failed when it fails.

    Holds the storages' failure cells, not the storages (their lifetime is the
    hazard tracking's business).
    """
    rcells = [st.fail for st in rs]
    wcells = [st.fail for st in ws]

    def task() -> None:
        for c in rcells:
            f = c[0]
            if f is not None:
                err = poisoned_input(name, f)
                for w in wcells:
                    w[0] = f
                err._deviceops_seq = seq  # type: ignore[attr-defined]
                raise err
        try:
            fn()
        except BaseException as exc:
            for w in wcells:
                w[0] = (name, exc)
            exc._deviceops_seq = seq  # type: ignore[attr-defined]  # (see CpuStream.absorb_after)
            raise
        for w in wcells:
            if w[0] is not None:
                w[0] = None

    return task
