"""The ``cuda`` backend: CuPy streams, events, memory, copies, graphs and programs.

Work is enqueued from the calling thread straight onto a non-blocking CuPy
stream; nothing runs on helper threads except completion callbacks (see
:mod:`deviceops._completion`). Driver/runtime errors are raised as
:class:`~deviceops.DriverError` carrying the device.

This and :mod:`._cuda_device` (the current-device guard, peer access) are the only core
modules that import CuPy (``_device`` asks :func:`probe`
whether a GPU answers). :class:`CudaBackend` is the backend object
(``device(0).backend``).
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from ._backend import (
    Backend,
    count_program_load,
    oom_error,
    program_loaded,
    program_loads,
    too_big_error,
)
from ._cuda_device import _runtime, enter_device, exit_device, on_device, peer_access
from ._errors import DeviceError, DriverError, ShapeError
from ._stream import Event, Stream

if TYPE_CHECKING:
    from ._capture import CaptureState
    from ._device import Device
    from ._tensor import Storage

__all__ = ["CudaBackend", "CudaEvent", "CudaStream", "cuda_errors", "enter_device",
           "exit_device", "on_device", "peer_access", "probe", "raise_driver_error"]


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


_D2H = 2  # cudaMemcpyDeviceToHost
_EVENT_POOL_MAX = 4096
# Recycled raw CUDA event handles (timing disabled) per device; list.pop/append
# are atomic. Raw handles, not ``cupy.cuda.Event`` objects: a CuPy event
# destroys its handle in its finalizer, and when a CudaEvent and its CuPy event
# die together in a reference cycle (an exception traceback holding the
# awaiting frame), the garbage collector runs both finalizers, so a recycled
# CuPy event could already be destroyed. An int has no finalizer: a handle is
# destroyed exactly once, by us.
_event_pools: dict[int, list[int]] = {}

# The CuPy streams new_stream() makes live as long as the process and are reused: a dead
# CudaStream hands its stream back. A cupy.cuda.Stream destroys its CUDA stream in __del__, and
# the garbage collector runs the finalizers of every object of an unreachable cycle before it
# sees that one of them, a Storage parking its memory until the streams that used it are done
# (deviceops._storage), made a stream reachable again: that stream would be used after its
# destruction (a segfault in the next sweep). Held here, a stream is never in such a cycle.
# A stream reused while a resurrected CudaStream still names it only orders more work after.
_made_natives: list[Any] = []
_idle_natives: dict[tuple[int, int], list[Any]] = {}  # (device, priority) -> natives
_DISABLE_TIMING = 2  # cudaEventDisableTiming
_NOT_READY = 600  # cudaErrorNotReady


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
        st = _runtime().eventQuery(self.native)
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

    def __init__(self, device: Device, native: Any = None, priority: int = 0) -> None:
        import cupy

        super().__init__(device)
        if native is None:
            with cupy.cuda.Device(device.index):
                native = cupy.cuda.Stream(non_blocking=True, priority=priority)
        else:
            priority = int(getattr(native, "priority", priority) or 0)
        self.priority = priority
        self.native = native
        self.enter_device = functools.partial(enter_device, device.index)
        self.exit_device = exit_device

    def enqueue(self, fn: Callable[[], None], name: str) -> None:
        """Run ``fn()`` now with this stream (and its device) current, so CuPy enqueues its
        work here."""
        prev = enter_device(self.device.index)
        try:
            with cuda_errors(name, str(self.device)), self.native:
                fn()
        finally:
            exit_device(prev)

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

        with cuda_errors("launch_host_func", str(self.device)), on_device(self.device.index):
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


def probe() -> tuple[bool, str]:
    """(usable, reason): whether CuPy imports and sees at least one GPU (not cached here)."""
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
        return (n > 0, f"{n} CUDA device(s)" if n else "CuPy sees no CUDA device")
    except ImportError as exc:
        return (False, f"CuPy is not installed ({exc})")
    except Exception as exc:  # CUDARuntimeError: no driver / no device
        return (False, f"CuPy found no usable GPU ({type(exc).__name__}: {exc})")


_cupy: Any = None


# device ordinal -> total device memory in bytes (asked once; the bound for one allocation)
_DEVICE_LIMIT: dict[int, int] = {}


def _device_total(rt: Any, index: int) -> int:
    """Total memory of device ``index`` (the current device), remembered; 2**62 if unknown."""
    try:
        total = int(rt.memGetInfo()[1])
    except Exception:
        total = 0
    _DEVICE_LIMIT[index] = total if total > 0 else 2**62
    return _DEVICE_LIMIT[index]


def _cp() -> Any:
    """The :mod:`cupy` module, imported on first use."""
    global _cupy
    if _cupy is None:
        import cupy

        _cupy = cupy
    return _cupy


def _on(native: Any, fn: Callable[[], Any]) -> Any:
    """``fn()`` with ``native`` the current CuPy stream (CuPy enqueues its work there)."""
    with native:
        return fn()


class CudaBackend(Backend):
    """The ``cuda`` backend: CuPy arrays and streams, NVRTC-compiled programs, CUDA graphs."""

    kind = "cuda"
    is_cpu = False
    spin_before_park = True
    spare_arrays = True
    stream_class = CudaStream
    event_class = CudaEvent

    @property
    def array_module(self) -> ModuleType:
        cupy: ModuleType = _cp()
        return cupy

    def device_count(self) -> int:
        return int(_cp().cuda.runtime.getDeviceCount())

    def device_name(self, index: int) -> str:
        return f"cuda:{index}"

    def new_stream(self, device: Device, priority: int = 0) -> Stream:
        program_loads[1] = 1  # a GPU is in use: programs may compile (see deviceops._offload)
        idle = _idle_natives.setdefault((device.index, priority), [])
        try:
            native = idle.pop()
        except IndexError:
            native = None
        stream = CudaStream(device, native, priority)
        if native is None:
            _made_natives.append(stream.native)
        weakref.finalize(stream, idle.append, stream.native)
        return stream

    def wrap_stream(self, device: Device, native: Any) -> Stream:
        program_loads[1] = 1
        return CudaStream(device, native)

    def stream_priorities(self, device: Device) -> tuple[int, int]:
        ask = getattr(_cp().cuda.runtime, "deviceGetStreamPriorityRange", None)
        if ask is None:  # (a CuPy without the call) CUDA clamps a priority outside the range
            return (0, -5)
        with cuda_errors("stream priority range", str(device)), _cp().cuda.Device(device.index):
            least, greatest = ask()
        return (int(least), int(greatest))

    def synchronize(self, device: Device) -> None:
        cupy = _cp()
        with cuda_errors("device synchronize", str(device)), cupy.cuda.Device(device.index):
            cupy.cuda.runtime.deviceSynchronize()

    def empty(self, stream: Stream, shape: tuple[int, ...], dtype: np.dtype[Any], op: str) -> Any:
        """``cupy.empty`` from the device's memory pool, ordered on ``stream`` (CuPy's pool
        hands out memory per current stream), with the device made current only if needed."""
        cupy = _cupy if _cupy is not None else _cp()
        rt = cupy.cuda.runtime
        index = stream.device.index
        prev = rt.getDevice()
        try:
            if prev != index:
                rt.setDevice(index)
            # the pool's block for this stream (CuPy's pool keys free blocks by the current
            # stream), then the array over it: cupy.empty's work without its argument parsing
            n = dtype.itemsize
            for d in shape:
                n *= d
            limit = _DEVICE_LIMIT.get(index)
            if limit is None:
                limit = _device_total(rt, index)
            if n > limit:  # refused before the pool tries (and before it frees its cache)
                try:
                    have: int | None = int(rt.memGetInfo()[0])
                except Exception:
                    have = None
                raise too_big_error(op, shape, dtype, stream.device, have, limit,
                                    "device memory")
            with stream.native:
                mem = cupy.cuda.memory.alloc(n)
            return cupy.ndarray(shape, dtype, mem)
        except cupy.cuda.memory.OutOfMemoryError as exc:
            try:
                free: int | None = int(rt.memGetInfo()[0])
            except Exception:
                free = None
            raise oom_error(op, shape, dtype, stream.device, free) from exc
        except (rt.CUDARuntimeError, cupy.cuda.driver.CUDADriverError) as exc:
            raise DriverError(f"allocate on {stream.device}: {exc}", op="allocate",
                              device=str(stream.device)) from exc
        finally:
            if prev != index:
                rt.setDevice(prev)

    def host_empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        import cupyx

        pinned: np.ndarray = cupyx.empty_pinned(shape, dtype)
        return pinned

    def to_numpy(self, array: Any) -> np.ndarray:
        with on_device(array.device.id):
            host: np.ndarray = array.get()
        return host

    def from_dlpack(self, obj: Any) -> Any:
        return _cp().from_dlpack(obj)

    def copy(self, dst: Any, src: Any, native: Any) -> None:
        if dst.flags.c_contiguous and src.flags.c_contiguous:
            rt = _cp().cuda.runtime
            rt.memcpyAsync(dst.data.ptr, src.data.ptr, dst.nbytes, rt.memcpyDeviceToDevice,
                           native.ptr)
        else:
            _on(native, lambda: dst.__setitem__(Ellipsis, src))

    def download(self, src: Any, out: np.ndarray, native: Any) -> None:
        # ``out`` is page-locked and C-contiguous (host_empty): one asynchronous copy, made
        # directly (CuPy's ``get`` checks and wraps the same call at several times its cost)
        a = src if src.flags.c_contiguous else _on(native, src.copy)
        if a.nbytes:
            _runtime().memcpyAsync(out.ctypes.data, a.data.ptr, a.nbytes, _D2H, native.ptr)

    def upload(self, dst: Any, src: np.ndarray, native: Any) -> None:
        dst.set(src if src.flags.c_contiguous else np.ascontiguousarray(src), stream=native)

    def copy_peer(self, dst: Any, dst_device: Device, src: Any, src_device: Device,
                  native: Any) -> None:
        if not src.flags.c_contiguous:
            raise ShapeError("to_device: source must be contiguous", op="to_device")
        rt = _cp().cuda.runtime
        if dst_device.index == src_device.index:
            rt.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, rt.memcpyDeviceToDevice,
                           native.ptr)
            return
        peer_access(src_device.index, dst_device.index)
        rt.memcpyPeerAsync(dst.data.ptr, dst_device.index, src.data.ptr, src_device.index,
                           src.nbytes, native.ptr)

    def submit(self, stream: Stream, name: str, reads: Sequence[Storage],
               writes: Sequence[Storage], cpu_fn: Callable[[], None],
               cuda_fn: Callable[[Any], None]) -> None:
        try:  # (the stream's device is current: deviceops._storage.ordered makes it so)
            cuda_fn(stream.native)
        except Exception as exc:
            raise_driver_error(exc, name, str(stream.device))
            raise

    def begin_capture(self, stream: Stream) -> None:
        mode = getattr(_cp().cuda.runtime, "streamCaptureModeRelaxed", 2)
        with cuda_errors("begin_capture", str(stream.device)), on_device(stream.device.index):
            stream.native.begin_capture(mode=mode)

    def end_capture(self, stream: Stream) -> Any:
        with cuda_errors("end_capture", str(stream.device)), on_device(stream.device.index):
            return stream.native.end_capture()

    def abort_capture(self, stream: Stream) -> None:
        try:
            with on_device(stream.device.index):
                g = stream.native.end_capture()
            del g
        except Exception:
            pass  # an invalidated capture fails to end; the partial graph is gone either way

    def replay(self, stream: Stream, native: Any,
               tasks: Sequence[tuple[Callable[[], None], str]]) -> None:
        # (the stream's device is current: deviceops._storage.ordered makes it so)
        try:
            native.launch(stream.native)
        except Exception as exc:
            raise_driver_error(exc, "graph launch", str(stream.device))
            raise

    def graph_size(self, native: Any, tasks: Sequence[Any]) -> int | None:
        return None

    def load_program(self, device: Device, source: str, *, options: tuple[str, ...] = (),
                     name_expressions: tuple[str, ...] | None = None,
                     arch_suffix: str = "") -> Any:
        """Compile ``source`` with NVRTC for ``device`` into a :class:`cupy.RawModule`.

        Options are ``--gpu-architecture=sm_<cc><arch_suffix> -std=c++17 *options``
        (as ``deviceops.kernels.runtime._module.load_module`` passes them); caching is the
        caller's business (CuPy also caches NVRTC output on disk).
        """
        if device.kind != "cuda":
            raise DeviceError(f"load_program: {device} is not a CUDA device", op="load_program",
                              device=str(device))
        cupy = _cp()
        program_loads[1] = 1
        count_program_load()  # (an await that sees the count move keeps the op cold)
        t0 = time.perf_counter()
        with cupy.cuda.Device(device.index):
            arch = str(cupy.cuda.Device(device.index).compute_capability) + arch_suffix
            opts = (f"--gpu-architecture=sm_{arch}", "-std=c++17", *options)
            mod = cupy.RawModule(
                code=source,
                options=opts,
                backend="nvrtc",
                name_expressions=list(name_expressions) if name_expressions else None,
            )
            mod.compile()
        program_loaded(time.perf_counter() - t0)
        return mod

    def trace_mark(self, stream: Stream, clock: dict[Any, Any]) -> Callable[[], float | None]:
        cupy = _cp()
        index = stream.device.index
        base = clock.get(index)
        with on_device(index):
            if base is None:  # one base event per device and trace, taken against the host clock
                ev0 = cupy.cuda.Event()
                ev0.record(stream.native)
                ev0.synchronize()
                base = clock[index] = (ev0, time.perf_counter())
            ev = cupy.cuda.Event()
            ev.record(stream.native)
        ev0, host0 = base

        def resolve() -> float | None:
            try:
                ev.synchronize()
                return float(host0 + cupy.cuda.get_elapsed_time(ev0, ev) / 1e3)
            except Exception:
                return None

        return resolve
