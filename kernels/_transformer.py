"""Transformer kernels: rotary embedding, fused QKV split + RoPE + KV-cache write, head
merge, SwiGLU, residual add fused with RMS norm.

CUDA source: ``src/transformer.cu`` (float32 math, one rounding on store, 16-byte accesses
where the row length and the pointers allow); the ``cpu`` backend runs the float64 NumPy
references below. Sampling is in :mod:`._sampling`.

| launcher                                                     | computes                                        |
|--------------------------------------------------------------|-------------------------------------------------|
| ``rope(x, start, *, theta, out)``                            | Llama "rotate half" RoPE of ``(B, L, H, D)``    |
| ``rope_kv_write(qkv, start, k_cache, v_cache, *, n_heads,`` | split ``(B, L, (Hq + 2 Hkv) D)``; RoPE(q) to    |
| ``n_kv_heads, theta, q_out, block_table)``                   | ``q_out``; RoPE(k), v into the caches at        |
|                                                              | positions ``start[b] + i`` (paged: block table) |
| ``merge_heads(x, *, out)``                                   | ``(B, H, L, D) -> (B, L, H * D)``               |
| ``swiglu(gate_up, *, out)``                                  | ``silu(gate_up[..., :F]) * gate_up[..., F:]``   |
| ``add_rms_norm(x, residual, weight, *, eps, out,``          | ``s = x + residual`` (to ``residual_out``),     |
| ``residual_out)``                                            | ``out = rms_norm(s) * weight``                  |

Positions live in device memory (``start``, int32 ``(B,)``), so one captured CUDA graph
serves every decode step. Floating tensors are float32, float16 or bfloat16, C-contiguous.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from deviceops.extend import DTypeError, ExecutionContext, ShapeError, Tensor, int32, launch

from ._builder import Body, check_out, noop
from ._launch import KernelOp
from ._multi_op import MultiCheck, Outputs, distinct, floating, same
from ._norms import CTYPE, MOVE_TYPES, norm_cuda, tk_function, vec_width
from ._spec import KernelSpec

__all__ = ["add_rms_norm", "merge_heads", "rope", "rope_kv_write", "swiglu"]

_MAX_BLOCKS = 1 << 20
_THREADS = 256

# -- NumPy references (float64 math, cast once) --------------------------------------------


def rope_cos_sin(pos: np.ndarray, d: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """``cos`` and ``sin`` of ``pos * theta**(-2j/d)`` for ``j < d/2``: shape ``(*pos.shape, d/2)``."""
    j = np.arange(d // 2, dtype=np.float64)
    a = pos.astype(np.float64)[..., None] * (float(theta) ** (-2.0 * j / d))
    return np.cos(a), np.sin(a)


def _rotate(x64: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    h = x64.shape[-1] // 2
    x1, x2 = x64[..., :h], x64[..., h:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _positions(start: np.ndarray, length: int) -> np.ndarray:
    return start.astype(np.int64)[:, None] + np.arange(length, dtype=np.int64)[None, :]  # (B, L)


def rope_reference(x: np.ndarray, start: np.ndarray, theta: float) -> np.ndarray:
    """RoPE of ``x`` ``(B, L, H, D)``, token ``(b, i)`` at ``start[b] + i``; in ``x.dtype``."""
    cos, sin = rope_cos_sin(_positions(start, x.shape[1]), x.shape[-1], theta)  # (B, L, D/2)
    return _rotate(x.astype(np.float64), cos[:, :, None], sin[:, :, None]).astype(x.dtype)


def rope_kv_write_reference(qkv: np.ndarray, start: np.ndarray, k_cache: np.ndarray,
                            v_cache: np.ndarray, q_out: np.ndarray, n_heads: int,
                            n_kv_heads: int, theta: float,
                            block_table: np.ndarray | None = None) -> None:
    """Write RoPE(q) to ``q_out`` and RoPE(k), v to the caches (in place; see rope_kv_write).

    With ``block_table`` ``(B, MB)`` the caches are a block pool ``(NB, Hkv, BS, D)``.
    """
    b_, l_, w = qkv.shape
    d = w // (n_heads + 2 * n_kv_heads)
    heads = qkv.reshape(b_, l_, n_heads + 2 * n_kv_heads, d).astype(np.float64)
    pos = _positions(start, l_)  # (B, L)
    cos, sin = rope_cos_sin(pos, d, theta)
    rot = _rotate(heads[:, :, : n_heads + n_kv_heads], cos[:, :, None], sin[:, :, None])
    q_out[...] = rot[:, :, :n_heads].transpose(0, 2, 1, 3).astype(q_out.dtype)
    k = rot[:, :, n_heads:].astype(k_cache.dtype)  # (B, L, Hkv, D)
    v = heads[:, :, n_heads + n_kv_heads:].astype(v_cache.dtype)
    s_len = k_cache.shape[2]
    for b in range(b_):
        for i in range(l_):
            p = int(pos[b, i])
            if block_table is None:
                if 0 <= p < s_len:
                    k_cache[b, :, p] = k[b, i]
                    v_cache[b, :, p] = v[b, i]
                continue
            if not 0 <= p < block_table.shape[1] * s_len:
                continue
            blk = int(block_table[b, p // s_len])
            if 0 <= blk < k_cache.shape[0]:
                k_cache[blk, :, p % s_len] = k[b, i]
                v_cache[blk, :, p % s_len] = v[b, i]


def merge_heads_reference(x: np.ndarray) -> np.ndarray:
    """``(B, H, L, D) -> (B, L, H * D)``."""
    b, h, length, d = x.shape
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(b, length, h * d)


def swiglu_reference(gate_up: np.ndarray) -> np.ndarray:
    """``silu(g) * u`` of the halves of the last dim in float64, in ``gate_up.dtype``."""
    f = gate_up.shape[-1] // 2
    g, u = gate_up[..., :f].astype(np.float64), gate_up[..., f:].astype(np.float64)
    return np.asarray(g / (1.0 + np.exp(-g)) * u).astype(gate_up.dtype)


def add_rms_norm_reference(x: np.ndarray, residual: np.ndarray, weight: np.ndarray,
                           eps: float) -> tuple[np.ndarray, np.ndarray]:
    """``(out, s)``: ``s = x + residual`` rounded to the dtype, ``out = rms_norm(s) * weight``."""
    s = (x.astype(np.float64) + residual.astype(np.float64)).astype(x.dtype)
    s64 = s.astype(np.float64)
    inv = 1.0 / np.sqrt(np.mean(s64 * s64, axis=-1, keepdims=True) + eps)
    return np.asarray(s64 * inv * weight.astype(np.float64)).astype(x.dtype), s


# -- checks ----------------------------------------------------------------------------------


def _start(name: str, start: Tensor, batch: int, what: str) -> None:
    if start.dtype != int32:
        raise DTypeError(f"{name}: start has dtype {start.dtype}; it must be int32 (B,) "
                         "(positions in device memory)", op=name)
    if start.shape != (batch,):
        raise ShapeError(f"{name}: start has shape {start.shape}, expected ({batch},) for "
                         f"{what}", op=name)


def _theta(name: str, theta: float) -> float:
    t = float(theta)
    if not (math.isfinite(t) and t > 1.0):
        raise ValueError(f"{name}: theta {theta!r} must be finite and > 1 (Llama uses 10000.0)")
    return t


def _grid(units: int) -> int:
    return min(max(1, -(-units // _THREADS)), _MAX_BLOCKS)


# -- rope ------------------------------------------------------------------------------------


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

        def cpu() -> None:
            oa[...] = rope_reference(xa, sa, th)

        cuda: Any = noop
        if not ctx.device.is_cpu:
            b, length, h, d = xt.shape
            vec = vec_width(xt.dtype, d // 2, (xa, oa))
            units = b * length * h * (d // 2 // vec)
            fn = tk_function(ctx.device.index, f"rope<{CTYPE[xt.dtype]}, {vec}>")
            args = (oa, xa, sa, np.int64(units), np.int32(length), np.int32(h), np.int32(d),
                    np.float64(math.log2(th)))
            grid = _grid(units)

            def cuda(native: Any) -> None:
                if units > 0:
                    fn((grid,), (_THREADS,), args, stream=native)

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

        def cpu() -> None:
            rope_kv_write_reference(qa, sa, ka, va, oa, hq, hkv, th, ba)

        cuda: Any = noop
        if not ctx.device.is_cpu:
            b, length, w = qt.shape
            d = w // (hq + 2 * hkv)
            vec = vec_width(qt.dtype, d // 2, (qa, ka, va, oa))
            n_tok = b * length
            units = n_tok * ((hq + hkv) * (d // 2 // vec) + hkv * (d // vec))
            fn = tk_function(ctx.device.index, f"rope_kv_write<{CTYPE[qt.dtype]}, {vec}>")
            if ba is None:
                paged: tuple[Any, ...] = (np.uint64(0), np.int32(0), np.int64(0))
            else:
                paged = (ba, np.int32(ba.shape[1]), np.int64(kc.shape[0]))
            args = (oa, ka, va, qa, sa, np.int64(n_tok), np.int32(length), np.int32(hq),
                    np.int32(hkv), np.int32(d), np.int64(kc.shape[2]), np.float64(math.log2(th)),
                    *paged)
            grid = _grid(units)

            def cuda(native: Any) -> None:
                if units > 0:
                    fn((grid,), (_THREADS,), args, stream=native)

        reads = (qt, st) if bt is None else (qt, st, bt)
        launch(ctx, name, reads, (qo, kc, vc), cpu, cuda)

    return check, body


_ROPE_KV_WRITE = KernelSpec(
    "rope_kv_write", ("qkv", "start", "k_cache", "v_cache", "q_out", "block_table"),
    _rope_kv_write_parts, returns="q_out", outputs=True, replay=True)


def _block_table(name: str, bt: Tensor, b: int, kc: Tensor, hkv: int, d: int,
                 qkv_shape: tuple[int, ...]) -> None:
    """Checks of a paged rope_kv_write: the table ``(B, max_blocks)`` int32, the pool's shape."""
    if bt.dtype != int32:
        raise DTypeError(f"{name}: block_table has dtype {bt.dtype}; it must be int32 "
                         "(B, max_blocks) block ids in device memory", op=name)
    if bt.ndim != 2 or bt.shape[0] != b or bt.shape[1] < 1:
        raise ShapeError(f"{name}: block_table has shape {bt.shape}, expected ({b}, max_blocks) "
                         f"with max_blocks >= 1 for qkv {qkv_shape}", op=name)
    if kc.ndim != 4 or kc.shape[0] < 1 or kc.shape[1] != hkv or kc.shape[2] < 1 or kc.shape[3] != d:
        raise ShapeError(f"{name}: k_cache has shape {kc.shape}, expected the block pool "
                         f"(num_blocks, {hkv}, block_size, {d}) for qkv {qkv_shape} with "
                         f"n_kv_heads={hkv} (paged: block_table given)", op=name)


