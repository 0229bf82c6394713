"""The CUDA device a thread works on: make a stream's device current for a call and give the
thread its previous device back; enable peer access between two GPUs once.

Used by :mod:`deviceops._cuda_backend` (every driver call of an op runs between
:func:`enter_device` and :func:`exit_device`, through ``Stream.enter_device``) and by the
copy paths (:func:`peer_access`). Imports CuPy on first use only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["enter_device", "exit_device", "on_device", "peer_access"]

_rt: Any = None  # cupy.cuda.runtime, bound on first use


def _runtime() -> Any:
    global _rt
    if _rt is None:
        import cupy

        _rt = cupy.cuda.runtime
    return _rt


def enter_device(index: int) -> int:
    """Make CUDA device ``index`` current on this thread; return the device to restore, or -1.

    Every piece of work the backend enqueues runs with its stream's device current and then
    gives the thread its previous device back (:func:`exit_device`), so nothing depends on,
    or leaks, an ambient current device: a caller's thread, the completion thread or an
    event loop may have any device current. Costs one ``cudaGetDevice`` when the device is
    already current.
    """
    rt = _rt or _runtime()
    prev: int = rt.getDevice()
    if prev == index:
        return -1
    rt.setDevice(index)
    return prev


def exit_device(prev: int) -> None:
    """Give the thread back the device :func:`enter_device` returned (nothing if -1)."""
    if prev >= 0:
        (_rt or _runtime()).setDevice(prev)


@contextlib.contextmanager
def on_device(index: int) -> Iterator[None]:
    """The block with CUDA device ``index`` current; the previous device restored after."""
    prev = enter_device(index)
    try:
        yield
    finally:
        exit_device(prev)


_peers: dict[tuple[int, int], bool] = {}
_PEER_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled


def peer_access(a: int, b: int) -> bool:
    """Enable peer access between CUDA devices ``a`` and ``b``, both ways, once per pair.

    Returns whether the two GPUs reach each other (NVLink or PCIe peer to peer). Where they
    do, ``cudaMemcpyPeerAsync`` copies directly between them; where they do not, the driver
    stages the copy through host memory (correct, at host-link speed). The answer is cached
    per pair; the calling thread's current device is left as it was.
    """
    key = (a, b) if a < b else (b, a)
    ok = _peers.get(key)
    if ok is not None:
        return ok
    rt = _runtime()
    ok = bool(rt.deviceCanAccessPeer(a, b)) and bool(rt.deviceCanAccessPeer(b, a))
    if ok:
        for here, there in ((a, b), (b, a)):
            with on_device(here):
                try:
                    rt.deviceEnablePeerAccess(there)
                except rt.CUDARuntimeError as exc:
                    if getattr(exc, "status", None) != _PEER_ALREADY_ENABLED:
                        raise
    _peers[key] = ok
    return ok
