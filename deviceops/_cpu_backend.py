"""The ``cpu`` backend object: NumPy arrays, host memory, copies, no compiled programs.

:class:`CpuBackend` is ``device("cpu").backend``: allocation against the host's memory (a
request larger than memory plus swap is refused before NumPy sees it), copies as NumPy
copies, and submission of a kernel's NumPy reference as a task of the stream's worker.
Streams and events (one worker thread per stream, CUDA's ordering and error semantics) are
in :mod:`deviceops._cpu_stream`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from ._backend import Backend, oom_error, too_big_error
from ._cpu_stream import PRIORITIES, CpuEvent, CpuStream, guarded, poisoned_input, synchronize_all
from ._errors import DeviceError
from ._stream import Stream

if TYPE_CHECKING:
    from ._device import Device
    from ._tensor import Storage

__all__ = ["CpuBackend"]


def _host_total() -> int:
    """Bytes of host memory plus swap (``MemTotal + SwapTotal``); 2**62 if unknown."""
    total = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(("MemTotal:", "SwapTotal:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        total = 0
    if total <= 0:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 0
    return total if total > 0 else 2**62


_HOST_LIMIT = _host_total()


def _host_free() -> int | None:
    """Bytes of host memory available (``MemAvailable``), or ``None`` if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class CpuBackend(Backend):
    """The ``cpu`` backend: NumPy arrays, one worker thread per stream, no compiled programs."""

    kind = "cpu"
    is_cpu = True
    host_resident = True
    spin_before_park = False
    stream_class = CpuStream
    event_class = CpuEvent

    @property
    def array_module(self) -> ModuleType:
        return np

    def device_count(self) -> int:
        return 1

    def device_name(self, index: int) -> str:
        return "cpu" if index == 0 else f"cpu:{index}"

    def new_stream(self, device: Device, priority: int = 0) -> Stream:
        return CpuStream(device, priority)

    def stream_priorities(self, device: Device) -> tuple[int, int]:
        return PRIORITIES

    def wrap_stream(self, device: Device, native: Any) -> Stream:
        raise DeviceError("wrap_stream: the cpu backend has no native streams", device="cpu")

    def synchronize(self, device: Device) -> None:
        synchronize_all(str(device))

    def empty(self, stream: Stream, shape: tuple[int, ...], dtype: np.dtype[Any], op: str) -> Any:
        n = dtype.itemsize
        for d in shape:
            n *= d
        if n > _HOST_LIMIT:  # (numpy would raise ValueError, or overcommit and be killed later)
            raise too_big_error(op, shape, dtype, stream.device, _host_free(), _HOST_LIMIT,
                                "host memory and swap")
        try:
            return np.empty(shape, dtype)
        except MemoryError as exc:
            raise oom_error(op, shape, dtype, stream.device, _host_free()) from exc

    def host_empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        return np.empty(shape, dtype)

    def to_numpy(self, array: Any) -> np.ndarray:
        return np.asarray(array)

    def from_dlpack(self, obj: Any) -> Any:
        return np.from_dlpack(obj)

    def copy(self, dst: Any, src: Any, native: Any) -> None:
        np.copyto(dst, src)

    def download(self, src: Any, out: np.ndarray, native: Any) -> None:
        np.copyto(out, src)

    def upload(self, dst: Any, src: np.ndarray, native: Any) -> None:
        np.copyto(dst, src)

    def copy_peer(self, dst: Any, dst_device: Device, src: Any, src_device: Device,
                  native: Any) -> None:
        np.copyto(dst, src)

    def submit(self, stream: Stream, name: str, reads: Sequence[Storage],
               writes: Sequence[Storage], cpu_fn: Callable[[], None],
               cuda_fn: Callable[[Any], None]) -> None:
        for st in reads:
            if st.fail[0] is not None:
                raise poisoned_input(name, st.fail[0])
        stream.enqueue(guarded(cpu_fn, name, reads, writes, stream.seq + 1), name)

    def begin_capture(self, stream: Stream) -> None:
        pass  # CpuStream.enqueue records tasks into stream.capture while it is set

    def end_capture(self, stream: Stream) -> Any:
        return None

    def abort_capture(self, stream: Stream) -> None:
        pass

    def replay(self, stream: Stream, native: Any,
               tasks: Sequence[tuple[Callable[[], None], str]]) -> None:
        if stream.capture is not None or not isinstance(stream, CpuStream):
            for fn, name in tasks:
                stream.enqueue(fn, name)
            return
        # one queue item for the whole graph (one hand-off to the worker, as one driver call
        # launches a CUDA graph); the tasks keep their one-by-one error semantics
        worker, batch = stream._worker, tuple(tasks)
        stream.enqueue(lambda: worker.run_many(batch), "graph_replay")

    def graph_size(self, native: Any, tasks: Sequence[Any]) -> int | None:
        return len(tasks)

    def load_program(self, device: Device, source: str, *, options: tuple[str, ...] = (),
                     name_expressions: tuple[str, ...] | None = None,
                     arch_suffix: str = "") -> Any:
        raise DeviceError(
            "load_program: the cpu backend runs no compiled CUDA programs; its kernels run "
            "their NumPy references. Load programs on a cuda device (deviceops.device(0)).",
            op="load_program", device=str(device))

    def trace_mark(self, stream: Stream, clock: dict[Any, Any]) -> Callable[[], float | None]:
        box: list[float | None] = [None]
        done = threading.Event()

        def stamp() -> None:
            box[0] = time.perf_counter()
            done.set()

        stream.enqueue(stamp, "trace")

        def resolve() -> float | None:
            done.wait()
            return box[0]

        return resolve
