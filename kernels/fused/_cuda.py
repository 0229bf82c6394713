"""The fused decode kernel on CUDA: compiling ``fused_decode.cu`` (one instantiation per
dtype, row tiles and head dim) and its cooperative launch.

A cooperative launch (``cuLaunchCooperativeKernel``, through CuPy) guarantees that every
block of the grid is resident at once, which the kernel's grid-wide barriers need; the grid
is one block per SM and the launch checks that one block fits on an SM with its shared
memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deviceops.extend import DriverError, Tensor

from ..runtime._module import expanded_source, load_module, set_max_dynamic_smem

if TYPE_CHECKING:
    from .op import FusedDecodeModel

__all__ = ["launch_fused"]

_SOURCE = "fused/fused_decode.cu"
_CTYPE = {"float16": "f16", "bfloat16": "bf16"}
_funcs: dict[tuple[int, str, int, int], Any] = {}


def _function(device_index: int, ctype: str, nt: int, hd: int) -> Any:
    key = (device_index, ctype, nt, hd)
    fn = _funcs.get(key)
    if fn is None:
        names = tuple(f"fused_decode<{ctype}, {n}, {hd}>" for n in (1, 2, 4))
        mod = load_module(expanded_source(_SOURCE), device_id=device_index, name_expressions=names)
        fn = _funcs[key] = mod.get_function(f"fused_decode<{ctype}, {nt}, {hd}>")
    return fn


def launch_fused(m: FusedDecodeModel, b: int, params: Tensor, native: Any) -> None:
    """Launch one step over ``b`` rows on the CuPy stream ``native``."""
    from .op import _THREADS, _n_tiles

    idx = m.device.index
    nt = _n_tiles(b)
    fn = _function(idx, _CTYPE[m.dtype.name], nt, m.head_dim)
    smem = m.smem_bytes(b)
    set_max_dynamic_smem(fn, smem, idx)
    try:
        # (the RawKernel's own call fixes enable_cooperative_groups to its module's flag: call
        # its CUDA function, the device's, directly)
        fn.kernel((m.blocks, 1, 1), (_THREADS, 1, 1), (params.array,), shared_mem=smem,
                  stream=native, enable_cooperative_groups=True)
    except Exception as exc:
        raise DriverError(f"fused_decode: the cooperative launch of {m.blocks} blocks x {_THREADS} "
                          f"threads with {smem} bytes of shared memory failed on "
                          f"cuda:{idx}: {exc}", op="fused_decode", device=f"cuda:{idx}") from exc
