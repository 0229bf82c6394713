"""A thin ``cuLaunchKernel`` wrapper for the smallest, most frequent kernels.

CuPy's ``RawKernel.__call__`` inspects every argument on every call (array or
scalar, which dtype, which device) and is the largest single host cost of a
tiny launch. The elementwise launchers know their argument types in advance,
so they call the driver directly through ctypes:

* the argument types are fixed per kernel by a code string
  (``p`` device pointer, ``f`` float32, ``i`` int32, ``q`` int64);
* the packed ``kernelParams`` array for a given argument tuple is built once
  and cached (the driver copies the values at launch, so reuse is safe);
* a launch is one call of CuPy's typed Cython binding of ``cuLaunchKernel``
  (``cupy.cuda.driver.launchKernel``): no per-argument inspection.

The function handle comes from the CuPy module (loaded and cached by
:mod:`._module`), so compilation, caching and module lifetime stay CuPy's.
Launch failures raise :class:`~deviceops.DriverError` naming the kernel and
device. A thread whose current CUDA context is not the kernel's device gets
it made current once (``cudaSetDevice``) and the launch retried.
"""

from __future__ import annotations

import ctypes
from typing import Any

from deviceops._errors import DriverError

__all__ = ["Launcher"]

_CTYPES = {"p": ctypes.c_void_p, "f": ctypes.c_float, "i": ctypes.c_int32, "q": ctypes.c_int64}
_CUDA_ERROR_INVALID_CONTEXT = 201
_CUDA_ERROR_INVALID_HANDLE = 400
_CACHE_LIMIT = 4096
_cu_launch: Any = None


def _driver_launch() -> Any:
    """CuPy's typed binding of ``cuLaunchKernel`` (resolved once)."""
    global _cu_launch
    if _cu_launch is None:
        import cupy

        _cu_launch = cupy.cuda.driver.launchKernel
    return _cu_launch


class Launcher:
    """Launch one CuPy-loaded kernel through the driver with typed, cached arguments.

    Args:
        kernel: the CuPy ``RawKernel`` (from ``RawModule.get_function``).
        codes: one character per kernel parameter: ``p`` pointer, ``f``
            float32, ``i`` int32, ``q`` int64.
        name: the kernel's name, for errors.
        device_index: the CUDA device the module was loaded on.
    """

    __slots__ = ("_cache", "_fptr", "_launch", "_types", "device_index", "name")

    def __init__(self, kernel: Any, codes: str, name: str, device_index: int) -> None:
        if any(c not in _CTYPES for c in codes):
            raise ValueError(f"Launcher({name}): unknown argument code in {codes!r}; use p, f, i, q")
        self._fptr = int(kernel.kernel.ptr)
        self._types = tuple(_CTYPES[c] for c in codes)
        self._cache: dict[tuple[Any, ...], Any] = {}
        self._launch = _driver_launch()
        self.name = name
        self.device_index = device_index

    def _pack(self, args: tuple[Any, ...]) -> Any:
        if len(args) != len(self._types):
            raise TypeError(f"{self.name}: expected {len(self._types)} kernel arguments, got {len(args)}")
        holders = tuple(t(v) for t, v in zip(self._types, args, strict=True))
        params = (ctypes.c_void_p * len(holders))(*(ctypes.addressof(h) for h in holders))
        if len(self._cache) >= _CACHE_LIMIT:
            # evict the oldest entry (dicts keep insertion order): O(1) per launch,
            # never a pause that frees thousands of packed argument blocks at once
            del self._cache[next(iter(self._cache))]
        addr = ctypes.addressof(params)
        self._cache[args] = (addr, params, holders)
        return addr

    def __call__(self, grid: tuple[int, int, int], block: tuple[int, int, int], args: tuple[Any, ...],
                 stream_ptr: int, shared_mem: int = 0) -> None:
        """Enqueue the kernel on the CUDA stream ``stream_ptr``."""
        entry = self._cache.get(args)
        params = entry[0] if entry is not None else self._pack(args)
        try:
            self._launch(self._fptr, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                         shared_mem, stream_ptr, params, 0)
        except Exception as exc:
            self._retry_or_raise(exc, grid, block, params, stream_ptr, shared_mem)

    def _retry_or_raise(self, exc: Exception, grid: tuple[int, int, int], block: tuple[int, int, int],
                        params: int, stream_ptr: int, shared_mem: int) -> None:
        import cupy

        status = getattr(exc, "status", None)
        if status in (_CUDA_ERROR_INVALID_CONTEXT, _CUDA_ERROR_INVALID_HANDLE):
            cupy.cuda.runtime.setDevice(self.device_index)
            try:
                _driver_launch()(self._fptr, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                                 shared_mem, stream_ptr, params, 0)
                return
            except Exception as again:
                exc = again
        raise DriverError(f"launching {self.name} (grid {grid}, block {block}) on cuda:{self.device_index} "
                          f"failed: {exc}", op=self.name, device=f"cuda:{self.device_index}") from exc


# -- programmatic dependent launch (graph capture) -------------------------------
# In a captured chain of tiny kernels the gap between dependent kernels
# dominates. Launched with the "programmatic stream serialization" attribute, a
# kernel may begin launching while its predecessor finishes; it waits for the
# predecessor's results with ``griddepcontrol.wait`` (the elementwise kernels
# do so first thing, sm_90+). Used only while capturing, where the ctypes call
# costs nothing at replay time. ``DEVICEOPS_PDL=0`` turns it off.
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _AttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("programmatic_stream_serialization_allowed", ctypes.c_int)]


class _Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _Config(ctypes.Structure):
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("num_attrs", ctypes.c_uint)]


_cu_launch_ex: Any = None
_pdl_devices: dict[int, bool] = {}


def pdl_enabled(device_index: int) -> bool:
    """Whether captured elementwise launches use programmatic dependent launch here."""
    ok = _pdl_devices.get(device_index)
    if ok is None:
        import os

        import cupy

        major = int(cupy.cuda.Device(device_index).compute_capability[:-1] or 0)
        ok = _pdl_devices[device_index] = major >= 9 and os.environ.get("DEVICEOPS_PDL", "1") != "0"
    return ok


def launch_pdl(ln: Launcher, grid: tuple[int, int, int], block: tuple[int, int, int],
               args: tuple[Any, ...], stream_ptr: int) -> None:
    """``ln(...)`` through ``cuLaunchKernelEx`` with programmatic stream serialization."""
    global _cu_launch_ex
    if _cu_launch_ex is None:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
        fn.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        _cu_launch_ex = fn
    entry = ln._cache.get(args)
    params = entry[0] if entry is not None else ln._pack(args)
    attr = _Attr()
    attr.id = _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmatic_stream_serialization_allowed = 1
    cfg = _Config(grid[0], grid[1], grid[2], block[0], block[1], block[2], 0, stream_ptr,
                  ctypes.pointer(attr), 1)
    rc = _cu_launch_ex(ctypes.byref(cfg), ln._fptr, params, None)
    if rc:
        raise DriverError(f"launching {ln.name} with programmatic dependent launch on "
                          f"cuda:{ln.device_index} failed: CUresult {rc}; set DEVICEOPS_PDL=0 to "
                          "capture without it", op=ln.name, device=f"cuda:{ln.device_index}")
