"""The one kernel-launch path: a thin ``cuLaunchKernel`` wrapper every deviceops kernel uses.

CuPy's ``RawKernel.__call__`` inspects every argument on every call (array or
scalar, which dtype, which device) and is the largest single host cost of a
tiny launch. So every launcher (elementwise, gemm, attention, norms, embedding,
argmax, the transformer kernels, sampling, the test kernels) calls the driver
directly: :class:`Launcher` with argument codes known in advance, or
:class:`KernelFn` (CuPy's call signature, codes derived once per argument-type
pattern), or :func:`launch_pdl` (programmatic dependent launch); :func:`libcuda`
is the only place the driver library is loaded through ctypes.

* the argument types are fixed per kernel by a code string
  (``p`` device pointer, ``f`` float32, ``d`` float64, ``i`` int32, ``q`` int64);
* the packed ``kernelParams`` array for a given argument tuple is built once
  and cached (the driver copies the values at launch, so reuse is safe);
* a launch is one call of CuPy's typed Cython binding of ``cuLaunchKernel``
  (``cupy.cuda.driver.launchKernel``): no per-argument inspection.

The function handle comes from the CuPy module (loaded and cached by
:mod:`._module`), so compilation, caching and module lifetime stay CuPy's.
Launch failures raise :class:`~deviceops.DriverError` naming the kernel and
device. Launches made through ``deviceops.extend.ordered`` run with their stream's
device current; one made elsewhere from a thread whose current CUDA context is another
device's is retried once with the kernel's device current, and the thread's device is
given back.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

from deviceops import _env
from deviceops.extend import DriverError

from ._module import function_ptr

__all__ = ["KernelFn", "Launcher", "driver_launch", "fast_kernel", "launch_packed", "launch_packed_pdl",
           "launch_pdl", "launch_plain", "launcher_for", "libcuda", "max_active_clusters", "pdl_enabled",
           "replay_calls", "retry_or_raise"]

_CTYPES = {"p": ctypes.c_void_p, "f": ctypes.c_float, "d": ctypes.c_double, "i": ctypes.c_int32,
           "q": ctypes.c_int64}
_CUDA_ERROR_INVALID_CONTEXT = 201
_CUDA_ERROR_INVALID_HANDLE = 400
_CACHE_LIMIT = 4096
_cu_launch: Any = None
# While a kernel op's body is being recorded (kernels/runtime/_replay.py), every launch appends
# (launcher, grid, block, shared_mem, params address, params entry, PDL config or None).
recorder: list[tuple[Any, ...]] | None = None


_libcuda: Any = None


def libcuda() -> Any:
    """The CUDA driver library (``ctypes.CDLL("libcuda.so.1")``), loaded once."""
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
    return _libcuda


def driver_launch() -> Any:
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
            raise ValueError(f"Launcher({name}): unknown argument code in {codes!r}; use p, f, d, i, q")
        self._fptr = function_ptr(kernel, device_index)
        self._types = tuple(_CTYPES[c] for c in codes)
        self._cache: dict[tuple[Any, ...], Any] = {}
        self._launch = driver_launch()
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
        if entry is None:
            self._pack(args)
            entry = self._cache[args]
        params = entry[0]
        try:
            self._launch(self._fptr, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                         shared_mem, stream_ptr, params, 0)
        except Exception as exc:
            retry_or_raise(self, exc, grid, block, params, stream_ptr, shared_mem)
        if recorder is not None:
            recorder.append((self, grid, block, shared_mem, params, entry, None))



class KernelFn:
    """A CuPy ``RawKernel`` with CuPy's call signature, launched through :class:`Launcher`.

    ``fn(grid, block, args, stream=cupy_stream)`` as with the ``RawKernel`` it wraps,
    without CuPy's per-call argument inspection: the argument codes are derived once per
    pattern of argument types (a CuPy array is a pointer; ``numpy.float32`` ``f``,
    ``numpy.float64`` ``d``, ``numpy.int32`` ``i``, ``numpy.int64``/``numpy.uint64`` ``q``), arrays are passed as
    their device pointers, and the packed parameter block of a repeated argument tuple is
    reused (:class:`Launcher`). Any other argument type raises ``TypeError`` at once.
    """

    __slots__ = ("_device_index", "_kernel", "_launchers", "name")

    def __init__(self, kernel: Any, name: str, device_index: int) -> None:
        self._kernel = kernel
        # argument types -> (launcher, positions of the pointer arguments)
        self._launchers: dict[tuple[type, ...], tuple[Launcher, tuple[int, ...]]] = {}
        self._device_index = device_index
        self.name = name

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...], *,
                 stream: Any, shared_mem: int = 0) -> None:
        types = tuple(map(type, args))
        got = self._launchers.get(types)
        if got is None:
            codes = _codes(types, self.name)
            got = self._launchers[types] = (
                Launcher(self._kernel, codes, self.name, self._device_index),
                tuple(i for i, c in enumerate(codes) if c == "p"))
        ln, ptrs = got
        vals = list(args)
        for i in ptrs:
            vals[i] = vals[i].data.ptr
        g = grid if len(grid) == 3 else (*grid, 1, 1)[:3]
        b = block if len(block) == 3 else (*block, 1, 1)[:3]
        ln(g, b, tuple(vals), stream.ptr, shared_mem)  # type: ignore[arg-type]


_ARRAY_TYPES: set[type] = set()
_SCALAR_CODES: dict[type, str] = {}


def _codes(types: tuple[type, ...], name: str) -> str:
    if not _ARRAY_TYPES:
        import cupy
        import numpy as np

        _ARRAY_TYPES.add(cupy.ndarray)
        _SCALAR_CODES.update({np.float32: "f", np.float64: "d", np.int32: "i", np.int64: "q",
                              np.uint64: "q"})
    out = []
    for t in types:
        if t in _ARRAY_TYPES:
            out.append("p")
        elif t in _SCALAR_CODES:
            out.append(_SCALAR_CODES[t])
        else:
            raise TypeError(f"{name}: kernel argument of type {t.__name__} is not supported by the "
                            "fast launcher; pass a CuPy array, numpy.float32, numpy.float64, "
                            "numpy.int32, numpy.int64 or numpy.uint64")
    return "".join(out)


def fast_kernel(kernel: Any, name: str, device_index: int) -> KernelFn:
    """Wrap a CuPy ``RawKernel`` (see :class:`KernelFn`)."""
    return KernelFn(kernel, name, device_index)


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
        import cupy

        major = int(cupy.cuda.Device(device_index).compute_capability[:-1] or 0)
        ok = _pdl_devices[device_index] = major >= 9 and _env.get("DEVICEOPS_PDL") != "0"
    return ok


def launch_pdl(ln: Launcher, grid: tuple[int, int, int], block: tuple[int, int, int],
               args: tuple[Any, ...], stream_ptr: int, smem: int = 0) -> None:
    """``ln(...)`` through ``cuLaunchKernelEx`` with programmatic stream serialization."""
    entry = ln._cache.get(args)
    if entry is None:
        ln._pack(args)
        entry = ln._cache[args]
    launch_packed_pdl(ln, grid, block, smem, stream_ptr, entry)


def launch_plain(ln: Launcher, grid: tuple[int, int, int], block: tuple[int, int, int],
                 args: tuple[Any, ...], stream_ptr: int, smem: int = 0) -> None:
    """``ln(...)`` as a plain launch, with :func:`launch_pdl`'s signature."""
    ln(grid, block, args, stream_ptr, smem)


