"""Quantized-weight kernels as DeviceOps: ``qmatmul`` and ``dequantize``.

| launcher                                                        | computes                                        |
|-----------------------------------------------------------------|-------------------------------------------------|
| ``qmatmul(x, w, out=None, *, fmt, bias=None, out_col=0)``       | ``out[:, c:c+N] = x @ dequant(w).T (+ bias)``    |
| ``dequantize(w, ids=None, out=None, *, fmt, k, dtype)``         | ``dequant(w)`` ``(N, K)``, or its rows ``ids``   |

``w`` is a quantized ``(N, K)`` weight in its GGUF block format, packed as
:mod:`._plan` describes (int32 ``(N, W)``: each row's block bytes padded to 16 bytes).
The ``cpu`` backend dequantizes with NumPy (float32 copies cached, :mod:`._cpu`) and multiplies
with BLAS; the reference mode runs the float64 references of :mod:`._reference`; CUDA runs
``quant_gemv.cu`` (:mod:`._cuda`).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from deviceops.extend import ExecutionContext, Tensor, launch, normalize_dtype

from ..runtime._builder import OPTIONAL_ARGS, Body, Check, noop
from ..runtime._cpu import reference_mode
from ..runtime._op import KernelOp
from ..runtime._spec import KernelSpec
from ._check import check_dequantize, check_qmatmul
from ._cpu import dequant_cache, dequantize_blocks, dequantize_cpu, qmatmul_cpu
from ._cuda import dequantize_cuda, qmatmul_cuda
from ._plan import get_format, unpack
from ._reference import dequantize_reference, qmatmul_reference

__all__ = ["dequantize", "qmatmul"]


def qmatmul(x: Any, w: Any, out: Any = None, *, fmt: str, bias: Any = None, out_col: int = 0) -> KernelOp:
    """``out[:, out_col:out_col + N] = x @ dequant(w).T + bias``: a Linear layer whose weight
    stays in its GGUF block format.

    Args:
        x: ``(M, K)`` float32, float16 or bfloat16 (Tensor, Partition or DeviceOp producing
            one), C-contiguous. Any ``M >= 1``; the CUDA kernel is made for ``M <= 32``
            (decode): larger ``M`` runs it once per 32 rows, streaming the weight each time
            (prefill is faster through :func:`dequantize` and ``gemm``).
        w: the quantized ``(N, K)`` weight, int32 ``(N, W)`` as :func:`.pack` makes it.
        out: ``(M, N_out)`` of x's dtype with ``N_out >= out_col + N`` (columns outside
            ``[out_col, out_col + N)`` are left as they are: several weights of different
            formats fill one fused output); allocated ``(M, N)`` when ``None``.
        fmt: the weight's format: ``"Q4_0"``, ``"Q4_1"``, ``"Q5_0"``, ``"Q8_0"``, ``"Q4_K"``
            or ``"Q6_K"``.
        bias: optional ``(N,)`` of x's dtype.
        out_col: the first column of ``out`` written.

    Returns:
        A :class:`KernelOp` producing ``out``.

    Raises:
        ValueError: an unknown format or a negative ``out_col``.
        ShapeError, DTypeError: arguments that do not fit (K not a multiple of the block,
            a weight not packed for this K, ...); before any launch.

    Example:
        >>> wq = api.from_host(quant.pack(gguf_tensor.data, "Q4_K")).sync()
        >>> y = kernels.qmatmul(x, wq, fmt="Q4_K").sync()
    """
    get_format(fmt, "qmatmul")
    out_col = int(out_col)
    if out_col < 0:
        raise ValueError(f"qmatmul: out_col={out_col} must be >= 0")
    return _QMATMUL.op((x, w, out, bias), (fmt, out_col))


def _qmatmul_parts(fmt: str, out_col: int) -> tuple[Check, Body]:
    name = "qmatmul"
    f = get_format(fmt, name)

    def check(ts: Mapping[str, Tensor | None]) -> tuple[tuple[int, ...], np.dtype[Any]]:
        x, w = ts["x"], ts["w"]
        assert x is not None and w is not None
        return check_qmatmul(name, x, w, ts["out"], ts["bias"], f, out_col)

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        x, w, o = ts["x"], ts["w"], ts["out"]
        b = ts.get("bias")
        xa, wa, oa = x.array, w.array, o.array
        ba = None if b is None else b.array
        reads = [x, w] + ([b] if b is not None else [])
        k = int(x.shape[1])

        if reference_mode():
            def cpu() -> None:
                n = wa.shape[0]
                oa[:, out_col:out_col + n] = qmatmul_reference(xa, wa, fmt, bias=ba)
        else:
            wref, ver = weakref.ref(w._storage), w._storage.ver

            def convert(a: np.ndarray) -> np.ndarray:
                return dequantize_blocks(unpack(a, fmt, k), f)

            def cpu() -> None:  # (the write count read when the task runs: replays too)
                qmatmul_cpu(xa, wa, oa, f, out_col, ba, dequant_cache.get(wref(), ver[0], wa, convert))

        cuda = noop if ctx.device.is_cpu else qmatmul_cuda(ctx.device.index, xa, wa, oa, ba, f, out_col)
        launch(ctx, name, reads, [o], cpu, cuda)

    return check, body


_QMATMUL = KernelSpec("qmatmul", ("x", "w", "out", "bias"), _qmatmul_parts, replay=True)


def dequantize(w: Any, ids: Any = None, out: Any = None, *, fmt: str, k: int,
               dtype: Any = "float16") -> KernelOp:
    """The quantized weight ``w`` as a float matrix ``(N, K)``, or its rows ``ids``
    (``(*ids.shape, K)``: an embedding lookup of a quantized table).

    Args:
        w: the packed ``(N, W)`` int32 weight (:func:`.pack`).
        ids: optional int32/int64 row ids of any shape; out-of-range ids are clamped into
            ``[0, N)``, as :func:`deviceops.kernels.embedding` does.
        out: optional output (float32, float16 or bfloat16; its dtype wins over ``dtype``);
            allocated when ``None``.
        fmt: the weight's format (see :func:`qmatmul`).
        k: ``K``, the weight's columns (a multiple of the format's block).
        dtype: the allocated output's dtype.

    Returns:
        A :class:`KernelOp` producing ``out``.

    Raises:
        ValueError: an unknown format.
        ShapeError, DTypeError: before any launch.
    """
    get_format(fmt, "dequantize")
    dt = normalize_dtype(dtype, op="dequantize").name
    return _DEQUANTIZE.op((w, ids, out), (fmt, int(k), dt))


def _dequantize_parts(fmt: str, k: int, dtype: str) -> tuple[Check, Body]:
    name = "dequantize"
    f = get_format(fmt, name)
    want = np.dtype(normalize_dtype(dtype, op=name))

    def check(ts: Mapping[str, Tensor | None]) -> tuple[tuple[int, ...], np.dtype[Any]]:
        w = ts["w"]
        assert w is not None
        return check_dequantize(name, w, ts["ids"], ts["out"], f, k, want)

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        w, o = ts["w"], ts["out"]
        ids = ts.get("ids")
        wa, oa = w.array, o.array
        ia = None if ids is None else ids.array

        def cpu() -> None:
            if reference_mode():
                full = dequantize_reference(wa, fmt, k)
                rows = full if ia is None else full[np.clip(ia.astype(np.int64), 0, wa.shape[0] - 1)]
                oa[...] = rows.astype(oa.dtype)
            else:
                oa[...] = dequantize_cpu(wa, f, k, ia).astype(oa.dtype)

        cuda = noop if ctx.device.is_cpu else dequantize_cuda(ctx.device.index, wa, ia, oa, f, k)
        launch(ctx, name, [w] + ([ids] if ids is not None else []), [o], cpu, cuda)

    return check, body


_DEQUANTIZE = KernelSpec("dequantize", ("w", "ids", "out"), _dequantize_parts,
                         optional=(*OPTIONAL_ARGS, "ids"), replay=True)
