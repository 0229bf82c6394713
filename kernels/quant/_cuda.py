"""The quant family on CUDA: ``quant_gemv.cu`` loading and launches.

One module per (format, activation dtype), compiled by NVRTC with every row count ``MR`` of
:data:`ROW_TILES` named up front (``quant_gemv<F, MR, T>``) and the dequantization kernel
``quant_dequant<F, T>``. Launches go through :class:`..runtime._driver.Launcher` (typed,
cached arguments; recorded and replayed with the op's plan) on the stream handed in; nothing
here allocates or synchronizes (graph-capture safe).

``qmatmul``: one warp per weight row, ``QG_WARPS = 4`` rows a block (grid ``(ceil(N / 4),
ceil(M / MR))``), ``MR`` the smallest of :data:`._plan.ROW_TILES` holding ``M`` (at most 32: more
rows run as ``ceil(M / 32)`` row tiles, each streaming the weight).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from deviceops.extend import bfloat16, float16, float32

from ..runtime._driver import Launcher
from ..runtime._module import expanded_source, load_module
from ._plan import ROW_TILES, QuantFormat, row_tile

__all__ = ["dequantize_cuda", "qmatmul_cuda"]

_SOURCE = "quant/quant_gemv.cu"
_WARPS = 4
_CTYPE = {float32: "float", float16: "f16", bfloat16: "bf16"}
_QF = {"Q4_0": "QF_Q4_0", "Q4_1": "QF_Q4_1", "Q5_0": "QF_Q5_0", "Q8_0": "QF_Q8_0", "Q4_K": "QF_Q4_K",
       "Q6_K": "QF_Q6_K"}

_lock = threading.Lock()
_launchers: dict[tuple[int, str, str, str], Launcher] = {}


def _names(f: QuantFormat, ct: str) -> tuple[str, ...]:
    qf = _QF[f.name]
    return (*(f"quant_gemv<{qf}, {mr}, {ct}>" for mr in ROW_TILES), f"quant_dequant<{qf}, {ct}>")


def _launcher(dev: int, f: QuantFormat, ct: str, expr: str, codes: str) -> Launcher:
    """The launcher of instantiation ``expr`` (its module compiled with all of
    :func:`_names` on first use)."""
    key = (dev, f.name, ct, expr)
    ln = _launchers.get(key)
    if ln is None:
        with _lock:
            ln = _launchers.get(key)
            if ln is None:
                names = _names(f, ct)
                mod = load_module(expanded_source(_SOURCE), options=(f"-DQG_WARPS={_WARPS}",),
                                  device_id=dev, name_expressions=names)
                ln = _launchers[key] = Launcher(mod.get_function(expr), codes, expr, dev)
    return ln


def qmatmul_cuda(dev: int, xa: Any, wa: Any, oa: Any, ba: Any, f: QuantFormat, out_col: int
                 ) -> Callable[[Any], None]:
    """A ``cuda(native_stream)`` launch of ``qmatmul`` (arguments checked by the op)."""
    m, k = (int(s) for s in xa.shape)
    n = int(wa.shape[0])
    mr = row_tile(m)
    ct = _CTYPE[np.dtype(xa.dtype)]
    ln = _launcher(dev, f, ct, f"quant_gemv<{_QF[f.name]}, {mr}, {ct}>", "pqpppiiiiiii")
    x_vec = int(xa.data.ptr % 16 == 0)  # (rows are 64-byte multiples: K % 32 == 0)
    grid = (-(-n // _WARPS), -(-m // mr), 1)
    block = (32 * _WARPS, 1, 1)
    args = (wa.data.ptr, int(wa.strides[0]), xa.data.ptr, oa.data.ptr, oa.data.ptr if ba is None else ba.data.ptr,
            m, n, k, int(oa.shape[1]), out_col, int(ba is not None), x_vec)

    def cuda(native: Any) -> None:
        ln(grid, block, args, native.ptr, 0)

    return cuda


def dequantize_cuda(dev: int, wa: Any, ia: Any, oa: Any, f: QuantFormat, k: int) -> Callable[[Any], None]:
    """A ``cuda(native_stream)`` launch of ``dequantize`` (arguments checked by the op)."""
    n_out = int(oa.size // k)
    kind = 0 if ia is None else (1 if ia.dtype == np.int32 else 2)
    ct = _CTYPE[np.dtype(oa.dtype)]
    ln = _launcher(dev, f, ct, f"quant_dequant<{_QF[f.name]}, {ct}>", "pqpipqqii")
    grid = (max(1, min(n_out, 1 << 20)), 1, 1)
    o_vec = int(oa.data.ptr % 16 == 0)  # (rows are 64-byte multiples: K % 32 == 0)
    args = (wa.data.ptr, int(wa.strides[0]), 0 if ia is None else ia.data.ptr, kind, oa.data.ptr, n_out,
            int(wa.shape[0]), k, o_vec)

    def cuda(native: Any) -> None:
        if n_out > 0:
            ln(grid, (128, 1, 1), args, native.ptr, 0)

    return cuda