# -- merge_heads, swiglu ---------------------------------------------------------------------


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
            fn = tk_function(ctx.device.index, f"merge_heads<{MOVE_TYPES[unit]}>")
            args = (oa, xa, np.int64(units), np.int32(h), np.int32(length), np.int32(dv))
            grid = _grid(units)

            def cuda(native: Any) -> None:
                if units > 0:
                    fn((grid,), (_THREADS,), args, stream=native)

        launch(ctx, name, (xt,), (o,), cpu, cuda)

    return check, body


_MERGE_HEADS = KernelSpec("merge_heads", ("x", "out"), _merge_heads_parts, outputs=True,
                          replay=True)


def swiglu(gate_up: Any, *, out: Any = None) -> KernelOp:
    """SwiGLU of a fused gate/up projection: ``silu(gate_up[..., :F]) * gate_up[..., F:]``.

    Args:
        gate_up: ``(..., 2F)`` Tensor, Partition or DeviceOp producing one (float32,
            float16, bfloat16; C-contiguous).
        out: optional ``(..., F)`` of gate_up's dtype, not sharing memory with it;
            allocated if ``None``.

    Returns:
        A :class:`KernelOp` producing ``out`` in the form given.

    Raises:
        ShapeError, DTypeError: before any launch.
    """
    return _SWIGLU.op((gate_up, out))


