"""The ``cuda`` backend: CuPy streams and events on one CUDA device.

Work is enqueued from the calling thread straight onto a non-blocking CuPy
stream; nothing runs on helper threads except completion callbacks (see
:mod:`deviceops._completion`). Driver/runtime errors are raised as
:class:`~deviceops.DriverError` carrying the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ._errors import DriverError
from ._stream import Event, Stream

if TYPE_CHECKING:
    from ._capture import CaptureState
    from ._device import Device

__all__ = ["CudaEvent", "CudaStream", "cuda_errors"]


@contextlib.contextmanager
def cuda_errors(op: str, device: str) -> Iterator[None]:
    """Turn CuPy's CUDA runtime/driver exceptions into :class:`DriverError`."""
    import cupy

    try:
        yield
    except (cupy.cuda.runtime.CUDARuntimeError, cupy.cuda.driver.CUDADriverError) as exc:
        raise DriverError(f"{op} on {device}: {exc}", op=op, device=device) from exc


def raise_driver_error(exc: BaseException, op: str, device: str) -> None:
    """Raise :class:`DriverError` from ``exc`` if it is a CUDA error; else return."""
    import cupy

    if isinstance(exc, (cupy.cuda.runtime.CUDARuntimeError, cupy.cuda.driver.CUDADriverError)):
        raise DriverError(f"{op} on {device}: {exc}", op=op, device=device) from exc


_EVENT_POOL_MAX = 4096
# Recycled raw CUDA event handles (timing disabled) per device; list.pop/append
# are atomic. Raw handles, not ``cupy.cuda.Event`` objects: a CuPy event
# destroys its handle in its finalizer, and when a CudaEvent and its CuPy event
# die together in a reference cycle (an exception traceback holding the
# awaiting frame), the garbage collector runs both finalizers, so a recycled
# CuPy event could already be destroyed. An int has no finalizer: a handle is
# destroyed exactly once, by us.
_event_pools: dict[int, list[int]] = {}
_DISABLE_TIMING = 2  # cudaEventDisableTiming
_NOT_READY = 600  # cudaErrorNotReady
_rt: Any = None  # cupy.cuda.runtime, bound on first use


def _runtime() -> Any:
    global _rt
    if _rt is None:
        import cupy

        _rt = cupy.cuda.runtime
    return _rt


_EVENT_BATCH = 64


def _new_native_event(index: int) -> int:
    """A fresh event handle; refills the device's pool in a batch (one device switch)."""
    import cupy

    rt = _runtime()
    with cupy.cuda.Device(index):
        fresh = [int(rt.eventCreateWithFlags(_DISABLE_TIMING)) for _ in range(_EVENT_BATCH)]
    _event_pools.setdefault(index, []).extend(fresh[1:])
    return fresh[0]


class CudaEvent(Event):
    """An event of a :class:`CudaStream` (a raw CUDA event handle, timing disabled)."""

    __slots__ = ("done", "native")

    def __init__(self, stream: CudaStream, seq: int, capture: CaptureState | None) -> None:
        super().__init__(stream, seq, capture)
        self.done = False  # seen complete (final: a handle is re-recorded only after this dies)
        index = stream.device.index
        pool = _event_pools.get(index)
        native = pool.pop() if pool else _new_native_event(index)
        try:
            _runtime().eventRecord(native, stream.native.ptr)
        except BaseException:
            _destroy(native)
            raise
        self.native = native

    def __del__(self) -> None:
        # Recycle the CUDA event: re-recording an abandoned event is legal, and
        # waits already enqueued on it captured its state at the time. Events
        # recorded inside a graph capture are not recycled (destroyed instead).
        native = getattr(self, "native", 0)
        if not native:
            return
        self.native = 0
        pool = _event_pools.setdefault(self.stream.device.index, [])
        if self.capture is None and len(pool) < _EVENT_POOL_MAX:
            pool.append(native)
        else:
            _destroy(native)

    def query(self) -> bool:
        if self.done:
            return True
        st = (_rt or _runtime()).eventQuery(self.native)
        if st == 0:
            self._completed()
            return True
        # Otherwise a device fault (sticky error): the event will never complete normally.
        # Say "done" so that a waiter goes on to synchronize(), which raises the error where
        # the op that waited is known (its future's result(), sync()): query never raises.
        return st != _NOT_READY

    def synchronize(self) -> None:
        if self.done:
            return
        try:
            _runtime().eventSynchronize(self.native)
        except Exception as exc:
            raise_driver_error(exc, "event synchronize", str(self.stream.device))
            raise
        self._completed()

    def _completed(self) -> None:
        if self.capture is None:  # a captured event's state is the graph's, not the stream's
            self.done = True
            if self.stream.done_seq < self.seq:
                self.stream.done_seq = self.seq

    def when_complete(self, fn: Callable[[], None]) -> None:
        from ._completion import poller

        poller().add(self, fn)


class CudaStream(Stream):
    """A stream of the ``cuda`` backend wrapping a non-blocking :class:`cupy.cuda.Stream`."""

    def __init__(self, device: Device, native: Any = None) -> None:
        import cupy

        super().__init__(device)
        if native is None:
            with cupy.cuda.Device(device.index):
                native = cupy.cuda.Stream(non_blocking=True)
        self.native = native

    def enqueue(self, fn: Callable[[], None], name: str) -> None:
        """Run ``fn()`` now with this stream current, so CuPy enqueues its work here."""
        with cuda_errors(name, str(self.device)), self.native:
            fn()

    def _record(self) -> Event:
        try:  # not the cuda_errors context manager: this is on every op's path
            return CudaEvent(self, self.seq, self.capture)
        except Exception as exc:
            raise_driver_error(exc, "record_event", str(self.device))
            raise

    def _wait(self, event: Event) -> None:
        assert isinstance(event, CudaEvent)
        with cuda_errors("wait_event", str(self.device)):
            _runtime().streamWaitEvent(self.native.ptr, event.native, 0)

    def launch_host_func(self, fn: Callable[[], None]) -> None:
        def trampoline(_arg: object) -> None:
            fn()

        with cuda_errors("launch_host_func", str(self.device)):
            self.native.launch_host_func(trampoline, None)

    def query(self) -> bool:
        with cuda_errors("stream query", str(self.device)):
            return bool(self.native.done)

    def _synchronize(self) -> None:
        with cuda_errors("stream synchronize", str(self.device)):
            self.native.synchronize()


def _destroy(handle: int) -> None:
    """Destroy a raw event handle (quietly at interpreter shutdown)."""
    with contextlib.suppress(Exception):  # the context may already be gone at exit
        _runtime().eventDestroy(handle)
