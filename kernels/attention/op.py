"""Flash attention as a DeviceOp: ``flash_attention(q, k, v, *, causal, scale, out, kv_len,
block_table, window)``.

Semantics are those of :mod:`deviceops.kernels.attention`: ``q`` ``(B, Hq, Lq, D)``, ``k``/``v``
``(B, Hkv, Lk, D)`` with ``Hq % Hkv == 0`` (GQA/MQA), float32, float16 or bfloat16, ``D`` a
multiple of 8 up to 256; optional device-side valid lengths ``kv_len`` and a paged cache
(``block_table``); ``out = softmax(scale q k^T) v`` with float32 statistics; the
queries are the last ``Lq`` positions of the key sequence (bottom-right causal mask, as
in decode with a KV cache). The ``cpu`` backend runs :func:`._cpu.attention_cpu` (float32,
one batched product per row; :func:`._reference.attention_reference`, the float64 oracle, in
the reference mode), the ``cuda`` backend
:mod:`._cuda`'s launch plan on the executing stream (no second check).

The decode path (``Lq <= 8``) splits the keys across blocks using the stream's kernel
workspace; see :mod:`..runtime._workspace` for how it is sized and why an op captured into a graph
on a stream that never ran it raises :class:`~deviceops.CaptureError` (fix: a warm-up run
on that stream, or :func:`reserve_workspace`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from deviceops.extend import ExecutionContext, ShapeError, Tensor, launch

from ..runtime._builder import Body, Check
from ..runtime._cpu import reference_mode
from ..runtime._op import KernelOp
from ..runtime._spec import KernelSpec
from ..runtime._workspace import workspace_for
from ._check import attention_check
from ._cpu import attention_cpu
from ._cuda import _launch
from ._plan import attention_workspace_nbytes
from ._reference import attention_reference

__all__ = ["flash_attention"]


def flash_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool = False,
    scale: float | None = None,
    out: Any = None,
    kv_len: Any = None,
    block_table: Any = None,
    window: int | None = None,
) -> KernelOp:
    """``out = softmax(scale * q k^T) v`` per head; produces ``out`` in the form given.

    Args:
        q: ``(B, Hq, Lq, D)`` Tensor, Partition or DeviceOp producing one; float32, float16
            or bfloat16, C-contiguous; ``D`` a multiple of 8 up to 256.
        k: ``(B, Hkv, Lk, D)``, same dtype; ``Hq`` must be a multiple of ``Hkv``. With
            ``block_table``: the block pool ``(num_blocks, Hkv, block_size, D)``.
        v: same shape and dtype as ``k``.
        causal: bottom-right aligned causal mask: query ``i`` sees keys
            ``j <= i + Lk - Lq`` (``Lk`` replaced by ``kv_len[b]`` when given); a query row
            that sees no key gives zeros. Must be a ``bool``.
        scale: softmax scale, ``1 / sqrt(D)`` when ``None``.
        out: optional ``(B, Hq, Lq, D)`` output of q's dtype; allocated when ``None``
            (not allowed inside graph capture).
        kv_len: optional int32 ``(B,)`` tensor (or DeviceOp producing one) on q's device:
            the number of valid keys of each batch row, clamped to ``[0, Lk]``; keys at or
            past it are ignored. It is read on the device only (the CUDA kernels bound their
            key loops by it), so one captured decode graph serves every position of a
            growing KV cache of ``Lk`` rows, and a cache holding few valid keys costs what a
            short one costs.
        block_table: optional int32 ``(B, max_blocks)`` tensor: paged KV cache (needs
            ``kv_len``). Key ``j`` of row ``b`` lives at
            ``k[block_table[b, j // block_size], :, j % block_size]``; the logical length
            is ``Lk = max_blocks * block_size``; entries of blocks past ``kv_len[b]`` are
            never read. A read entry outside ``[0, num_blocks)`` is an error: the ``cpu``
            backend raises ``IndexError``, the CUDA kernel clamps it into the pool.
        window: optional sliding window (needs ``causal``; an int >= 1): query ``i`` also
            ignores keys older than ``window`` positions, i.e. it sees keys ``j`` with
            ``p - window < j <= p`` where ``p = i + Lk - Lq`` (``kv_len[b]`` for ``Lk``) is
            its position: at most ``window`` keys, itself included (Gemma 3's local layers,
            Mistral). ``None``: no window.

    Returns:
        A :class:`KernelOp` producing ``out``.

    Raises:
        TypeError: ``causal`` is not a bool, or ``window`` not an int.
        ValueError: ``window`` is below 1 or given without ``causal``.
        ShapeError: shapes do not fit (the message names them); before any launch.
        DTypeError: unsupported or mismatched dtypes (``kv_len``/``block_table`` must be
            int32); before any launch.
        CaptureError: inside a graph capture, ``out`` is ``None`` or the stream's
            workspace is too small.

    Example:
        >>> o = kernels.flash_attention(q, k_cache, v_cache, causal=True, kv_len=lens).sync()
    """
    if type(causal) is not bool:
        if not isinstance(causal, np.bool_):
            raise TypeError("flash_attention: causal must be a bool (True or False); got "
                            f"{type(causal).__name__} {causal!r}")
        causal = bool(causal)
    if scale is not None:
        scale = float(scale)
        if not math.isfinite(scale):
            raise ValueError(f"flash_attention: scale {scale} must be finite")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, (int, np.integer)):
            raise TypeError(f"flash_attention: window must be an int (keys a query sees) or "
                            f"None; got {type(window).__name__} {window!r}")
        window = int(window)
        if window < 1:
            raise ValueError(f"flash_attention: window={window} must be >= 1 (or None: no window)")
        if not causal:
            raise ValueError("flash_attention: window needs causal=True (the window is the last "
                             "`window` positions up to each query's own)")
    return _FLASH_ATTENTION.op((q, k, v, out, kv_len, block_table), (causal, scale, window))


def _flash_attention_parts(causal: bool, scale: float | None,
                           window: int | None = None) -> tuple[Check, Body]:
    name = "flash_attention"

    def check(ts: Mapping[str, Tensor | None]) -> tuple[tuple[int, ...], np.dtype[Any]]:
        qt, kt, vt, ot = ts["q"], ts["k"], ts["v"], ts["out"]
        lt, bt = ts["kv_len"], ts["block_table"]
        assert qt is not None and kt is not None and vt is not None
        if ot is not None:
            for n_, t in (("q", qt), ("k", kt), ("v", vt), ("kv_len", lt), ("block_table", bt)):
                if t is not None and t._storage is ot._storage:
                    raise ShapeError(
                        f"{name}: out {ot.shape} shares memory with {n_} {t.shape}; "
                        "write to a separate tensor",
                        op=name,
                    )
        return attention_check(
            qt.shape, qt.dtype, kt.shape, kt.dtype, vt.shape, vt.dtype,
            out_shape=None if ot is None else ot.shape,
            out_dtype=None if ot is None else ot.dtype,
            kv_len_shape=None if lt is None else lt.shape,
            kv_len_dtype=None if lt is None else lt.dtype,
            block_table_shape=None if bt is None else bt.shape,
            block_table_dtype=None if bt is None else bt.dtype, op=name,
        )  # fmt: skip

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        qt, kt, vt, ot = ts["q"], ts["k"], ts["v"], ts["out"]
        lt, bt = ts.get("kv_len"), ts.get("block_table")
        nbytes = attention_workspace_nbytes(
            qt.shape, kt.shape, qt.dtype, block_table_shape=None if bt is None else bt.shape
        )
        ws = workspace_for(ctx.stream, nbytes, name)
        qa, ka, va, oa = qt.array, kt.array, vt.array, ot.array
        la = None if lt is None else lt.array
        ba = None if bt is None else bt.array
        reads = [qt, kt, vt] + [t for t in (lt, bt) if t is not None]

        if reference_mode():
            def cpu() -> None:
                oa[...] = attention_reference(
                    qa, ka, va, causal=causal, scale=scale, kv_len=la, block_table=ba,
                    window=window)
        else:
            def cpu() -> None:
                attention_cpu(qa, ka, va, oa, causal=causal, scale=scale, kv_len=la,
                              block_table=ba, window=window)

        def cuda(native: Any) -> None:
            _launch(qa, ka, va, oa, causal, scale, la, ba, None if ws is None else ws.array, native,
                    True, window)  # (checked: this op's plan)

        launch(ctx, name, reads, [ot] + ([ws] if ws is not None else []), cpu, cuda)

    return check, body


_FLASH_ATTENTION = KernelSpec("flash_attention", ("q", "k", "v", "out", "kv_len", "block_table"),
                              _flash_attention_parts, replay=True)
