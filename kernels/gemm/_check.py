"""GEMM argument checks: dtypes, shapes, the epilogue's activation, operand layout.

:func:`gemm_check` validates a call's shapes and dtypes (once per plan: the ``gemm`` op's plan
cache entry, or a direct :func:`._cuda.gemm_cuda` call's launch plan) and
returns the output's shape and dtype; :func:`_check_layout` refuses a non-contiguous operand.
Errors name the op, the argument, the shapes or dtypes and the fix. The semantics are
described in :mod:`deviceops.kernels.gemm`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from deviceops.extend import DTypeError, ShapeError

__all__ = ["ACTIVATIONS", "gemm_check"]

ACTIVATIONS: dict[str | None, int] = {None: 0, "relu": 1, "gelu": 2, "silu": 3, "gelu_erf": 4}


def _bf16() -> np.dtype[Any]:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _supported_dtypes() -> tuple[np.dtype[Any], ...]:
    return (np.dtype(np.float32), np.dtype(np.float16), _bf16())


def gemm_check(
    a_shape: tuple[int, ...],
    a_dtype: Any,
    b_shape: tuple[int, ...],
    b_dtype: Any,
    *,
    out_shape: tuple[int, ...] | None = None,
    out_dtype: Any = None,
    bias_shape: tuple[int, ...] | None = None,
    bias_dtype: Any = None,
    activation: str | None = None,
    op: str = "gemm",
    trans_b: bool = False,
) -> tuple[tuple[int, ...], np.dtype[Any]]:
    """Validate a GEMM's arguments; return ``(out_shape, out_dtype)``.

    Args:
        a_shape: ``(*batch, M, K)``.
        a_dtype: float32, float16 or bfloat16.
        b_shape: ``(K, N)`` or ``(*batch, K, N)`` (same leading dims as ``a``); with
            ``trans_b``, ``(N, K)`` or ``(*batch, N, K)``.
        b_dtype: must equal ``a_dtype``.
        out_shape: if given, must be ``(*batch, M, N)``.
        out_dtype: if given, must equal ``a_dtype``.
        bias_shape: if given, must be ``(N,)``.
        bias_dtype: if given, must equal ``a_dtype``.
        activation: None, ``"relu"``, ``"gelu"``, ``"silu"`` or ``"gelu_erf"``.
        op: operation name used in messages.
        trans_b: ``b`` is given transposed, ``(..., N, K)`` (a Linear weight as stored).

    Returns:
        The output shape and dtype.

    Raises:
        ShapeError: shapes do not fit (message names the shapes).
        DTypeError: dtypes unsupported or mismatched.
        ValueError: unknown activation.
    """
    a_shape = tuple(int(x) for x in a_shape)
    b_shape = tuple(int(x) for x in b_shape)
    ad, bd = np.dtype(a_dtype), np.dtype(b_dtype)
    if ad not in _supported_dtypes():
        raise DTypeError(f"{op}: a has dtype {ad}; supported: float32, float16, bfloat16", op=op)
    if bd != ad:
        raise DTypeError(f"{op}: b has dtype {bd} but a has dtype {ad}; they must match", op=op)
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation {activation!r} not one of None, 'relu', 'gelu', 'silu', 'gelu_erf'")
    form = "(N, K), trans_b=True" if trans_b else "(K, N), trans_b=False"
    if len(a_shape) < 2 or len(b_shape) < 2:
        raise ShapeError(
            f"{op}: a {a_shape} and b {b_shape} must have at least 2 dims ((..., M, K) @ b {form})", op=op
        )
    *batch, m, k = a_shape
    if trans_b:
        n, kb = b_shape[-2:]
    else:
        kb, n = b_shape[-2:]
    if kb != k:
        fix = ("; b looks like (K, N): pass trans_b=False" if trans_b and b_shape[-2] == k else
               "; b looks like (N, K) (a Linear weight): pass trans_b=True" if not trans_b and b_shape[-1] == k
               else "")  # fmt: skip
        raise ShapeError(
            f"{op}: inner dims differ: a {a_shape} has K={k}, b {b_shape} read as {form} has K={kb}{fix}",
            op=op,
        )
    if len(b_shape) > 2 and tuple(b_shape[:-2]) != tuple(batch):
        raise ShapeError(
            f"{op}: b {b_shape} has leading dims {b_shape[:-2]} but a {a_shape} has {tuple(batch)}; "
            "b must be 2-D or have the same leading dims as a",
            op=op,
        )
    if min(a_shape + b_shape) < 1:
        raise ShapeError(f"{op}: every dim must be >= 1, got a {a_shape}, b {b_shape}", op=op)
    oshape = (*batch, m, n)
    if out_shape is not None and tuple(int(x) for x in out_shape) != oshape:
        raise ShapeError(f"{op}: out has shape {tuple(out_shape)}, expected {oshape} for a {a_shape} @ b {b_shape}", op=op)
    if out_dtype is not None and np.dtype(out_dtype) != ad:
        raise DTypeError(f"{op}: out has dtype {np.dtype(out_dtype)}, expected {ad}", op=op)
    if bias_shape is not None and tuple(int(x) for x in bias_shape) != (n,):
        raise ShapeError(f"{op}: bias has shape {tuple(bias_shape)}, expected ({n},) for N={n}", op=op)
    if bias_dtype is not None and np.dtype(bias_dtype) != ad:
        raise DTypeError(f"{op}: bias has dtype {np.dtype(bias_dtype)}, expected {ad}", op=op)
    return oshape, ad


def _check_layout(name: str, shape: tuple[int, ...], strides: tuple[int, ...], contiguous: bool, op: str) -> None:
    if not contiguous:
        raise ShapeError(
            f"{op}: {name} of shape {shape} with strides {strides} is not row-major C-contiguous "
            f"(transposed or strided view); pass {name}.copy() (a contiguous copy)",
            op=op,
        )
