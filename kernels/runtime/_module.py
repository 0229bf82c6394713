"""Compiled-module loading and caching for deviceops kernels.

Kernel sources live in their family's folder (``kernels/gemm/gemm_sm90.cu``), shared
headers in ``kernels/runtime/include``; both are CUDA C++ whose hot instructions
(``mma``, ``wgmma``, ``ldmatrix``, ``cp.async``, TMA, ``mbarrier``) are inline
PTX. They are compiled by NVRTC through CuPy's :class:`cupy.RawModule`.

Caching happens at two levels:

* in-process: one :class:`cupy.RawModule` per (source, options, device
  architecture); repeated calls return the same object, so a kernel launch
  never re-hashes or re-reads a source file;
* across processes: CuPy stores NVRTC output in its on-disk kernel cache
  (``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``) keyed by the source and
  options, so a second process skips compilation.

Nothing here launches work; the families' ``_cuda`` modules do that on the stream they
are handed.
"""

from __future__ import annotations

import functools
import re
import threading
from pathlib import Path
from typing import Any

import deviceops

_ROOT = Path(__file__).resolve().parent.parent  # kernels/
_INCLUDE_DIR = _ROOT / "runtime" / "include"
_lock = threading.Lock()
_modules: dict[tuple[str, tuple[str, ...], str, int], Any] = {}


def source_path(name: str) -> Path:
    """Path of a kernel source: ``"family/file.cu"`` relative to ``kernels/``, or a shared
    header's bare name (``"rows.cuh"``, in ``kernels/runtime/include``)."""
    return _ROOT / name if "/" in name else _INCLUDE_DIR / name


@functools.cache
def read_source(name: str) -> str:
    """Text of a kernel source (see :func:`source_path`), read once per process."""
    path = source_path(name)
    if not path.is_file():
        raise FileNotFoundError(f"deviceops kernel source {name!r} not found at {path}")
    return path.read_text()


_INCLUDE = re.compile(r'^\s*#include\s+"([A-Za-z0-9_]+\.cuh)"\s*$', re.MULTILINE)


def _header(inc: str, family: str) -> str:
    """An ``#include "x.cuh"`` of a source in ``family``: the family's own header, else the
    shared one in ``runtime/include``."""
    own = f"{family}/{inc}"
    return own if source_path(own).is_file() else inc


@functools.cache
def expanded_source(name: str) -> str:
    """Kernel source ``name`` (``"gemm/gemm_sm90.cu"``) with its ``#include "x.cuh"`` lines
    inlined, each header once: the family folder's header if it has one, else
    ``runtime/include``'s.

    NVRTC gets one self-contained text (no include paths), so CuPy's on-disk cache, keyed
    by the text, also sees header edits.
    """
    family = name.split("/", 1)[0]
    seen: set[str] = set()

    def expand(text: str) -> str:
        def inline(m: re.Match[str]) -> str:
            inc = _header(m.group(1), family)
            if inc in seen:
                return ""
            seen.add(inc)
            return expand(read_source(inc))

        return _INCLUDE.sub(inline, text)

    return expand(read_source(name))


def device_arch(device_id: int) -> str:
    """Compute capability of a CUDA device as a string such as ``"90"``."""
    import cupy

    return str(cupy.cuda.Device(device_id).compute_capability)


def load_module(
    source: str,
    *,
    options: tuple[str, ...] = (),
    device_id: int = 0,
    name_expressions: tuple[str, ...] | None = None,
    arch_suffix: str = "",
) -> Any:
    """Compile (or fetch from cache) a :class:`cupy.RawModule` for ``device_id``.

    Args:
        source: CUDA C++ source text.
        options: extra NVRTC options, e.g. ``("-std=c++17",)``.
        device_id: the CUDA device whose architecture to compile for.
        name_expressions: template instantiations to compile, as for
            :class:`cupy.RawModule`.
        arch_suffix: appended to the architecture, e.g. ``"a"`` for
            ``sm_90a`` (needed by ``wgmma`` and ``setmaxnreg``).

    Returns:
        The compiled module. Use ``module.get_function(name)``.
    """
    arch = device_arch(device_id) + arch_suffix
    key = (source, tuple(options) + tuple(name_expressions or ()), arch, device_id)
    mod = _modules.get(key)
    if mod is not None:
        return mod
    with _lock:
        mod = _modules.get(key)
        if mod is not None:
            return mod
        # the CUDA backend compiles (NVRTC, sm_<cc><arch_suffix>, C++17 + options)
        dev = deviceops.device(device_id)
        mod = dev.backend.load_program(dev, source, options=tuple(options),
                                       name_expressions=name_expressions, arch_suffix=arch_suffix)
        _modules[key] = mod
        return mod


def set_max_dynamic_smem(kernel: Any, nbytes: int, device_id: int) -> None:
    """Allow ``kernel`` (a :class:`cupy.RawKernel`) ``nbytes`` of dynamic shared memory on
    CUDA device ``device_id`` (a CuPy kernel loads one function per device: the attribute is
    the function's of the device current when it is set)."""
    key = (id(kernel), device_id)  # (kernels are cached for the process's lifetime)
    if _smem_set.get(key, -1) >= nbytes:
        return
    import cupy

    with cupy.cuda.Device(device_id):
        if kernel.max_dynamic_shared_size_bytes < nbytes:
            kernel.max_dynamic_shared_size_bytes = nbytes
    _smem_set[key] = nbytes


_smem_set: dict[tuple[int, int], int] = {}


def function_ptr(kernel: Any, device_id: int) -> int:
    """The ``CUfunction`` of ``kernel`` (a :class:`cupy.RawKernel`) loaded on CUDA device
    ``device_id`` (CuPy loads a module once per device, on the device current when the
    function is first asked for: a handle of another device fails to launch there)."""
    import cupy

    with cupy.cuda.Device(device_id):
        return int(kernel.kernel.ptr)
