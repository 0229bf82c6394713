"""Devices: where tensors live and streams run.

``device(0)`` / ``device("cuda:1")`` name a CUDA GPU, ``device("cpu")`` the
NumPy backend. ``device("cpu:N")`` (N >= 0) is the N-th emulated cpu device: each has
its own streams and its own memory (a tensor of ``cpu:1`` is refused on a stream of
``cpu:0``, as a tensor of GPU 1 is on GPU 0), so multi-device placement, refusal, copies
and cross-device ordering are tested without GPUs. ``"cpu"`` is ``"cpu:0"``. The default device is CUDA device 0 when CuPy imports **and** a
GPU answers; otherwise the ``cpu`` backend, which is said once on the
``deviceops`` logger. ``DEVICEOPS_DEVICE=cpu`` or ``=cuda`` forces the choice;
forcing ``cuda`` without a usable GPU is an error.
"""

from __future__ import annotations

import logging
import threading
from types import ModuleType
from typing import Any

import numpy as np

from . import _env
from ._backend import Backend
from ._errors import DeviceError
from ._stream import Stream

__all__ = ["Device", "backend", "cuda_available", "default_device", "device",
           "set_default_device"]

_log = logging.getLogger("deviceops")
_lock = threading.Lock()
_devices: dict[str, Device] = {}
_default: Device | None = None
_cuda_probe: tuple[bool, str] | None = None
_backends: dict[str, Backend] = {}


def backend(kind: str) -> Backend:
    """The backend object of a device kind, ``"cuda"`` or ``"cpu"`` (one instance per kind).

    Creating it imports nothing heavy: the cuda backend imports CuPy on first use.
    """
    be = _backends.get(kind)
    if be is None:
        if kind == "cpu":
            from ._cpu_backend import CpuBackend

            be = CpuBackend()
        elif kind == "cuda":
            from ._cuda_backend import CudaBackend

            be = CudaBackend()
        else:
            raise ValueError(f"backend: {kind!r} is not a device kind; use 'cpu' or 'cuda'")
        be = _backends.setdefault(kind, be)  # atomic; not under _lock (device() holds it)
    return be


def _probe_cuda() -> tuple[bool, str]:
    """(usable, reason): whether CuPy imports and sees at least one GPU (asked once)."""
    global _cuda_probe
    if _cuda_probe is None:
        from ._cuda_backend import probe

        _cuda_probe = probe()
    return _cuda_probe


def cuda_available() -> bool:
    """True when CuPy imports and at least one CUDA GPU answers."""
    return _probe_cuda()[0]


class Device:
    """A place where tensors live and streams run: a CUDA GPU or the ``cpu`` backend.

    Get one with :func:`deviceops.device`; instances are unique per device.

    Attributes:
        kind: ``"cuda"`` or ``"cpu"``.
        index: the CUDA ordinal, or the emulated cpu device's number (``"cpu"`` is 0).
        backend: the :class:`~deviceops._backend.Backend` of its kind (shared by all
            devices of that kind); the device delegates to it.
        is_cpu: ``kind == "cpu"`` (a plain attribute: read on hot paths).
        xp: the array module, :mod:`cupy` or :mod:`numpy`.
    """

    def __init__(self, kind: str, index: int) -> None:
        self.kind = kind
        self.index = index
        self.backend: Backend = backend(kind)
        self.is_cpu = self.backend.is_cpu
        self.xp: ModuleType = self.backend.array_module
        self._name = self.backend.device_name(index)
        self._priorities: tuple[int, int] | None = None
        self._own: Stream | None = None
        self._own_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"deviceops.device({self._name!r})"

    def __str__(self) -> str:
        return self._name

    def own_stream(self) -> Stream:
        """This device's own stream (made on first use), where a copy out of one of its
        tensors (``t.to_host()``, ``api.memcpy`` from it) runs when the executing policy
        has no stream on this device."""
        with self._own_lock:
            if self._own is None:
                self._own = self.new_stream()
            return self._own

    def new_stream(self, priority: int = 0, *, yields: bool = False) -> Stream:
        """A new stream on this device (a worker thread for cpu, a CuPy stream for cuda).

        Args:
            priority: CUDA's convention: ``0`` (the default) is the least urgent, lower
                numbers are more urgent, down to ``stream_priorities[1]`` (``-5`` on recent
                GPUs and on the cpu backend); clamped to that range. When SMs free up, the
                device starts blocks of more urgent streams' kernels first (running blocks
                are not preempted); the cpu backend holds a less urgent stream's next task
                back while a more urgent stream of the device has a task ready to run.
            yields: its long kernels give their SMs back between tiles, so that a more
                urgent stream's kernels start within a tile's time rather than after the
                whole kernel: the library's GEMM runs one block a tile on such a stream
                instead of a persistent grid (a few percent slower for a big product
                alone). For background work beside latency-sensitive work; low-priority
                tenants' streams yield (:class:`deviceops.scheduling.Tenant`). No effect
                on the cpu backend.
        """
        if isinstance(priority, bool) or not isinstance(priority, int | np.integer):
            raise TypeError(f"new_stream: priority must be an int, got {type(priority).__name__} {priority!r}")
        if not isinstance(yields, bool):
            raise TypeError(f"new_stream: yields must be a bool, got {type(yields).__name__} {yields!r}")
        least, greatest = self.stream_priorities
        s = self.backend.new_stream(self, max(greatest, min(least, int(priority))))
        s.yields = yields
        return s

    @property
    def stream_priorities(self) -> tuple[int, int]:
        """``(least, greatest)`` stream priority (CUDA's convention: ``(0, -5)`` on an H100
        and on the cpu backend; a more negative number is more urgent)."""
        pr = self._priorities
        if pr is None:
            pr = self._priorities = self.backend.stream_priorities(self)
        return pr

    def wrap_stream(self, native: Any) -> Stream:
        """Wrap an existing :class:`cupy.cuda.Stream` of this device as a deviceops stream.

        Raises:
            DeviceError: on the cpu backend, which has no native streams.
        """
        return self.backend.wrap_stream(self, native)

    def synchronize(self) -> None:
        """Block until every stream of this device is idle (cuda: ``cudaDeviceSynchronize``)."""
        self.backend.synchronize(self)


