"""The backend interface: what ``cuda`` and ``cpu`` each provide to the core.

A :class:`Backend` is one small object per device kind (``deviceops.device(...).backend``,
also cached on every stream as ``stream.backend``). The core modules (tensors, DeviceOp,
api, graphs, tracing, the async bridge) ask it for everything that differs between
backends instead of branching on the device kind:

* streams and events: :meth:`~Backend.new_stream`, :meth:`~Backend.wrap_stream`,
  :meth:`~Backend.synchronize`; a stream records its own events
  (``Stream.record_event``), of the backend's :attr:`~Backend.event_class`;
* memory: :meth:`~Backend.empty` (device, ordered on a stream), :meth:`~Backend.host_empty`
  (the host side of a download), :meth:`~Backend.to_numpy`, :meth:`~Backend.from_dlpack`;
* copies, called when the work runs (cpu: on the stream's worker; cuda: at enqueue, with
  the native stream): :meth:`~Backend.copy`, :meth:`~Backend.download`,
  :meth:`~Backend.upload`, :meth:`~Backend.copy_peer`;
* work: :meth:`~Backend.submit` (step 2 of ``deviceops._launch.launch``);
* graph capture: :meth:`~Backend.begin_capture`, :meth:`~Backend.end_capture`,
  :meth:`~Backend.abort_capture`, :meth:`~Backend.replay`, :meth:`~Backend.graph_size`;
* programs: :meth:`~Backend.load_program` (the cpu backend has none: it raises);
* tracing: :meth:`~Backend.trace_mark`.

The two implementations are :class:`deviceops._cuda_backend.CudaBackend` (CuPy; the only
core module that imports it) and :class:`deviceops._cpu_backend.CpuBackend` (NumPy, one
worker thread per stream). Layering: this module depends on errors and dtypes only.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from ._errors import OutOfMemoryError

if TYPE_CHECKING:
    from ._device import Device
    from ._stream import Event, Stream
    from ._tensor import Storage

__all__ = ["Backend", "count_program_load", "on_program_load", "oom_error", "program_loaded",
           "program_loads", "too_big_error"]

# ``[programs compiled or loaded, 1 once a backend that compiles exists]``, process-wide:
# :meth:`Backend.load_program` counts (cuda: NVRTC), so that ``await`` can keep the
# compiles of ops it has not seen complete one off the event loop's thread
# (:mod:`deviceops._offload`).
program_loads = [0, 0]


def count_program_load() -> None:
    """Count one program compile/load (``program_loads[0]``; see :mod:`deviceops._offload`)."""
    program_loads[0] += 1


_load_hooks: list[Callable[[float], None]] = []


def on_program_load(hook: Callable[[float], None]) -> Callable[[], None]:
    """Call ``hook(seconds)`` after each kernel program a backend compiles or loads, with the
    time it took; returns a function that removes the hook.

    On cuda a program is NVRTC output (compiled, or read from CuPy's on-disk kernel cache:
    milliseconds, where a compile takes from a tenth of a second to several seconds), made
    at a kernel's first use in the process; the cpu backend loads none. The hook runs on the
    thread that loaded the program (``await`` may compile off the event loop's thread) and
    must not raise or block. A command-line tool shows a "compiling kernels" bar with it
    (``python -m deviceops.nn.generate`` does on a GPU whose kernel cache is empty).

    Example:
        >>> seen = []
        >>> remove = deviceops.on_program_load(seen.append)
        >>> remove()
    """
    if not callable(hook):
        raise TypeError(f"on_program_load: hook must be callable, got {type(hook).__name__}")
    _load_hooks.append(hook)

    def remove() -> None:
        if hook in _load_hooks:
            _load_hooks.remove(hook)

    return remove


def program_loaded(seconds: float) -> None:
    """Tell the :func:`on_program_load` hooks that a program was loaded in ``seconds``."""
    for h in list(_load_hooks):
        h(seconds)


class Backend(ABC):
    """What a backend provides; one instance per device kind.

    Attributes:
        kind: ``"cuda"`` or ``"cpu"``, the :attr:`Device.kind` it serves.
        is_cpu: ``kind == "cpu"`` (also a plain attribute of :class:`Device`).
        spin_before_park: whether ``await`` should poll an incomplete event on the
            host for a few microseconds before parking the task (cuda: yes, work
            finishes on its own; cpu: no, polling would take the GIL the stream's
            worker needs).
        stream_class: the :class:`Stream` subclass of this backend.
        event_class: the :class:`Event` subclass its streams record.
    """

    kind: str
    is_cpu: bool
    spin_before_park: bool
    #: whether freed small allocations may be kept per stream and handed out again
    #: (only where nothing else, such as a queued host task, may hold the array)
    spare_arrays: bool = False
    #: whether a device array is a host NumPy array: a fresh host array (``from_host``'s
    #: snapshot) can then be a tensor's memory as it is, with no copy
    host_resident: bool = False
    stream_class: type[Stream]
    event_class: type[Event]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.kind!r}>"

    # -- devices and streams --------------------------------------------------
    @property
    @abstractmethod
    def array_module(self) -> ModuleType:
        """The array module of this backend's tensors: :mod:`cupy` or :mod:`numpy`."""

    @abstractmethod
    def device_count(self) -> int:
        """How many devices of this kind exist (cpu: 1)."""

    @abstractmethod
    def device_name(self, index: int) -> str:
        """The name of device ``index`` of this kind: ``"cpu"``, ``"cuda:1"``."""

    @abstractmethod
    def new_stream(self, device: Device, priority: int = 0) -> Stream:
        """A new stream on ``device`` (cpu: a worker thread; cuda: a non-blocking CuPy stream).

        ``priority`` is in CUDA's convention (lower is more urgent), already clamped to
        :meth:`stream_priorities` by the caller.
        """

    def stream_priorities(self, device: Device) -> tuple[int, int]:
        """``(least, greatest)`` stream priority of ``device`` in CUDA's convention: the
        default ``0`` is the least urgent, ``greatest`` (negative) the most."""
        return (0, 0)

    @abstractmethod
    def wrap_stream(self, device: Device, native: Any) -> Stream:
        """Wrap an existing native stream of ``device`` (cuda: a :class:`cupy.cuda.Stream`).

        Raises:
            DeviceError: the backend has no native streams (cpu).
        """

    @abstractmethod
    def synchronize(self, device: Device) -> None:
        """Block until every stream of ``device`` is idle (cuda: ``cudaDeviceSynchronize``).

        Raises:
            DriverError: the device reported a failure (cuda).
        """

    # -- memory ---------------------------------------------------------------
    @abstractmethod
    def empty(self, stream: Stream, shape: tuple[int, ...], dtype: np.dtype[Any], op: str) -> Any:
        """An uninitialised array of ``shape``/``dtype`` on ``stream``'s device.

        cuda: from the device's memory pool, ordered on ``stream``; cpu: ``numpy.empty``.

        Raises:
            OutOfMemoryError: it does not fit; the message names ``op``, the bytes
                asked for and the bytes free.
            DriverError: the device reported another failure (cuda).
        """

    @abstractmethod
    def host_empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        """A host array that :meth:`download` can fill without blocking (cuda: page-locked)."""

    @abstractmethod
    def to_numpy(self, array: Any) -> np.ndarray:
        """A NumPy view or copy of ``array`` (cuda: a blocking copy on the current stream)."""

    @abstractmethod
    def from_dlpack(self, obj: Any) -> Any:
        """Import (zero-copy) a DLPack producer's memory as an array of this backend."""

    # -- copies: called when the work runs (cpu: on the worker, cuda: at enqueue) -----
    @abstractmethod
    def copy(self, dst: Any, src: Any, native: Any) -> None:
        """Copy ``src`` into ``dst``, two arrays of this backend on one device, on ``native``."""

    @abstractmethod
    def download(self, src: Any, out: np.ndarray, native: Any) -> None:
        """Copy device array ``src`` into ``out`` (from :meth:`host_empty`) on ``native``."""

    @abstractmethod
    def upload(self, dst: Any, src: np.ndarray, native: Any) -> None:
        """Copy host array ``src`` into device array ``dst`` on ``native``."""

    @abstractmethod
    def copy_peer(self, dst: Any, dst_device: Device, src: Any, src_device: Device,
                  native: Any) -> None:
        """Copy ``src`` on ``src_device`` into ``dst`` on ``dst_device`` (same kind) on ``native``.

        Raises:
            ShapeError: the backend needs a contiguous source (cuda) and it is not.
        """

    # -- work -----------------------------------------------------------------
    @abstractmethod
    def submit(self, stream: Stream, name: str, reads: Sequence[Storage],
               writes: Sequence[Storage], cpu_fn: Callable[[], None],
               cuda_fn: Callable[[Any], None]) -> None:
        """Enqueue one unit of work on ``stream`` (step 2 of ``deviceops._launch.launch``).

        cpu: ``cpu_fn()`` on the stream's worker, guarded by the storages' failure
        records (a failed input raises, naming its producer; a failure marks
        ``writes``). cuda: ``cuda_fn(stream.native)`` now, on the calling thread.
        Ordering (hazards), counting (``stream.bump``) and tracing stay with the
        caller.

        Raises:
            LaunchError: an input's producer failed on the device (cpu).
            DriverError: the driver refused the work (cuda).
        """

    # -- graph capture --------------------------------------------------------
    @abstractmethod
    def begin_capture(self, stream: Stream) -> None:
        """Start capturing ``stream`` (whose ``capture`` state is already set).

        cuda: a relaxed stream capture; cpu: nothing (``enqueue`` records tasks
        into ``stream.capture`` while it is set).
        """

    @abstractmethod
    def end_capture(self, stream: Stream) -> Any:
        """End the capture begun by :meth:`begin_capture`; the native graph (cpu: ``None``)."""

    @abstractmethod
    def abort_capture(self, stream: Stream) -> None:
        """End a failed capture and free the partial graph; never raises."""

    @abstractmethod
    def replay(self, stream: Stream, native: Any,
               tasks: Sequence[tuple[Callable[[], None], str]]) -> None:
        """Enqueue one replay of a captured graph on ``stream``.

        ``native`` is what :meth:`end_capture` returned; ``tasks`` the tasks the
        capture recorded (cpu). Hazards and counting stay with the caller.
        """

    @abstractmethod
    def graph_size(self, native: Any, tasks: Sequence[Any]) -> int | None:
        """Nodes (cpu: tasks) of a captured graph, or ``None`` when not known cheaply."""

    # -- programs -------------------------------------------------------------
    @abstractmethod
    def load_program(self, device: Device, source: str, *, options: tuple[str, ...] = (),
                     name_expressions: tuple[str, ...] | None = None,
                     arch_suffix: str = "") -> Any:
        """Compile CUDA C++ ``source`` for ``device`` into a loaded module (not cached here).

        Raises:
            DeviceError: the backend runs no compiled programs (cpu): its kernels
                run their NumPy references.
        """

    # -- tracing --------------------------------------------------------------
    @abstractmethod
    def trace_mark(self, stream: Stream, clock: dict[Any, Any]) -> Callable[[], float | None]:
        """Enqueue a timestamp on ``stream``; return a resolver of its host time.

        The resolver gives the ``time.perf_counter`` time at which the stream
        reached the mark (it may block until then), or ``None`` if unknown.
        ``clock`` is per-trace state the backend may keep (cuda: a base event per
        device).
        """


def oom_error(op: str, shape: tuple[int, ...], dt: np.dtype[Any], dev: Device | str,
              free: int | None) -> OutOfMemoryError:
    """The error of an allocation of ``shape``/``dt`` by ``op`` that did not fit on ``dev``."""
    asked = math.prod(shape) * dt.itemsize
    have = "unknown" if free is None else f"{free:,} bytes ({free / 2**30:.2f} GiB)"
    return OutOfMemoryError(
        f"{op}: out of memory on {dev}: asked for {asked:,} bytes ({asked / 2**30:.2f} GiB) for a "
        f"tensor of shape {shape} {dt}, {have} free. Use a smaller shape or free tensors first.",
        op=op, device=str(dev))


def too_big_error(op: str, shape: tuple[int, ...], dt: np.dtype[Any], dev: Device | str,
                  free: int | None, total: int, what: str) -> OutOfMemoryError:
    """The error of an allocation larger than ``dev`` could ever hold (``total`` bytes of
    ``what``): :func:`oom_error`'s message, raised before anything is allocated."""
    err = oom_error(op, shape, dt, dev, free)
    msg = str(err).replace(
        " Use a smaller shape or free tensors first.",
        f" That is more than {dev} has in all ({what}: {total:,} bytes), so it was refused "
        "before allocating: use a smaller shape (a dimension given in bytes, or swapped "
        "arguments?).")
    return OutOfMemoryError(msg, op=op, device=str(dev))