def launcher_for(device_index: int) -> Callable[..., None]:
    """:func:`launch_pdl` where programmatic dependent launch is on for the device (sm_90+,
    ``DEVICEOPS_PDL`` not ``0``), else :func:`launch_plain`; for kernels that wait for their
    predecessor (``griddepcontrol.wait``) before touching memory."""
    return launch_pdl if pdl_enabled(device_index) else launch_plain


def launch_packed_pdl(ln: Any, grid: tuple[int, int, int], block: tuple[int, int, int], smem: int,
                      stream_ptr: int, entry: tuple[Any, ...]) -> None:
    """As :func:`launch_packed`, through ``cuLaunchKernelEx`` with programmatic stream
    serialization (``ln`` also has ``name`` and ``device_index`` for the error message)."""
    ckey = (grid, block, stream_ptr, smem)
    cfg = _configs.get(ckey)
    if cfg is None:
        cfg = _pdl_config(grid, block, stream_ptr, smem)
        if len(_configs) >= _CACHE_LIMIT:
            del _configs[next(iter(_configs))]
        _configs[ckey] = cfg
    _launch_ex(ln, cfg, entry[0])
    if recorder is not None:
        recorder.append((ln, grid, block, smem, entry[0], entry, cfg))


def retry_or_raise(ln: Any, exc: Exception, grid: tuple[int, int, int], block: tuple[int, int, int],
                   params: int, stream_ptr: int, shared_mem: int) -> None:
    """After a failed plain launch of ``ln`` (``_fptr``, ``name``, ``device_index``): when the
    thread's current context was another device's, make the kernel's device current and launch
    once more; otherwise, or if that fails too, raise :class:`~deviceops.DriverError`."""
    import cupy

    status = getattr(exc, "status", None)
    rt = cupy.cuda.runtime
    if status in (_CUDA_ERROR_INVALID_CONTEXT, _CUDA_ERROR_INVALID_HANDLE) and rt.getDevice() != ln.device_index:
        prev = rt.getDevice()
        rt.setDevice(ln.device_index)
        try:
            driver_launch()(ln._fptr, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                            shared_mem, stream_ptr, params, 0)
            return
        except Exception as again:
            exc = again
        finally:
            rt.setDevice(prev)
    raise DriverError(f"launching {ln.name} (grid {grid}, block {block}) on cuda:{ln.device_index} "
                      f"failed: {exc}", op=ln.name, device=f"cuda:{ln.device_index}") from exc