def _swiglu_parts() -> tuple[MultiCheck, Body]:
    name = "swiglu"

    def check(ts: Mapping[str, Tensor | None]) -> Outputs:
        gt = ts["gate_up"]
        assert gt is not None
        floating(name, "gate_up", gt)
        if gt.ndim < 1 or gt.shape[-1] % 2 or gt.shape[-1] < 2:
            raise ShapeError(f"{name}: gate_up has shape {gt.shape}; expected (..., 2F) with the "
                             "gate in the first half of the last dim, up in the second", op=name)
        oshape = (*gt.shape[:-1], gt.shape[-1] // 2)
        check_out(name, ts["out"], oshape, gt.dtype, f"half the last dim of gate_up {gt.shape}")
        distinct(name, ts, (("out", "gate_up"),), "write to a separate tensor")
        return {"out": (oshape, gt.dtype)}

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        gt, o = ts["gate_up"], ts["out"]
        ga, oa = gt.array, o.array

        def cpu() -> None:
            oa[...] = swiglu_reference(ga)

        cuda: Any = noop
        if not ctx.device.is_cpu:
            f = gt.shape[-1] // 2
            rows = gt.size // (2 * f)
            vec = vec_width(gt.dtype, f, (ga, oa))
            units = rows * (f // vec)
            fn = tk_function(ctx.device.index, f"swiglu<{CTYPE[gt.dtype]}, {vec}>")
            args = (oa, ga, np.int64(rows), np.int32(f))
            grid = _grid(units)

            def cuda(native: Any) -> None:
                if units > 0:
                    fn((grid,), (_THREADS,), args, stream=native)

        launch(ctx, name, (gt,), (o,), cpu, cuda)

    return check, body


_SWIGLU = KernelSpec("swiglu", ("gate_up", "out"), _swiglu_parts, outputs=True, replay=True)


# -- add_rms_norm ----------------------------------------------------------------------------


def add_rms_norm(x: Any, residual: Any, weight: Any, *, eps: float = 1e-6, out: Any = None,
                 residual_out: Any = None) -> KernelOp:
    """Residual add fused with RMS norm (one kernel, one read of each input).

    ``s = x + residual`` is rounded to the dtype and written to ``residual_out`` (by
    default ``residual`` itself, in place: the running residual stream); then
    ``out = s / sqrt(mean(s**2) + eps) * weight`` over the last dim, computed from the
    rounded ``s`` (so the result equals ``add`` followed by ``rms_norm``).

    Args:
        x: ``(..., D)`` Tensor, Partition or DeviceOp producing one (float32, float16,
            bfloat16; C-contiguous).
        residual: of x's shape and dtype.
        weight: ``(D,)`` of x's dtype.
        eps: added to the mean square (``>= 0``).
        out: optional output of x's shape and dtype (may be ``x``); allocated if ``None``.
        residual_out: where ``s`` goes, of x's shape and dtype (may be ``residual`` or
            ``x``); ``None`` means ``residual``. Must not share memory with ``out``.

    Returns:
        A :class:`KernelOp` producing the tuple ``(out, residual_out)`` in the forms given.

    Raises:
        ShapeError, DTypeError, ValueError: before any launch.
    """
    e = eps if type(eps) is float else float(eps)
    if not (math.isfinite(e) and e >= 0.0):
        raise ValueError(f"add_rms_norm: eps {eps!r} must be finite and >= 0")
    return _ADD_RMS_NORM.op((x, residual, weight, out, residual_out), (e,))


def _add_rms_norm_parts(e: float) -> tuple[MultiCheck, Body]:
    name = "add_rms_norm"

    def check(ts: Mapping[str, Tensor | None]) -> Outputs:
        xt, rt, wt = ts["x"], ts["residual"], ts["weight"]
        assert xt is not None and rt is not None and wt is not None
        floating(name, "x", xt)
        if xt.ndim < 1 or xt.shape[-1] < 1:
            raise ShapeError(f"{name}: x has shape {xt.shape}; it needs a last dim >= 1", op=name)
        if xt.shape[-1] > 2**31 - 1:
            raise ShapeError(f"{name}: x rows of {xt.shape[-1]} elements are too long", op=name)
        why = f"the shape and dtype of x {xt.shape} {xt.dtype}"
        same(name, "residual", rt, xt.shape, xt.dtype, why)
        same(name, "weight", wt, (xt.shape[-1],), xt.dtype, f"the last dim of x {xt.shape}")
        check_out(name, ts["out"], xt.shape, xt.dtype, why)
        ro = ts["residual_out"]
        assert ro is not None  # (defaults to residual)
        same(name, "residual_out", ro, xt.shape, xt.dtype, why)
        distinct(name, ts, (("out", "residual_out"), ("out", "residual"), ("out", "weight"),
                             ("residual_out", "weight")),
                  "out may be x, residual_out may be residual or x; nothing else may overlap")
        return {"out": (xt.shape, xt.dtype)}

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        xt, rt, wt, o, ro = ts["x"], ts["residual"], ts["weight"], ts["out"], ts["residual_out"]
        xa, ra, wa, oa, roa = xt.array, rt.array, wt.array, o.array, ro.array

        def cpu() -> None:
            y, s = add_rms_norm_reference(xa, ra, wa, e)
            roa[...] = s
            oa[...] = y

        cuda: Any = noop
        if not ctx.device.is_cpu:
            cuda = norm_cuda(ctx.device.index, oa, xa, wa, e, residual=ra, residual_out=roa)
        launch(ctx, name, (xt, rt, wt), (o, ro), cpu, cuda)

    return check, body


def _out_and_residual(v: dict[str, Any]) -> tuple[Any, Any]:
    return v["out"], v["residual_out"]


_ADD_RMS_NORM = KernelSpec("add_rms_norm", ("x", "residual", "weight", "out", "residual_out"),
                           _add_rms_norm_parts, returns=_out_and_residual, outputs=True,
                           defaults={"residual_out": "residual"}, replay=True)