def device(spec: int | str | Device) -> Device:
    """The device named by ``spec``: ``0``, ``"cuda"``, ``"cuda:1"``, ``"cpu"`` or ``"cpu:1"``.

    Raises:
        DeviceError: CUDA was asked for but no usable GPU exists, or the
            ordinal is out of range.
    """
    if isinstance(spec, Device):
        return spec
    if isinstance(spec, bool) or not isinstance(spec, int | np.integer | str):
        raise TypeError(f"device: expected 'cpu', 'cuda', 'cuda:N', an int N or a Device, got "
                        f"{type(spec).__name__} {spec!r}")
    if isinstance(spec, int | np.integer):
        kind, index = "cuda", int(spec)
        if index < 0:
            raise ValueError(f"device: CUDA ordinal {index} is negative; use 0, 1, ...")
    elif spec == "cpu" or (spec.startswith("cpu:") and spec[4:].isdigit()):
        kind, index = "cpu", int(spec.partition(":")[2] or 0)
    elif spec == "cuda" or (spec.startswith("cuda:") and spec[5:].isdigit()):
        kind, index = "cuda", int(spec.partition(":")[2] or 0)
    else:
        raise ValueError(f"device: {spec!r} is not a device; use 'cpu', 'cpu:N', 'cuda', 'cuda:N' "
                         "or N")
    key = ("cpu" if index == 0 else f"cpu:{index}") if kind == "cpu" else f"cuda:{index}"
    dev = _devices.get(key)
    if dev is not None:
        return dev
    if kind == "cuda":
        ok, reason = _probe_cuda()
        if not ok:
            raise DeviceError(
                f"device({spec!r}): no usable CUDA GPU: {reason}. "
                "Use device('cpu') (or DEVICEOPS_DEVICE=cpu) to run on the cpu backend.",
                device=key,
            )
        n = backend("cuda").device_count()
        if not 0 <= index < n:
            raise DeviceError(f"device({spec!r}): CUDA ordinal {index} out of range (found {n})")
    with _lock:
        return _devices.setdefault(key, Device(kind, index))


def default_device() -> Device:
    """The device ops run on when nothing else says: CUDA 0 if usable, else ``cpu``.

    ``DEVICEOPS_DEVICE=cpu|cuda|cuda:N`` forces it; :func:`set_default_device` overrides.
    """
    global _default
    if _default is not None:
        return _default
    forced = _env.get("DEVICEOPS_DEVICE")
    if forced:
        dev = device(forced)
    else:
        ok, reason = _probe_cuda()
        if ok:
            dev = device(0)
        else:
            # without CuPy nobody asked for a GPU: the cpu backend quietly (a debug line);
            # CuPy installed but no usable GPU is a surprise: a warning. Asking for a GPU
            # (DEVICEOPS_DEVICE=cuda, device("cuda")) raises DeviceError with the reason.
            import importlib.util

            say = _log.warning if importlib.util.find_spec("cupy") is not None else _log.debug
            say("deviceops: %s; using the cpu backend (NumPy).", reason)
            dev = device("cpu")
    _default = dev
    return dev


def set_default_device(dev: int | str | Device | None) -> None:
    """Make ``dev`` the default device (``None`` restores automatic choice)."""
    global _default
    _default = None if dev is None else device(dev)