def launch_packed(ln: Any, grid: tuple[int, int, int], block: tuple[int, int, int], smem: int,
                  stream_ptr: int, entry: tuple[Any, ...]) -> None:
    """The driver call of a launcher that packs its own parameter block.

    ``ln`` has ``_fptr``, ``name`` and ``device_index`` (as :class:`Launcher`); ``entry`` is
    ``(params address, params, holders)``, kept alive by the caller's cache (and by a
    recording, which this call joins like every other launch).
    """
    params = entry[0]
    try:
        (_cu_launch or driver_launch())(ln._fptr, grid[0], grid[1], grid[2], block[0], block[1],
                                         block[2], smem, stream_ptr, params, 0)
    except Exception as exc:
        retry_or_raise(ln, exc, grid, block, params, stream_ptr, smem)
    if recorder is not None:
        recorder.append((ln, grid, block, smem, params, entry, None))


def _pdl_failed(ln: Launcher, rc: int) -> None:
    raise DriverError(f"launching {ln.name} with programmatic dependent launch on "
                      f"cuda:{ln.device_index} failed: CUresult {rc}; set DEVICEOPS_PDL=0 to "
                      "launch without it", op=ln.name, device=f"cuda:{ln.device_index}")


def _launch_ex(ln: Launcher, cfg: tuple[Any, ...], params: int) -> None:
    """The ``cuLaunchKernelEx`` call of a PDL launch (config address, function, parameters)."""
    global _cu_launch_ex
    fn = _cu_launch_ex
    if fn is None:
        fn = _cu_launch_ex = libcuda().cuLaunchKernelEx
        fn.argtypes = [ctypes.c_void_p] * 4
        fn.restype = ctypes.c_int
    rc = fn(ctypes.addressof(cfg[0]), ln._fptr, params, None)
    if rc in (_CUDA_ERROR_INVALID_CONTEXT, _CUDA_ERROR_INVALID_HANDLE):
        # this thread's current context is another device's (a launch outside
        # deviceops.extend.ordered, which makes the stream's device current): make the
        # kernel's device current for the retry, then give the thread its device back
        import cupy

        rt = cupy.cuda.runtime
        prev = rt.getDevice()
        if prev != ln.device_index:
            rt.setDevice(ln.device_index)
            try:
                rc = fn(ctypes.addressof(cfg[0]), ln._fptr, params, None)
            finally:
                rt.setDevice(prev)
    if rc:
        _pdl_failed(ln, rc)


def replay_calls(calls: list[tuple[Any, ...]], stream_ptr: int) -> None:
    """Re-issue recorded launches (see :mod:`._replay`) on the CUDA stream ``stream_ptr``.

    Each call is ``(launcher, grid, block, shared_mem, params, entry, pdl_config)`` as the
    recorder appended it; ``entry`` keeps the parameter block alive. A PDL launch's config
    names the recording's stream, which is this one (records are per stream).
    """
    lk = _cu_launch or driver_launch()
    for ln, g, b, smem, params, _entry, cfg in calls:
        if cfg is None:
            try:
                lk(ln._fptr, g[0], g[1], g[2], b[0], b[1], b[2], smem, stream_ptr, params, 0)
            except Exception as exc:
                retry_or_raise(ln, exc, g, b, params, stream_ptr, smem)
            continue
        _launch_ex(ln, cfg, params)


# (grid, block, stream, shared memory) -> (launch config, its attribute): built once, reused (the driver
# reads them during the call only)
_configs: dict[tuple[Any, ...], tuple[_Config, _Attr]] = {}


def _pdl_config(grid: tuple[int, int, int], block: tuple[int, int, int],
                stream_ptr: int, smem: int = 0) -> tuple[_Config, _Attr]:
    attr = _Attr()
    attr.id = _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmatic_stream_serialization_allowed = 1
    cfg = _Config(grid[0], grid[1], grid[2], block[0], block[1], block[2], smem, stream_ptr,
                  ctypes.pointer(attr), 1)
    return cfg, attr


def max_active_clusters(fn_ptr: int, grid_x: int, block: tuple[int, int, int], smem: int,
                        name: str, device_index: int) -> int:
    """How many clusters of a kernel compiled with ``__cluster_dims__`` fit on the device at
    once (``cuOccupancyMaxActiveClusters``; ``grid_x`` a multiple of the cluster size).

    Raises:
        DriverError: the driver cannot say (the kernel could not be launched either).
    """
    fn = libcuda().cuOccupancyMaxActiveClusters
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    cfg = _Config(grid_x, 1, 1, block[0], block[1], block[2], smem, None, None, 0)
    out = ctypes.c_int(0)
    rc = fn(ctypes.byref(out), ctypes.c_void_p(fn_ptr), ctypes.byref(cfg))
    if rc or out.value < 1:
        raise DriverError(f"{name}: cuOccupancyMaxActiveClusters failed on cuda:{device_index} "
                          f"(CUresult {rc}, {out.value} clusters) for block {block}, {smem} bytes of "
                          "shared memory", op=name, device=f"cuda:{device_index}")  # fmt: skip
    return int(out.value)
