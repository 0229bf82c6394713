"""Argument checks of the transformer kernels: RoPE positions (``start``), ``theta`` and a
paged KV cache's block table. Each raises before any launch with a message naming the op,
the argument, the shapes or dtypes and the fix."""

from __future__ import annotations

import math

from deviceops.extend import DTypeError, ShapeError, Tensor, int32


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
