"""TMA tensor maps for the sm_90 GEMM kernels, and their launch with packed, cached parameters.

:func:`encode_tiled` builds a 3-D ``CUtensorMap`` (16-bit elements, 128-byte swizzle, zero
fill past the edges) through ``cuTensorMapEncodeTiled``, cached per (pointer, geometry) with
the geometry's argument arrays built once, so a call with fresh pointers (an allocating GEMM,
an eager prefill) costs the driver call only. :class:`TmaLaunch` is the launch of a kernel
whose first parameters are tensor maps passed by value (``gemm_sm90``, ``gemm_skinny_tma``):
its ``kernelParams`` block is packed once per pointer set; on sm_90 it goes out with
programmatic dependent launch (:mod:`._driver`).
"""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict
from typing import Any

from deviceops.extend import ShapeError

from ._driver import launch_packed, launch_packed_pdl, libcuda, pdl_enabled
from ._module import function_ptr

__all__ = ["TmaLaunch", "TmaMap", "encode_tiled"]


class TmaMap(ctypes.Structure):
    """A ``CUtensorMap`` (128 bytes, 64-byte aligned), passed to the kernel by value."""

    _fields_ = [("v", ctypes.c_uint64 * 16)]


_tma_cache: OrderedDict[tuple[int, ...], TmaMap] = OrderedDict()
_encode: Any = None  # cuTensorMapEncodeTiled with its argument types declared
_tma_lock = threading.Lock()
# (dims, strides, box) -> the ctypes arrays the encoder reads (built once per geometry: a
# call with fresh pointers, e.g. an allocating gemm, then costs the driver call only)
_geo_arrays: dict[tuple[Any, ...], tuple[Any, Any, Any]] = {}
_ELEM_STRIDES = (ctypes.c_uint32 * 3)(1, 1, 1)


def _encoder() -> Any:
    global _encode
    if _encode is None:
        fn = libcuda().cuTensorMapEncodeTiled
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int]  # fmt: skip
        _encode = fn
    return _encode


def encode_tiled(ptr: int, dims: tuple[int, int, int], strides: tuple[int, int], box: tuple[int, int, int]) -> TmaMap:
    """A 3-D ``CUtensorMap`` (16-bit elements, 128B swizzle), cached per (pointer, geometry)."""
    key = (ptr, *dims, *strides, *box)
    with _tma_lock:
        hit = _tma_cache.get(key)
        if hit is not None:
            _tma_cache.move_to_end(key)
            return hit
    geo = (dims, strides, box)
    arrs = _geo_arrays.get(geo)
    if arrs is None:
        if len(_geo_arrays) >= 4096:
            _geo_arrays.clear()
        arrs = _geo_arrays[geo] = ((ctypes.c_uint64 * 3)(*dims), (ctypes.c_uint64 * 2)(*strides),
                                   (ctypes.c_uint32 * 3)(*box))  # fmt: skip
    tm = TmaMap()
    res = _encoder()(
        ctypes.addressof(tm),
        1,  # CU_TENSOR_MAP_DATA_TYPE_UINT16 (raw 16-bit elements)
        3,
        ptr,
        ctypes.addressof(arrs[0]), ctypes.addressof(arrs[1]), ctypes.addressof(arrs[2]),
        ctypes.addressof(_ELEM_STRIDES),
        0,  # interleave none
        3,  # swizzle 128B
        2,  # L2 promotion 128B
        0,  # OOB fill zeros
    )  # fmt: skip
    if res != 0:
        raise ShapeError(
            f"gemm: cuTensorMapEncodeTiled failed (CUresult {res}) for dims {dims} strides {strides} box {box}",
            op="gemm",
        )
    with _tma_lock:
        _tma_cache[key] = tm
        if len(_tma_cache) > 512:
            _tma_cache.popitem(last=False)
    return tm


class TmaLaunch:
    """Driver launch of the TMA kernels: tensor maps, three pointers, fixed scalars.

    ``maps``: ``(i, (dims, strides, box))`` per tensor-map argument, ``i`` indexing the pointer
    key ``(a, b, out, bias, workspace)``; the packed ``kernelParams`` block is cached per key.
    """

    __slots__ = ("_cache", "_fptr", "block", "device_index", "grid", "maps", "name", "pdl", "smem", "tail")

    def __init__(self, fn: Any, dev: int, grid: tuple[int, int, int], block: tuple[int, int, int], smem: int,
                 maps: tuple[tuple[int, tuple[Any, ...]], ...], tail: tuple[Any, ...], name: str = "gemm_sm90"
                 ) -> None:
        self._fptr = function_ptr(fn, dev)
        self.device_index, self.grid, self.block, self.smem, self.name = dev, grid, block, smem, name
        self.pdl = pdl_enabled(dev)  # the kernels wait for their predecessor (griddepcontrol.wait)
        self.maps = maps
        self.tail = tail  # ((ctype, value), ...) after the pointers
        self._cache: dict[tuple[int, ...], tuple[int, Any, Any]] = {}

    def _pack(self, key: tuple[int, int, int, int, int]) -> int:
        _, _, op, biasp, wsp = key
        holders: list[Any] = [
            *(encode_tiled(key[i], *geo) for i, geo in self.maps),
            ctypes.c_void_p(op), ctypes.c_void_p(biasp), ctypes.c_void_p(wsp),
            *(t(v) for t, v in self.tail),
        ]  # fmt: skip
        params = (ctypes.c_void_p * len(holders))(*(ctypes.addressof(h) for h in holders))
        if len(self._cache) >= 1024:
            del self._cache[next(iter(self._cache))]
        addr = ctypes.addressof(params)
        self._cache[key] = (addr, params, holders)
        return addr

    def __call__(self, key: tuple[int, int, int, int, int], stream_ptr: int) -> None:
        entry = self._cache.get(key)
        if entry is None:
            self._pack(key)
            entry = self._cache[key]
        (launch_packed_pdl if self.pdl else launch_packed)(self, self.grid, self.block, self.smem, stream_ptr, entry)
