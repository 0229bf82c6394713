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
# recycled cupy events (timing disabled) per device; list.pop/append are atomic
_event_pools: dict[int, list[Any]] = {}


def _new_native_event(index: int) -> Any:
    import cupy

    with cupy.cuda.Device(index):
        return cupy.cuda.Event(disable_timing=True)


class CudaEvent(Event):
    """An event of a :class:`CudaStream` (a CuPy event, timing disabled)."""

    __slots__ = ("native",)

    def __init__(self, stream: CudaStream, seq: int, capture: CaptureState | None) -> None:
        super().__init__(stream, seq, capture)
        index = stream.device.index
        pool = _event_pools.get(index)
        native = pool.pop() if pool else _new_native_event(index)
        native.record(stream.native)
        self.native = native

    def __del__(self) -> None:
        # Recycle the CUDA event: re-recording an abandoned event is legal, and
        # waits already enqueued on it captured its state at the time. Events
        # recorded inside a graph capture are not recycled.
        native = getattr(self, "native", None)
        if native is None or self.capture is not None:
            return
        pool = _event_pools.setdefault(self.stream.device.index, [])
        if len(pool) < _EVENT_POOL_MAX:
            pool.append(native)

    def query(self) -> bool:
        try:
            return bool(self.native.done)
        except Exception as exc:
            raise_driver_error(exc, "event query", str(self.stream.device))
            raise

    def synchronize(self) -> None:
        try:
            self.native.synchronize()
        except Exception as exc:
            raise_driver_error(exc, "event synchronize", str(self.stream.device))
            raise
        if self.capture is None and self.stream.done_seq < self.seq:
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
        with cuda_errors("record_event", str(self.device)):
            return CudaEvent(self, self.seq, self.capture)

    def _wait(self, event: Event) -> None:
        assert isinstance(event, CudaEvent)
        with cuda_errors("wait_event", str(self.device)):
            self.native.wait_event(event.native)

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
