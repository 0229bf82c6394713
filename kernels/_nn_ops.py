"""Neural-network kernels: norms, softmax, activations, embedding lookup, argmax.

CUDA source: ``src/nn_ops.cu``; the ``cpu`` backend runs the NumPy references below
(float64 math, cast once to the output dtype).

| launcher                                     | computes (over the last dim for row ops)              |
|----------------------------------------------|-------------------------------------------------------|
| ``rms_norm(x, weight, *, eps, out)``         | ``x / sqrt(mean(x**2) + eps) * weight``               |
| ``layer_norm(x, weight, bias, *, eps, out)`` | ``(x - mean) / sqrt(var + eps) * weight + bias``      |
| ``softmax(x, *, out)``                       | ``exp(x - max) / sum(exp(x - max))``                  |
| ``gelu(x, *, out)``                          | tanh-approximate GELU (as the GEMM epilogue)          |
| ``silu(x, *, out)``                          | ``x * sigmoid(x)``                                    |
| ``embedding(ids, table, *, out)``            | ``table[ids]``: ``(*ids.shape, D)``                   |
| ``argmax(x, *, out, dtype)``                 | index of the first maximum: ``x.shape[:-1]``          |

Floating inputs are float32, float16 or bfloat16; the CUDA kernels accumulate in float32
and round once on store. Outputs have the input's shape and dtype (argmax: integer
indices; embedding: ``(*ids.shape, D)`` of the table's dtype). ``out`` may be the input
itself (in place) for the row-wise and elementwise ops. A :class:`~deviceops.Partition`
``out`` is accepted and returned as a Partition; these kernels choose their own launch
geometry (one warp or block per row), not the partition's tiles.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from deviceops.extend import (
    FLOATING,
    DTypeError,
    ExecutionContext,
    ShapeError,
    Tensor,
    bfloat16,
    float16,
    float32,
    int32,
    int64,
    launch,
    normalize_dtype,
)

from ._builder import Body, Check, check_out, noop
from ._fastlaunch import fast_kernel
from ._gemm import _act_np
from ._launch import KernelOp
from ._module import expanded_source, load_module
from ._norms import norm_cuda
from ._spec import KernelSpec

__all__ = ["argmax", "embedding", "gelu", "layer_norm", "rms_norm", "silu", "softmax"]

# -- NumPy references (float64 math, cast once) --------------------------------------------


def rms_norm_reference(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` in float64, returned in ``x.dtype``."""
    x64 = x.astype(np.float64)
    inv = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return np.asarray(x64 * inv * weight.astype(np.float64)).astype(x.dtype)


def layer_norm_reference(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None,
                         eps: float) -> np.ndarray:
    """Layer norm over the last dim (biased variance) in float64, returned in ``x.dtype``."""
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=-1, keepdims=True)
    var = ((x64 - mean) ** 2).mean(axis=-1, keepdims=True)
    y = (x64 - mean) / np.sqrt(var + eps) * weight.astype(np.float64)
    if bias is not None:
        y = y + bias.astype(np.float64)
    return np.asarray(y).astype(x.dtype)


def softmax_reference(x: np.ndarray) -> np.ndarray:
    """Softmax over the last dim in float64, returned in ``x.dtype``."""
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=-1, keepdims=True))
    return np.asarray(e / e.sum(axis=-1, keepdims=True)).astype(x.dtype)


def gelu_reference(x: np.ndarray) -> np.ndarray:
    """Tanh-approximate GELU in float64 (the GEMM epilogue's definition), in ``x.dtype``."""
    return np.asarray(_act_np(x.astype(np.float64), "gelu")).astype(x.dtype)


def silu_reference(x: np.ndarray) -> np.ndarray:
    """``x * sigmoid(x)`` in float64, returned in ``x.dtype``."""
    return np.asarray(_act_np(x.astype(np.float64), "silu")).astype(x.dtype)


