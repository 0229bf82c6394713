"""Flash attention: argument checks, before anything is launched (semantics: :mod:`deviceops.kernels.attention`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from deviceops.extend import DTypeError, ShapeError

__all__ = ["MAX_HEAD_DIM", "attention_check", "supported_dtypes"]

#: Largest supported head dim.
MAX_HEAD_DIM = 256


def _bf16_dtype() -> np.dtype | None:
    try:
        import ml_dtypes
    except ImportError:  # pragma: no cover - ml_dtypes is a dependency
        return None
    return np.dtype(ml_dtypes.bfloat16)


def supported_dtypes() -> tuple[np.dtype, ...]:
    """float32, float16 and (with ``ml_dtypes``) bfloat16."""
    base = (np.dtype(np.float32), np.dtype(np.float16))
    bf = _bf16_dtype()
    return base if bf is None else (*base, bf)


def attention_check(
    q_shape: tuple[int, ...],
    q_dtype: Any,
    k_shape: tuple[int, ...],
    k_dtype: Any,
    v_shape: tuple[int, ...],
    v_dtype: Any,
    *,
    out_shape: tuple[int, ...] | None = None,
    out_dtype: Any = None,
    kv_len_shape: tuple[int, ...] | None = None,
    kv_len_dtype: Any = None,
    block_table_shape: tuple[int, ...] | None = None,
    block_table_dtype: Any = None,
    op: str = "flash_attention",
) -> tuple[tuple[int, ...], np.dtype]:
    """Validate flash-attention arguments before anything is launched.

    Args:
        q_shape: ``(B, Hq, Lq, D)``.
        q_dtype: dtype of q (float32, float16 or bfloat16).
        k_shape: ``(B, Hkv, Lk, D)``; with ``block_table``, the block pool
            ``(num_blocks, Hkv, block_size, D)``.
        k_dtype: dtype of k (same as q).
        v_shape: same as ``k_shape``.
        v_dtype: dtype of v (same as q).
        out_shape: shape of a caller-provided output, if any (must equal ``q_shape``).
        out_dtype: dtype of a caller-provided output, if any (must equal q's).
        kv_len_shape: shape of ``kv_len`` if given (must be ``(B,)``).
        kv_len_dtype: dtype of ``kv_len`` if given (must be int32).
        block_table_shape: shape of ``block_table`` if given (``(B, max_blocks)``).
        block_table_dtype: dtype of ``block_table`` if given (must be int32).
        op: operation name used in error messages.

    Returns:
        ``(out_shape, out_dtype)``.

    Raises:
        ShapeError: ranks, batch/head/length/head-dim mismatches, ``Hq % Hkv != 0``,
            empty dims, head dim not a multiple of 8 or above 256, wrong ``out``,
            ``kv_len`` or ``block_table`` shape, ``block_table`` without ``kv_len``.
        DTypeError: unsupported or mismatched dtypes (``kv_len``/``block_table``: int32).
    """
    q_shape, k_shape, v_shape = tuple(q_shape), tuple(k_shape), tuple(v_shape)
    paged = block_table_shape is not None
    shapes = f"q {q_shape}, k {k_shape}, v {v_shape}"
    if paged:
        shapes += f", block_table {tuple(block_table_shape or ())}"
    for name, shp in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(shp) != 4:
            kind = "(num_blocks, Hkv, block_size, D)" if paged and name != "q" else "(B, H, L, D)"
            raise ShapeError(f"{op}: {name} must be 4-D {kind}; got {shapes}", op=op)
        if any(int(s) < 1 for s in shp):
            raise ShapeError(f"{op}: every dimension must be >= 1; got {shapes}", op=op)
    b, hq, _lq, d = q_shape
    bk, hkv, _lk, dk = k_shape
    if k_shape != v_shape:
        raise ShapeError(f"{op}: k and v shapes must be equal; got {shapes}", op=op)
    if not paged and b != bk:
        raise ShapeError(f"{op}: batch sizes differ (q B={b}, k/v B={bk}); got {shapes}", op=op)
    if d != dk:
        raise ShapeError(f"{op}: head dims differ (q D={d}, k/v D={dk}); got {shapes}", op=op)
    if hq % hkv != 0:
        raise ShapeError(
            f"{op}: query heads must be a multiple of kv heads (Hq={hq}, Hkv={hkv}); got {shapes}",
            op=op,
        )
    if d % 8 != 0 or d > MAX_HEAD_DIM:
        raise ShapeError(
            f"{op}: head dim must be a multiple of 8 and <= {MAX_HEAD_DIM} (got D={d}); {shapes}",
            op=op,
        )
    dts = {"q": q_dtype, "k": k_dtype, "v": v_dtype}
    try:
        ndts = {n: np.dtype(t) for n, t in dts.items()}
    except TypeError as exc:
        raise DTypeError(f"{op}: unknown dtype among {dts}", op=op) from exc
    supported = supported_dtypes()
    if ndts["q"] not in supported:
        raise DTypeError(
            f"{op}: q dtype {ndts['q']} not supported (float32, float16, bfloat16); "
            f"q {ndts['q']}, k {ndts['k']}, v {ndts['v']}",
            op=op,
        )
    if ndts["k"] != ndts["q"] or ndts["v"] != ndts["q"]:
        raise DTypeError(
            f"{op}: q, k, v dtypes must match; q {ndts['q']}, k {ndts['k']}, v {ndts['v']}",
            op=op,
        )
    if out_shape is not None and tuple(out_shape) != q_shape:
        raise ShapeError(f"{op}: out shape {tuple(out_shape)} must equal q shape {q_shape}", op=op)
    if out_dtype is not None:
        try:
            odt = np.dtype(out_dtype)
        except TypeError as exc:
            raise DTypeError(f"{op}: unknown out dtype {out_dtype!r}", op=op) from exc
        if odt != ndts["q"]:
            raise DTypeError(f"{op}: out dtype {odt} must equal q dtype {ndts['q']}", op=op)
    _check_index_arg(op, "kv_len", kv_len_shape, kv_len_dtype, (b,), "(B,)", q_shape)
    if paged:
        if kv_len_shape is None:
            raise ShapeError(
                f"{op}: a paged KV cache (block_table {tuple(block_table_shape or ())}) needs "
                "kv_len, the int32 (B,) number of valid keys of each row; pass kv_len=",
                op=op,
            )
        bt = tuple(block_table_shape or ())
        if len(bt) != 2 or bt[0] != b or bt[1] < 1:
            raise ShapeError(
                f"{op}: block_table must be (B, max_blocks) = ({b}, >= 1) for q {q_shape}; "
                f"got {bt}",
                op=op,
            )
        _check_index_arg(op, "block_table", bt, block_table_dtype, bt, "(B, max_blocks)", q_shape)
    return q_shape, ndts["q"]


def _check_index_arg(
    op: str,
    name: str,
    shape: tuple[int, ...] | None,
    dtype: Any,
    want: tuple[int, ...],
    want_s: str,
    q_shape: tuple[int, ...],
) -> None:
    if shape is None:
        return
    if tuple(shape) != want:
        raise ShapeError(
            f"{op}: {name} must have shape {want_s} = {want} for q {q_shape}; got {tuple(shape)}",
            op=op,
        )
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise DTypeError(f"{op}: unknown {name} dtype {dtype!r}; use int32", op=op) from exc
    if dt != np.dtype(np.int32):
        raise DTypeError(
            f"{op}: {name} must be int32 (got {dt}, shape {tuple(shape)}); convert it with "
            "api.convert(t, 'int32')",
            op=op,
        )
