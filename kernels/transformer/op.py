"""Rotary embedding, KV-cache write and head merge as DeviceOps.

CUDA source: ``transformer.cu`` (loaded by :mod:`._cuda`; float32 math, one rounding on
store, 16-byte accesses where the row length and the pointers allow); the ``cpu`` backend
runs the float32 paths of :mod:`._cpu` (the float64 references of :mod:`._reference` in the
reference mode; tests compare with them). Argument checks: :mod:`._check`.

| launcher                                                     | computes                                        |
|--------------------------------------------------------------|-------------------------------------------------|
| ``rope(x, start, *, theta, out)``                            | Llama "rotate half" RoPE of ``(B, L, H, D)``    |
| ``rope_kv_write(qkv, start, k_cache, v_cache, *, n_heads,`` | split ``(B, L, (Hq + 2 Hkv) D)``; RoPE(q) to    |
| ``n_kv_heads, theta, q_out, block_table)``                   | ``q_out``; RoPE(k), v into the caches at        |
|                                                              | positions ``start[b] + i`` (paged: block table) |
| ``merge_heads(x, *, out)``                                   | ``(B, H, L, D) -> (B, L, H * D)``               |
| ``split_qkv(qkv, *, n_heads, n_kv_heads, q_out, k_out,``     | ``(B, L, (Hq + 2 Hkv) D)`` -> q ``(B, Hq, L, D)``, |
| ``v_out)``                                                   | k, v ``(B, Hkv, L, D)`` (no RoPE, no cache)     |
| ``qk_rms_norm(qkv, q_weight, k_weight, *, n_heads,``         | in place: RMSNorm of every q and k head of      |
| ``n_kv_heads, eps)``                                         | ``(..., (Hq + 2 Hkv) D)`` (Gemma 3's q/k norm)  |

Positions live in device memory (``start``, int32 ``(B,)``), so one captured CUDA graph
serves every decode step. Floating tensors are float32, float16 or bfloat16, C-contiguous.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from deviceops.extend import DTypeError, ExecutionContext, ShapeError, Tensor, launch

from ..runtime._builder import Body, check_out, noop
from ..runtime._checks import MultiCheck, Outputs, distinct, floating, same
from ..runtime._cpu import reference_mode
from ..runtime._op import KernelOp
from ..runtime._rows import CTYPE, MOVE_TYPES, THREADS, grid, vec_width
from ..runtime._spec import KernelSpec
from ._check import _block_table, _start, _theta
from ._cpu import qk_rms_norm_cpu, rope_cpu, rope_kv_write_cpu
from ._cuda import function
from ._reference import (
    merge_heads_reference,
    qk_rms_norm_reference,
    rope_kv_write_reference,
    rope_reference,
    split_qkv_reference,
)

__all__ = ["merge_heads", "qk_rms_norm", "rope", "rope_kv_write", "split_qkv"]

def rope(x: Any, start: Any, *, theta: float = 10000.0, out: Any = None) -> KernelOp:
    """Rotary position embedding, Llama "rotate half" convention.

    Token ``(b, i)`` sits at position ``pos = start[b] + i``. For ``j < D/2`` and
    ``a = pos * theta**(-2j/D)``: ``out[j] = x[j] cos a - x[j + D/2] sin a`` and
    ``out[j + D/2] = x[j + D/2] cos a + x[j] sin a``. The CUDA kernel forms the angle in
    float64 (reduced modulo 2 pi) and rotates in float32.

    Args:
        x: ``(B, L, H, D)`` Tensor, Partition or DeviceOp producing one (float32, float16,
            bfloat16; C-contiguous), ``D`` even.
        start: int32 ``(B,)`` in device memory (any values, negative included).
        theta: the RoPE base (``> 1``).
        out: optional output of x's shape and dtype; may be ``x`` (in place). Allocated if
            ``None``.

    Returns:
        A :class:`KernelOp` producing ``out`` in the form given.

    Raises:
        ShapeError, DTypeError, ValueError: before any launch.
    """
    return _ROPE.op((x, start, out), (_theta("rope", theta),))


def _rope_parts(th: float) -> tuple[MultiCheck, Body]:
    name = "rope"

    def check(ts: Mapping[str, Tensor | None]) -> Outputs:
        xt, st = ts["x"], ts["start"]
        assert xt is not None and st is not None
        floating(name, "x", xt)
        if xt.ndim != 4 or xt.shape[-1] % 2 or xt.shape[-1] < 2:
            raise ShapeError(f"{name}: x has shape {xt.shape}; expected (B, L, H, D) with D even",
                             op=name)
        _start(name, st, xt.shape[0], f"x {xt.shape}")
        check_out(name, ts["out"], xt.shape, xt.dtype, f"the shape and dtype of x {xt.shape} {xt.dtype}")
        return {"out": (xt.shape, xt.dtype)}

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        xt, st, o = ts["x"], ts["start"], ts["out"]
        xa, sa, oa = xt.array, st.array, o.array

        if reference_mode():
            def cpu() -> None:
                oa[...] = rope_reference(xa, sa, th)
        else:
            def cpu() -> None:
                rope_cpu(xa, sa, th, oa)

        cuda: Any = noop
        if not ctx.device.is_cpu:
            b, length, h, d = xt.shape
            vec = vec_width(xt.dtype, d // 2, (xa, oa))
            units = b * length * h * (d // 2 // vec)
            fn = function(ctx.device.index, f"rope<{CTYPE[xt.dtype]}, {vec}>")
            args = (oa, xa, sa, np.int64(units), np.int32(length), np.int32(h), np.int32(d),
                    np.float64(math.log2(th)))
            blocks = grid(units)

            def cuda(native: Any) -> None:
                if units > 0:
                    fn((blocks,), (THREADS,), args, stream=native)

        launch(ctx, name, (xt, st), (o,), cpu, cuda)

    return check, body


_ROPE = KernelSpec("rope", ("x", "start", "out"), _rope_parts, outputs=True, replay=True)


def rope_kv_write(qkv: Any, start: Any, k_cache: Any, v_cache: Any, *, n_heads: int,
                  n_kv_heads: int, theta: float = 10000.0, q_out: Any = None,
                  block_table: Any = None) -> KernelOp:
    """Split a fused QKV projection, rotate q and k, write k and v into a KV cache.

    ``qkv`` holds, for each token, ``n_heads`` q heads, then ``n_kv_heads`` k heads, then
    ``n_kv_heads`` v heads of ``D = qkv.shape[-1] / (n_heads + 2 n_kv_heads)`` elements.
    Token ``(b, i)`` is at position ``pos = start[b] + i`` (see :func:`rope`): RoPE(q) goes
    to ``q_out[b, :, i]``, RoPE(k) to ``k_cache[b, :, pos]`` and v to ``v_cache[b, :, pos]``.
    **A position outside** ``[0, S)`` **is skipped** (nothing is written to the caches for
    that token; its q is still written), so a finished row of a batch cannot write out of
    bounds. One kernel launch does all of it.

    **Paged cache** (``block_table`` given, flash_attention's paged layout): the caches are
    a block pool ``(num_blocks, n_kv_heads, block_size, D)`` and ``block_table`` int32
    ``(B, max_blocks)`` in device memory maps row ``b``'s position ``pos`` to
    ``k_cache[block_table[b, pos // block_size], :, pos % block_size]``. Skipped (as
    above): ``pos`` outside ``[0, max_blocks * block_size)``, and a block id outside
    ``[0, num_blocks)`` (``-1`` marks a block not allocated). The table is read on the
    device only, so one captured graph serves any allocation.

    Args:
        qkv: ``(B, L, (n_heads + 2 n_kv_heads) * D)`` (float32, float16, bfloat16), D even.
        start: int32 ``(B,)`` in device memory.
        k_cache, v_cache: ``(B, n_kv_heads, S, D)`` of qkv's dtype (flash_attention's k/v
            layout); with ``block_table``, ``(num_blocks, n_kv_heads, block_size, D)``;
            written in place.
        n_heads, n_kv_heads: query and key/value head counts (``n_heads % n_kv_heads == 0``).
        theta: the RoPE base (``> 1``).
        q_out: optional ``(B, n_heads, L, D)`` of qkv's dtype; allocated if ``None``.
        block_table: optional int32 ``(B, max_blocks)`` (``max_blocks >= 1``): paged cache.

    Returns:
        A :class:`KernelOp` producing ``q_out`` in the form given.

    Raises:
        ShapeError, DTypeError, ValueError: before any launch.
    """
    name, th = "rope_kv_write", _theta("rope_kv_write", theta)
    hq, hkv = int(n_heads), int(n_kv_heads)
    if hq < 1 or hkv < 1 or hq % hkv:
        raise ValueError(f"{name}: n_heads={n_heads}, n_kv_heads={n_kv_heads}: both must be >= 1 "
                         "and n_heads a multiple of n_kv_heads")
    return _ROPE_KV_WRITE.op((qkv, start, k_cache, v_cache, q_out, block_table), (th, hq, hkv))


def _rope_kv_write_parts(th: float, hq: int, hkv: int) -> tuple[MultiCheck, Body]:
    name = "rope_kv_write"

    def check(ts: Mapping[str, Tensor | None]) -> Outputs:
        qt, st, kc, vc = ts["qkv"], ts["start"], ts["k_cache"], ts["v_cache"]
        bt = ts["block_table"]
        assert qt is not None and st is not None and kc is not None and vc is not None
        floating(name, "qkv", qt)
        nh = hq + 2 * hkv
        if qt.ndim != 3 or qt.shape[-1] % nh or (qt.shape[-1] // nh) % 2 or qt.shape[-1] == 0:
            raise ShapeError(
                f"{name}: qkv has shape {qt.shape}; expected (B, L, (n_heads + 2 n_kv_heads) * D) "
                f"= (B, L, {nh} * D) with D even (n_heads={hq}, n_kv_heads={hkv})", op=name)
        b, length, w = qt.shape
        d = w // nh
        _start(name, st, b, f"qkv {qt.shape}")
        if bt is not None:
            _block_table(name, bt, b, kc, hkv, d, qt.shape)
        elif kc.ndim != 4 or kc.shape[0] != b or kc.shape[1] != hkv or kc.shape[3] != d:
            raise ShapeError(f"{name}: k_cache has shape {kc.shape}, expected ({b}, {hkv}, S, {d}) "
                             f"for qkv {qt.shape} with n_kv_heads={hkv}", op=name)
        same(name, "k_cache", kc, kc.shape, qt.dtype, f"the dtype of qkv {qt.dtype}")
        same(name, "v_cache", vc, kc.shape, qt.dtype, f"k_cache is {kc.shape} {kc.dtype}")
        oshape = (b, hq, length, d)
        if ts["q_out"] is not None:
            same(name, "q_out", ts["q_out"], oshape, qt.dtype, f"q heads of qkv {qt.shape} as (B, Hq, L, D)")
        distinct(name, ts, (("k_cache", "v_cache"), ("q_out", "qkv"), ("k_cache", "qkv"),
                             ("v_cache", "qkv"), ("q_out", "k_cache"), ("q_out", "v_cache"),
                             ("block_table", "k_cache"), ("block_table", "v_cache"),
                             ("block_table", "q_out")),
                  "use separate tensors")
        return {"q_out": (oshape, qt.dtype)}

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        qt, st, kc, vc, qo = ts["qkv"], ts["start"], ts["k_cache"], ts["v_cache"], ts["q_out"]
        qa, sa, ka, va, oa = qt.array, st.array, kc.array, vc.array, qo.array
        bt = ts.get("block_table")
        ba = None if bt is None else bt.array

        if reference_mode():
            def cpu() -> None:
                rope_kv_write_reference(qa, sa, ka, va, oa, hq, hkv, th, ba)
        else:
            def cpu() -> None:
                rope_kv_write_cpu(qa, sa, ka, va, oa, hq, hkv, th, ba)

        cuda: Any = noop
        if not ctx.device.is_cpu:
            b, length, w = qt.shape
            d = w // (hq + 2 * hkv)
            vec = vec_width(qt.dtype, d // 2, (qa, ka, va, oa))
            n_tok = b * length
            units = n_tok * ((hq + hkv) * (d // 2 // vec) + hkv * (d // vec))
            fn = function(ctx.device.index, f"rope_kv_write<{CTYPE[qt.dtype]}, {vec}>")
            if ba is None:
                paged: tuple[Any, ...] = (np.uint64(0), np.int32(0), np.int64(0))
            else:
                paged = (ba, np.int32(ba.shape[1]), np.int64(kc.shape[0]))
            args = (oa, ka, va, qa, sa, np.int64(n_tok), np.int32(length), np.int32(hq),
                    np.int32(hkv), np.int32(d), np.int64(kc.shape[2]), np.float64(math.log2(th)),
                    *paged)
            blocks = grid(units)

            def cuda(native: Any) -> None:
                if units > 0:
                    fn((blocks,), (THREADS,), args, stream=native)

        reads = (qt, st) if bt is None else (qt, st, bt)
        launch(ctx, name, reads, (qo, kc, vc), cpu, cuda)

    return check, body


_ROPE_KV_WRITE = KernelSpec(
    "rope_kv_write", ("qkv", "start", "k_cache", "v_cache", "q_out", "block_table"),
    _rope_kv_write_parts, returns="q_out", outputs=True, replay=True)


def merge_heads(x: Any, *, out: Any = None) -> KernelOp:
    """Attention output back to rows: ``(B, H, L, D) -> (B, L, H * D)``.

    ``out[b, l, h * D + d] = x[b, h, l, d]`` (a copy; any dtype of the library).

    Args:
        x: ``(B, H, L, D)`` Tensor, Partition or DeviceOp producing one, C-contiguous.
        out: optional ``(B, L, H * D)`` of x's dtype, not sharing memory with x; allocated
            if ``None``.

    Returns:
        A :class:`KernelOp` producing ``out`` in the form given.

    Raises:
        ShapeError, DTypeError: before any launch.
    """
    return _MERGE_HEADS.op((x, out))


def _merge_heads_parts() -> tuple[MultiCheck, Body]:
    name = "merge_heads"

    def check(ts: Mapping[str, Tensor | None]) -> Outputs:
        xt = ts["x"]
        assert xt is not None
        if xt.ndim != 4:
            raise ShapeError(f"{name}: x has shape {xt.shape}; expected (B, H, L, D)", op=name)
        b, h, length, d = xt.shape
        oshape = (b, length, h * d)
        check_out(name, ts["out"], oshape, xt.dtype, f"x {xt.shape} as (B, L, H * D)")
        distinct(name, ts, (("out", "x"),), "merge_heads cannot run in place")
        return {"out": (oshape, xt.dtype)}

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        xt, o = ts["x"], ts["out"]
        xa, oa = xt.array, o.array

        def cpu() -> None:
            oa[...] = merge_heads_reference(xa)

        cuda: Any = noop
        if not ctx.device.is_cpu:
            b, h, length, d = xt.shape
            row = d * xt.dtype.itemsize
            unit = next(u for u in (16, 8, 4, 2, 1)
                        if row % u == 0 and xa.data.ptr % u == 0 and oa.data.ptr % u == 0)
            if unit == 1:  # (no 1-byte dtype in the library)
                raise DTypeError(f"{name}: dtype {xt.dtype} is not supported on cuda", op=name)
            dv = row // unit
            units = b * h * length * dv
            fn = function(ctx.device.index, f"merge_heads<{MOVE_TYPES[unit]}>")
            args = (oa, xa, np.int64(units), np.int32(h), np.int32(length), np.int32(dv))
            blocks = grid(units)

            def cuda(native: Any) -> None:
                if units > 0:
                    fn((blocks,), (THREADS,), args, stream=native)

        launch(ctx, name, (xt,), (o,), cpu, cuda)

    return check, body


_MERGE_HEADS = KernelSpec("merge_heads", ("x", "out"), _merge_heads_parts, outputs=True,
                          replay=True)


def split_qkv(qkv: Any, *, n_heads: int, n_kv_heads: int | None = None, q_out: Any = None,
              k_out: Any = None, v_out: Any = None) -> KernelOp:
    """A fused QKV projection split into attention's head-major layout (a copy, no RoPE).

    ``qkv[b, l]`` holds ``n_heads`` query heads, then ``n_kv_heads`` key heads, then
    ``n_kv_heads`` value heads, each ``D`` wide: ``q_out[b, h, l] = qkv[b, l, h*D:(h+1)*D]``
    and likewise for ``k_out`` and ``v_out``. It is what an encoder (no positions rotated,
    no cache) feeds :func:`~deviceops.kernels.flash_attention`; decoders use
    :func:`rope_kv_write`.

    Args:
        qkv: ``(B, L, (Hq + 2 Hkv) D)`` Tensor, Partition or DeviceOp producing one,
            C-contiguous, any dtype of the library.
        n_heads: ``Hq`` (a positive int).
        n_kv_heads: ``Hkv`` (a positive int; ``None``: ``n_heads``).
        q_out: optional ``(B, Hq, L, D)`` of qkv's dtype; allocated if ``None``.
        k_out, v_out: optional ``(B, Hkv, L, D)`` of qkv's dtype; allocated if ``None``.
            No output may share memory with ``qkv`` or with another output.

    Returns:
        A :class:`KernelOp` producing ``(q_out, k_out, v_out)`` in the forms given.

    Raises:
        ValueError: a head count that is not a positive int (at the call).
        ShapeError, DTypeError: before any launch (the message names the shapes).

    Example:
        >>> q, k, v = kernels.split_qkv(qkv, n_heads=12).sync()   # qkv (B, L, 3 * 12 * 32)
    """
    hkv = n_heads if n_kv_heads is None else n_kv_heads
    for what, n in (("n_heads", n_heads), ("n_kv_heads", hkv)):
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
            raise ValueError(f"split_qkv: {what}={n!r} must be a positive int")
    return _SPLIT_QKV.op((qkv, q_out, k_out, v_out), (int(n_heads), int(hkv)))


def _split_qkv_parts(hq: int, hkv: int) -> tuple[MultiCheck, Body]:
    name = "split_qkv"

    def check(ts: Mapping[str, Tensor | None]) -> Outputs:
        xt = ts["qkv"]
        assert xt is not None
        heads = hq + 2 * hkv
        if xt.ndim != 3 or xt.shape[-1] % heads or xt.shape[-1] == 0:
            raise ShapeError(f"{name}: qkv has shape {xt.shape}; expected (B, L, (Hq + 2 Hkv) D) "
                             f"with Hq={hq}, Hkv={hkv}: a last dim that is a positive multiple of "
                             f"{heads}", op=name)
        b, length, width = xt.shape
        d = width // heads
        shapes = {"q_out": (b, hq, length, d), "k_out": (b, hkv, length, d),
                  "v_out": (b, hkv, length, d)}
        for k, shape in shapes.items():
            t = ts[k]
            if t is not None and (t.shape != shape or t.dtype != xt.dtype):
                raise (ShapeError if t.shape != shape else DTypeError)(
                    f"{name}: {k} is {t.shape} {t.dtype}, expected {shape} {xt.dtype} (qkv "
                    f"{xt.shape} split into {hq} query and {hkv} key/value heads of {d})", op=name)
        distinct(name, ts, (("q_out", "qkv"), ("k_out", "qkv"), ("v_out", "qkv"),
                            ("q_out", "k_out"), ("q_out", "v_out"), ("k_out", "v_out")),
                 "split_qkv writes each output to its own tensor")
        return {k: (shape, xt.dtype) for k, shape in shapes.items()}

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        xt, qt, kt, vt = ts["qkv"], ts["q_out"], ts["k_out"], ts["v_out"]
        xa, qa, ka, va = xt.array, qt.array, kt.array, vt.array

        def cpu() -> None:
            q, k, v = split_qkv_reference(xa, hq, hkv)
            qa[...], ka[...], va[...] = q, k, v

        cuda: Any = noop
        if not ctx.device.is_cpu:
            b, length, width = xt.shape
            row = width // (hq + 2 * hkv) * xt.dtype.itemsize
            ptrs = (xa.data.ptr, qa.data.ptr, ka.data.ptr, va.data.ptr)
            unit = next(u for u in (16, 8, 4, 2, 1) if row % u == 0 and all(p % u == 0 for p in ptrs))
            if unit == 1:  # (no 1-byte dtype in the library)
                raise DTypeError(f"{name}: dtype {xt.dtype} is not supported on cuda", op=name)
            dv = row // unit
            units = b * length * (hq + 2 * hkv) * dv
            fn = function(ctx.device.index, f"split_qkv<{MOVE_TYPES[unit]}>")
            args = (qa, ka, va, xa, np.int64(units), np.int32(hq), np.int32(hkv),
                    np.int32(length), np.int32(dv))
            blocks = grid(units)

            def cuda(native: Any) -> None:
                if units > 0:
                    fn((blocks,), (THREADS,), args, stream=native)

        launch(ctx, name, (xt,), (qt, kt, vt), cpu, cuda)

    return check, body


_SPLIT_QKV = KernelSpec("split_qkv", ("qkv", "q_out", "k_out", "v_out"), _split_qkv_parts,
                        returns=lambda v: (v["q_out"], v["k_out"], v["v_out"]), outputs=True,
                        replay=True)


def qk_rms_norm(qkv: Any, q_weight: Any, k_weight: Any, *, n_heads: int, n_kv_heads: int,
                eps: float = 1e-6) -> KernelOp:
    """RMS-norm every q and k head of fused QKV rows, in place (Gemma 3's q/k norm).

    ``qkv`` holds, for each token, ``n_heads`` q heads, ``n_kv_heads`` k heads and
    ``n_kv_heads`` v heads of ``D`` elements (the layout :func:`rope_kv_write` reads). Each q
    head becomes ``h / sqrt(mean(h**2) + eps) * q_weight``, each k head the same with
    ``k_weight`` (float32 math, one rounding); v heads are not touched. One launch.

    Args:
        qkv: ``(..., (n_heads + 2 n_kv_heads) * D)`` Tensor or DeviceOp producing one
            (float32, float16, bfloat16; C-contiguous); written in place.
        q_weight, k_weight: ``(D,)`` of qkv's dtype.
        n_heads, n_kv_heads: query and key/value head counts (``n_heads % n_kv_heads == 0``).
        eps: added to the mean square (``>= 0``).

    Returns:
        A :class:`KernelOp` producing ``qkv``.

    Raises:
        ShapeError, DTypeError, ValueError: before any launch.
    """
    name = "qk_rms_norm"
    hq, hkv = int(n_heads), int(n_kv_heads)
    if hq < 1 or hkv < 1 or hq % hkv:
        raise ValueError(f"{name}: n_heads={n_heads}, n_kv_heads={n_kv_heads}: both must be >= 1 "
                         "and n_heads a multiple of n_kv_heads")
    e = float(eps)
    if not (math.isfinite(e) and e >= 0.0):
        raise ValueError(f"{name}: eps {eps!r} must be finite and >= 0")
    return _QK_RMS_NORM.op((qkv, q_weight, k_weight), (hq, hkv, e))


def _qk_rms_norm_parts(hq: int, hkv: int, e: float) -> tuple[MultiCheck, Body]:
    name = "qk_rms_norm"

    def check(ts: Mapping[str, Tensor | None]) -> Outputs:
        qt, wq, wk = ts["qkv"], ts["q_weight"], ts["k_weight"]
        assert qt is not None and wq is not None and wk is not None
        floating(name, "qkv", qt)
        nh = hq + 2 * hkv
        if qt.ndim < 1 or qt.shape[-1] == 0 or qt.shape[-1] % nh:
            raise ShapeError(
                f"{name}: qkv has shape {qt.shape}; expected (..., (n_heads + 2 n_kv_heads) * D) "
                f"= (..., {nh} * D) (n_heads={hq}, n_kv_heads={hkv})", op=name)
        d = qt.shape[-1] // nh
        why = f"the head dim of qkv {qt.shape} ({d})"
        same(name, "q_weight", wq, (d,), qt.dtype, why)
        same(name, "k_weight", wk, (d,), qt.dtype, why)
        distinct(name, ts, (("qkv", "q_weight"), ("qkv", "k_weight")), "use separate tensors")
        return {}

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        qt, wq, wk = ts["qkv"], ts["q_weight"], ts["k_weight"]
        qa, wqa, wka = qt.array, wq.array, wk.array

        if reference_mode():
            def cpu() -> None:
                qa[...] = qk_rms_norm_reference(qa, wqa, wka, hq, hkv, e)
        else:
            def cpu() -> None:
                qk_rms_norm_cpu(qa, wqa, wka, hq, hkv, e)

        cuda: Any = noop
        if not ctx.device.is_cpu:
            d = qt.shape[-1] // (hq + 2 * hkv)
            n_tok = qt.size // qt.shape[-1]
            units = n_tok * (hq + hkv)
            fn = function(ctx.device.index, f"qk_rms_norm<{CTYPE[qt.dtype]}>")
            args = (qa, wqa, wka, np.int64(n_tok), np.int32(hq), np.int32(hkv), np.int32(d),
                    np.float32(e))
            blocks = grid(units * 32)  # one warp per (token, head)

            def cuda(native: Any) -> None:
                if units > 0:
                    fn((blocks,), (THREADS,), args, stream=native)

        launch(ctx, name, (qt, wq, wk), (qt,), cpu, cuda)

    return check, body


_QK_RMS_NORM = KernelSpec("qk_rms_norm", ("qkv", "q_weight", "k_weight"), _qk_rms_norm_parts,
                          returns="qkv", outputs=True, replay=True)