def embedding_reference(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """``table[clip(ids, 0, V - 1)]``: out-of-range ids are clamped, as the CUDA kernel does."""
    v = table.shape[0]
    return np.asarray(table[np.clip(ids.astype(np.int64), 0, v - 1)])


def argmax_reference(x: np.ndarray, dtype: Any) -> np.ndarray:
    """Index of the first maximum over the last dim (NaN counts as the largest)."""
    return np.asarray(np.argmax(x.astype(np.float64), axis=-1)).astype(dtype)


# -- CUDA module -----------------------------------------------------------------------------

_CTYPE = {float32: "float", float16: "f16", bfloat16: "bf16"}
_ITYPE = {int32: "int", int64: "long long"}
_BITS = {2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}


def _names() -> tuple[str, ...]:
    names = [f"{k}<{c}>" for k in ("layer_norm", "softmax", "gelu", "silu")
             for c in _CTYPE.values()]
    names += [f"argmax<{c}, {i}>" for c in _CTYPE.values() for i in _ITYPE.values()]
    names += [f"embedding<{e}, {i}>" for e in _BITS.values() for i in _ITYPE.values()]
    return tuple(names)


_funcs: dict[tuple[int, str], Any] = {}


def _function(device_index: int, expr: str) -> Any:
    key = (device_index, expr)
    fn = _funcs.get(key)
    if fn is None:
        mod = load_module(expanded_source("nn_ops.cu"), device_id=device_index, name_expressions=_names())
        fn = _funcs[key] = fast_kernel(mod.get_function(expr), expr, device_index)
    return fn


_MAX_BLOCKS = 1 << 20  # blocks stride over the rows / elements beyond this


def _row_geometry(rows: int, cols: int) -> tuple[int, int, int]:
    """(blocks, threads, threads per row): a warp per row up to 1024 columns, else a block."""
    rows = max(rows, 1)  # (no launch happens for 0 rows)
    if cols <= 1024:
        threads = 32 * min(8, rows)
        return min(-(-rows // (threads // 32)), _MAX_BLOCKS), threads, 32
    threads = 512 if cols <= 8192 else 1024
    return min(rows, _MAX_BLOCKS), threads, threads


def _rows_cols(shape: tuple[int, ...]) -> tuple[int, int]:
    return math.prod(shape[:-1]), shape[-1]


def _row_launch(ctx: ExecutionContext, kernel: str, out: Tensor, x: Tensor, extra: tuple[Any, ...],
                tail: tuple[Any, ...]) -> Any:
    """The cuda half of a row-wise launch: ``kernel<T>(out, x, *extra, rows, cols, *tail, tpr)``."""
    rows, cols = _rows_cols(x.shape)
    blocks, threads, tpr = _row_geometry(rows, cols)
    expr = f"{kernel}<{_CTYPE[x.dtype]}>" if kernel != "argmax" else (
        f"argmax<{_CTYPE[x.dtype]}, {_ITYPE[out.dtype]}>")
    fn = _function(ctx.device.index, expr)
    args = (out.array, x.array, *extra, np.int64(rows), np.int32(cols), *tail, np.int32(tpr))

    def cuda(native: Any) -> None:
        if rows > 0:
            fn((blocks,), (threads,), args, stream=native)

    return cuda


# -- checks ----------------------------------------------------------------------------------


def _float_input(name: str, what: str, t: Tensor) -> None:
    if t.dtype not in FLOATING:
        raise DTypeError(f"{name}: {what} has dtype {t.dtype}; supported: float32, float16, bfloat16",
                         op=name)


def _row_input(name: str, x: Tensor) -> None:
    _float_input(name, "x", x)
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ShapeError(f"{name}: x has shape {x.shape}; it needs a last dim >= 1 "
                         "(the op works over the last dim)", op=name)
    if x.shape[-1] > 2**31 - 1:
        raise ShapeError(f"{name}: x rows of {x.shape[-1]} elements are too long", op=name)


def _vector(name: str, what: str, v: Tensor | None, x: Tensor) -> None:
    if v is None:
        return
    d = x.shape[-1]
    if v.shape != (d,):
        raise ShapeError(f"{name}: {what} has shape {v.shape}, expected ({d},) for x {x.shape}", op=name)
    if v.dtype != x.dtype:
        raise DTypeError(f"{name}: {what} has dtype {v.dtype} but x has dtype {x.dtype}; they must match",
                         op=name)


def _eps(name: str, eps: float) -> float:
    if type(eps) is float and 0.0 <= eps < math.inf:
        return eps
    if isinstance(eps, bool) or not isinstance(eps, int | float | np.integer | np.floating):
        raise TypeError(f"{name}: eps must be a real number (a float >= 0), got "
                        f"{type(eps).__name__} {eps!r}")
    e = float(eps)
    if not (math.isfinite(e) and e >= 0.0):
        raise ValueError(f"{name}: eps {eps!r} must be finite and >= 0")
    return e


def _same_as_x(name: str) -> Check:
    def check(ts: Mapping[str, Tensor | None]) -> tuple[tuple[int, ...], np.dtype[Any]]:
        x = ts["x"]
        assert x is not None
        _row_input(name, x)
        check_out(name, ts["out"], x.shape, x.dtype, f"the shape and dtype of x {x.shape} {x.dtype}")
        return x.shape, x.dtype

    return check


# -- norms -----------------------------------------------------------------------------------


def rms_norm(x: Any, weight: Any, *, eps: float = 1e-6, out: Any = None) -> KernelOp:
    """RMS norm over the last dim: ``x / sqrt(mean(x**2) + eps) * weight``.

    Args:
        x: ``(..., D)`` Tensor, Partition or DeviceOp producing one (float32, float16,
            bfloat16; C-contiguous).
        weight: ``(D,)`` of x's dtype.
        eps: added to the mean square (``>= 0``).
        out: optional output of x's shape and dtype (may be ``x``); allocated if ``None``.

    Returns:
        A :class:`KernelOp` producing ``out`` in the form given.

    Raises:
        ShapeError, DTypeError: before any launch.
    """
    return _RMS_NORM.op((x, weight, out), (_eps("rms_norm", eps),))


def _rms_norm_parts(e: float) -> tuple[Check, Body]:
    name = "rms_norm"
    base = _same_as_x(name)

    def check(ts: Mapping[str, Tensor | None]) -> tuple[tuple[int, ...], np.dtype[Any]]:
        res = base(ts)
        x = ts["x"]
        assert x is not None and ts["weight"] is not None
        _vector(name, "weight", ts["weight"], x)
        return res

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        x, w, o = ts["x"], ts["weight"], ts["out"]
        xa, wa, oa = x.array, w.array, o.array

        def cpu() -> None:
            oa[...] = rms_norm_reference(xa, wa, e)

        # cuda: the one-block-per-row kernel shared with add_rms_norm (kernels/_norms.py)
        cuda = norm_cuda(ctx.device.index, oa, xa, wa, e) if not ctx.device.is_cpu else noop
        launch(ctx, name, (x, w), (o,), cpu, cuda)

    return check, body


_RMS_NORM = KernelSpec("rms_norm", ("x", "weight", "out"), _rms_norm_parts, replay=True)


def layer_norm(x: Any, weight: Any, bias: Any = None, *, eps: float = 1e-5, out: Any = None) -> KernelOp:
    """Layer norm over the last dim: ``(x - mean) / sqrt(var + eps) * weight + bias``.

    The variance is the biased (population) one, as in ``torch.nn.LayerNorm``.

    Args:
        x: ``(..., D)`` Tensor, Partition or DeviceOp producing one (float32, float16,
            bfloat16; C-contiguous).
        weight: ``(D,)`` of x's dtype.
        bias: optional ``(D,)`` of x's dtype.
        eps: added to the variance (``>= 0``).
        out: optional output of x's shape and dtype (may be ``x``); allocated if ``None``.

    Returns:
        A :class:`KernelOp` producing ``out`` in the form given.

    Raises:
        ShapeError, DTypeError: before any launch.
    """
    return _LAYER_NORM.op((x, weight, bias, out), (_eps("layer_norm", eps),))


def _layer_norm_parts(e: float) -> tuple[Check, Body]:
    name = "layer_norm"
    base = _same_as_x(name)

    def check(ts: Mapping[str, Tensor | None]) -> tuple[tuple[int, ...], np.dtype[Any]]:
        res = base(ts)
        x = ts["x"]
        assert x is not None and ts["weight"] is not None
        _vector(name, "weight", ts["weight"], x)
        _vector(name, "bias", ts["bias"], x)
        return res

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        x, w, o = ts["x"], ts["weight"], ts["out"]
        b = ts.get("bias")
        xa, wa, oa = x.array, w.array, o.array
        ba = None if b is None else b.array

        def cpu() -> None:
            oa[...] = layer_norm_reference(xa, wa, ba, e)

        cuda: Any = noop
        if not ctx.device.is_cpu:
            cuda = _row_launch(ctx, name, o, x, (wa, wa if ba is None else ba),
                               (np.float32(e), np.int32(ba is not None)))
        launch(ctx, name, (x, w) if b is None else (x, w, b), (o,), cpu, cuda)

    return check, body


_LAYER_NORM = KernelSpec("layer_norm", ("x", "weight", "bias", "out"), _layer_norm_parts,
                         replay=True)


# -- softmax, activations --------------------------------------------------------------------


def softmax(x: Any, *, out: Any = None) -> KernelOp:
    """Softmax over the last dim, ``exp(x - max) / sum(exp(x - max))``.

    Args:
        x: ``(..., D)`` Tensor, Partition or DeviceOp producing one (float32, float16,
            bfloat16; C-contiguous).
        out: optional output of x's shape and dtype (may be ``x``); allocated if ``None``.

    Returns:
        A :class:`KernelOp` producing ``out`` in the form given.

    Raises:
        ShapeError, DTypeError: before any launch.
    """
    return _SOFTMAX.op((x, out))


def _softmax_parts() -> tuple[Check, Body]:
    name = "softmax"

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        x, o = ts["x"], ts["out"]
        xa, oa = x.array, o.array

        def cpu() -> None:
            oa[...] = softmax_reference(xa)

        cuda = _row_launch(ctx, name, o, x, (), ()) if not ctx.device.is_cpu else noop
        launch(ctx, name, (x,), (o,), cpu, cuda)

    return _same_as_x(name), body


_SOFTMAX = KernelSpec("softmax", ("x", "out"), _softmax_parts, replay=True)


def _elementwise_parts(name: str, ref: Any) -> tuple[Check, Body]:
    def check(ts: Mapping[str, Tensor | None]) -> tuple[tuple[int, ...], np.dtype[Any]]:
        xt = ts["x"]
        assert xt is not None
        _float_input(name, "x", xt)
        check_out(name, ts["out"], xt.shape, xt.dtype, f"the shape and dtype of x {xt.shape} {xt.dtype}")
        return xt.shape, xt.dtype

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        xt, o = ts["x"], ts["out"]
        xa, oa = xt.array, o.array

        def cpu() -> None:
            oa[...] = ref(xa)

        cuda: Any = noop
        if not ctx.device.is_cpu:
            n = xt.size
            fn = _function(ctx.device.index, f"{name}<{_CTYPE[xt.dtype]}>")
            blocks = min(max(1, -(-n // 256)), _MAX_BLOCKS)

            def cuda(native: Any) -> None:
                if n > 0:
                    fn((blocks,), (256,), (oa, xa, np.int64(n)), stream=native)

        launch(ctx, name, (xt,), (o,), cpu, cuda)

    return check, body


def gelu(x: Any, *, out: Any = None) -> KernelOp:
    """GELU, **tanh approximation**: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``.

    The same definition as the GEMM epilogue's ``activation="gelu"`` (and torch's
    ``gelu(approximate="tanh")``), not the exact erf form.

    Args:
        x: Tensor, Partition or DeviceOp producing one, any shape (float32, float16,
            bfloat16; C-contiguous).
        out: optional output of x's shape and dtype (may be ``x``); allocated if ``None``.

    Returns:
        A :class:`KernelOp` producing ``out`` in the form given.
    """
    return _GELU.op((x, out))


def silu(x: Any, *, out: Any = None) -> KernelOp:
    """SiLU (swish): ``x * sigmoid(x)``, elementwise.

    Args:
        x: Tensor, Partition or DeviceOp producing one, any shape (float32, float16,
            bfloat16; C-contiguous).
        out: optional output of x's shape and dtype (may be ``x``); allocated if ``None``.

    Returns:
        A :class:`KernelOp` producing ``out`` in the form given.
    """
    return _SILU.op((x, out))


_GELU = KernelSpec("gelu", ("x", "out"), lambda: _elementwise_parts("gelu", gelu_reference),
                   replay=True)
_SILU = KernelSpec("silu", ("x", "out"), lambda: _elementwise_parts("silu", silu_reference),
                   replay=True)


# -- embedding -------------------------------------------------------------------------------


def embedding(ids: Any, table: Any, *, out: Any = None) -> KernelOp:
    """Gather rows of ``table``: ``out[..., :] = table[ids[...], :]``.

    Ids should be in ``[0, V)``. They usually come from the device (a previous
    ``argmax``), so they cannot be checked before launch. An id outside the range is
    **clamped** into it on both backends (a negative id reads row 0, an id ``>= V``
    row ``V - 1``; no wrap-around), so the op never reads outside the table and both
    backends give the same answer. Check ids on the host first when they come from
    untrusted input.

    Args:
        ids: int32 or int64 Tensor (or Partition, or DeviceOp producing one) of any shape.
        table: ``(V, D)`` Tensor of any supported dtype, C-contiguous.
        out: optional ``(*ids.shape, D)`` output of the table's dtype; allocated if ``None``.

    Returns:
        A :class:`KernelOp` producing ``out`` in the form given.

    Raises:
        ShapeError, DTypeError: before any launch.
    """
    return _EMBEDDING.op((ids, table, out))


def _embedding_parts() -> tuple[Check, Body]:
    name = "embedding"

    def check(ts: Mapping[str, Tensor | None]) -> tuple[tuple[int, ...], np.dtype[Any]]:
        it, tt = ts["ids"], ts["table"]
        assert it is not None and tt is not None
        if it.dtype not in (int32, int64):
            raise DTypeError(f"{name}: ids have dtype {it.dtype}; use int32 or int64", op=name)
        if tt.ndim != 2 or min(tt.shape) < 1:
            raise ShapeError(f"{name}: table has shape {tt.shape}; expected (V, D) with V, D >= 1",
                             op=name)
        if tt.shape[1] > 2**31 - 1:
            raise ShapeError(f"{name}: table rows of {tt.shape[1]} elements are too long", op=name)
        oshape = (*it.shape, tt.shape[1])
        check_out(name, ts["out"], oshape, tt.dtype, f"ids {it.shape} gather rows of table {tt.shape}")
        return oshape, tt.dtype

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        it, tt, o = ts["ids"], ts["table"], ts["out"]
        ia, ta, oa = it.array, tt.array, o.array

        def cpu() -> None:
            oa[...] = embedding_reference(ia, ta)

        cuda: Any = noop
        if not ctx.device.is_cpu:
            n_ids, (vocab, dim) = it.size, tt.shape
            expr = f"embedding<{_BITS[tt.dtype.itemsize]}, {_ITYPE[it.dtype]}>"
            fn = _function(ctx.device.index, expr)
            blocks, threads = min(n_ids, _MAX_BLOCKS), min(256, -(-dim // 32) * 32)
            args = (oa, ta, ia, np.int64(n_ids), np.int64(vocab), np.int32(dim))

            def cuda(native: Any) -> None:
                if n_ids > 0:
                    fn((blocks,), (threads,), args, stream=native)

        launch(ctx, name, (it, tt), (o,), cpu, cuda)

    return check, body


_EMBEDDING = KernelSpec("embedding", ("ids", "table", "out"), _embedding_parts, replay=True)


# -- argmax ----------------------------------------------------------------------------------


def argmax(x: Any, *, out: Any = None, dtype: Any = "int32") -> KernelOp:
    """Index of the maximum over the last dim (the first one on ties, as NumPy).

    NaN counts as larger than every number (the first NaN wins), as in NumPy.

    Args:
        x: ``(..., D)`` Tensor, Partition or DeviceOp producing one (float32, float16,
            bfloat16; C-contiguous), ``D >= 1``.
        out: optional int32 or int64 output of shape ``x.shape[:-1]``; its dtype wins
            over ``dtype``. Allocated (of ``dtype``) if ``None``.
        dtype: ``"int32"`` (default) or ``"int64"``, for an allocated output.

    Returns:
        A :class:`KernelOp` producing ``out`` in the form given.

    Raises:
        ShapeError, DTypeError: before any launch.

    Example:
        >>> next_token = kernels.argmax(logits, out=token_buf)   # (1, V) -> (1,)
    """
    if dtype not in ("int32", "int64"):  # (a str static: cheap to hash, unlike a dtype)
        dt = normalize_dtype(dtype, op="argmax")
        if dt not in (int32, int64):
            raise DTypeError(f"argmax: index dtype {dt} must be int32 or int64", op="argmax")
        dtype = dt.name
    return _ARGMAX.op((x, out), (dtype,))


def _argmax_parts(want_name: str) -> tuple[Check, Body]:
    name = "argmax"
    want = np.dtype(want_name)

    def check(ts: Mapping[str, Tensor | None]) -> tuple[tuple[int, ...], np.dtype[Any]]:
        x, o = ts["x"], ts["out"]
        assert x is not None
        _row_input(name, x)
        oshape = x.shape[:-1]
        if o is not None:
            if o.dtype not in (int32, int64):
                raise DTypeError(f"{name}: out has dtype {o.dtype}; use int32 or int64", op=name)
            check_out(name, o, oshape, o.dtype, f"x {x.shape} reduced over its last dim")
            return oshape, o.dtype
        return oshape, want

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        x, o = ts["x"], ts["out"]
        xa, oa, odt = x.array, o.array, o.dtype

        def cpu() -> None:
            oa[...] = argmax_reference(xa, odt)

        cuda = _row_launch(ctx, name, o, x, (), ()) if not ctx.device.is_cpu else noop
        launch(ctx, name, (x,), (o,), cpu, cuda)

    return check, body


_ARGMAX = KernelSpec("argmax", ("x", "out"), _argmax_parts, replay=True)
