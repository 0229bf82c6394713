"""Flash attention as a DeviceOp: ``flash_attention(q, k, v, *, causal, scale, out)``.

Semantics are those of :mod:`._attention`: ``q`` ``(B, Hq, Lq, D)``, ``k``/``v``
``(B, Hkv, Lk, D)`` with ``Hq % Hkv == 0`` (GQA/MQA), float16 or bfloat16, ``D`` a
multiple of 8 up to 256; ``out = softmax(scale q k^T) v`` with float32 statistics; the
queries are the last ``Lq`` positions of the key sequence (bottom-right causal mask, as
in decode with a KV cache). The ``cpu`` backend runs
:func:`._attention.attention_reference`, the ``cuda`` backend
:func:`._attention.flash_attention_cuda` on the executing stream.

The decode path (``Lq <= 8``) splits the keys across blocks using the stream's kernel
workspace; see :mod:`._linear` for how it is sized and why an op captured into a graph
on a stream that never ran it raises :class:`~deviceops.CaptureError` (fix: a warm-up run
on that stream, or :func:`reserve_workspace`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from deviceops._context import ExecutionContext
from deviceops._errors import ShapeError
from deviceops._launch import launch
from deviceops._tensor import Tensor

from ._attention import (
    attention_check,
    attention_reference,
    attention_workspace_nbytes,
    flash_attention_cuda,
)
from ._launch import KernelOp
from ._linear import build_op, workspace_for

__all__ = ["flash_attention"]


def flash_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool = False,
    scale: float | None = None,
    out: Any = None,
) -> KernelOp:
    """``out = softmax(scale * q k^T) v`` per head; produces ``out`` in the form given.

    Args:
        q: ``(B, Hq, Lq, D)`` Tensor, Partition or DeviceOp producing one; float16 or
            bfloat16, C-contiguous.
        k: ``(B, Hkv, Lk, D)``, same dtype; ``Hq`` must be a multiple of ``Hkv``.
        v: same shape and dtype as ``k``.
        causal: bottom-right aligned causal mask: query ``i`` sees keys
            ``j <= i + Lk - Lq``; a query row that sees no key gives zeros.
        scale: softmax scale, ``1 / sqrt(D)`` when ``None``.
        out: optional ``(B, Hq, Lq, D)`` output of q's dtype; allocated when ``None``
            (not allowed inside graph capture).

    Returns:
        A :class:`KernelOp` producing ``out``.

    Raises:
        ShapeError: shapes do not fit (the message names them); before any launch.
        DTypeError: unsupported or mismatched dtypes; before any launch.
        CaptureError: inside a graph capture, ``out`` is ``None`` or the stream's
            workspace is too small.

    Example:
        >>> o = kernels.flash_attention(q, k_cache, v_cache, causal=True).sync()
    """
    name = "flash_attention"
    causal = bool(causal)
    if scale is not None:
        scale = float(scale)
        if not math.isfinite(scale):
            raise ValueError(f"{name}: scale {scale} must be finite")

    def check(ts: Mapping[str, Tensor | None]) -> tuple[tuple[int, ...], np.dtype[Any]]:
        qt, kt, vt, ot = ts["q"], ts["k"], ts["v"], ts["out"]
        assert qt is not None and kt is not None and vt is not None
        if ot is not None:
            for n_, t in (("q", qt), ("k", kt), ("v", vt)):
                if t._storage is ot._storage:
                    raise ShapeError(f"{name}: out {ot.shape} shares memory with {n_} {t.shape}; "
                                     "write to a separate tensor", op=name)
        return attention_check(
            qt.shape, qt.dtype, kt.shape, kt.dtype, vt.shape, vt.dtype,
            out_shape=None if ot is None else ot.shape,
            out_dtype=None if ot is None else ot.dtype, op=name,
        )  # fmt: skip

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        qt, kt, vt, ot = ts["q"], ts["k"], ts["v"], ts["out"]
        ws = workspace_for(ctx.stream, attention_workspace_nbytes(qt.shape, kt.shape, qt.dtype), name)
        qa, ka, va, oa = qt.array, kt.array, vt.array, ot.array

        def cpu() -> None:
            oa[...] = attention_reference(qa, ka, va, causal=causal, scale=scale)

        def cuda(native: Any) -> None:
            flash_attention_cuda(qa, ka, va, oa, causal=causal, scale=scale,
                                 workspace=None if ws is None else ws.array, stream=native)

        launch(ctx, name, (qt, kt, vt), [ot] + ([ws] if ws is not None else []), cpu, cuda)

    return build_op(name, {"q": q, "k": k, "v": v, "out": out}, check, body)
