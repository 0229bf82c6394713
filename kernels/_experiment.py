"""Kernel overrides for tests, sanitizers and benchmarks (not public API).

The production launchers (:func:`._gemm_cuda.gemm_cuda`,
:func:`._attention.flash_attention_cuda`) take no experiment keywords. A test or a
benchmark that must pin a path, a tile configuration or extra NVRTC defines says so with
one explicit object, installed process-wide for the duration of a ``with`` block::

    from deviceops.kernels._experiment import overrides

    with overrides(gemm_path="sm80:3"):          # the sm_80 kernel, 3 split-K slices
        gemm_cuda(a, b, out, workspace=ws, stream=s)
    with overrides(attention_path="splitkv"):    # the CUDA-core kernel whatever the shape
        flash_attention_cuda(q, k, v, out, stream=s)

The planners read :data:`ACTIVE` once per call (one module-global read; the object is part
of their plan-cache key, so a plan made under one set of overrides is never reused under
another). It is process-wide, not per thread or task: use it from one thread, around
launches, never in library code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["ACTIVE", "KernelOverrides", "current", "overrides", "set_overrides"]


@dataclass(frozen=True)
class KernelOverrides:
    """What a test or benchmark pins instead of the planners' choice (defaults: nothing).

    Attributes:
        gemm_path: ``"sm80"``, ``"simt"``, ``"skinny"`` or an sm_90 tile config
            (``"128x256"``, ``"128x128"``, ``"64x128"``; two-block clusters with B multicast
            ``"128x256c2"``, ``"128x128c2"``), optionally with ``":S"``: ``S``
            split-K slices (``"skinny:S"``: ``S`` k-split warps; ``"skinny:S:T:U"`` also ``T``
            16-row weight tiles per warp and ``U`` k-chunks per load round, 0 = planned;
            ``"tma"`` / ``"tma:S"`` / ... / ``"tma:S:ST:W:P:MC"``: the swapped-operand TMA
            skinny kernel, ``S`` K slices (0 = planned), ``ST`` ring stages, 2 to 10 (0 =
            planned), ``W`` consumer warpgroups of 64 weight rows, 1 or 2, ``P`` 1: persistent
            (one K slice, equal tile counts a block), 2: not, ``MC`` 2 or 4 blocks sharing the
            activation tile by TMA multicast (one K slice, not persistent).
            A path that cannot run the call raises ``ShapeError`` (sm_90 configs, skinny)
            or is ignored (``sm80`` for float32 without tf32, ``simt`` for 16-bit dtypes).
        gemm_sm90_defines: extra NVRTC ``-D`` defines for the sm_90 GEMM kernel.
        gemm_sm90_plain_epilogue: compile the convert-and-store-only epilogue for plain
            products (``False``: the general epilogue everywhere).
        gemm_sm90_tma_store: the sm_90 kernel stores its output through shared memory and
            TMA when it can (one K slice, ``beta == 0``); ``False``: from registers.
        attention_path: ``"splitkv"``: the CUDA-core split-KV kernel whatever the shape.
        attention_sm90_config: ``(BN, NWG, NSTAGE)`` of the sm_90 attention kernel.
        attention_sm90_defines: extra NVRTC defines for the sm_90 attention kernel
            (e.g. ``("-DATTN_VSPLIT=1",)``).
        attention_splitkv_defines: extra NVRTC defines for the split-KV kernel
            (e.g. ``("-DATTN_UK=8",)``).
        attention_split_min_steps: replaces ``SPLIT_MIN_STEPS`` (no split for a cache of
            at most this many block steps of keys).
        attention_split_blocks_per_sm: replaces ``SPLIT_BLOCKS_PER_SM`` (the split target).
        attention_split_warps: warps per split-KV block (4, 8 or 16) instead of the
            planner's choice.
        attention_cluster: split-KV merge in a thread-block cluster (sm_90): ``0`` never
            (workspace + combine kernel), ``2``/``4``/``8`` whenever the keys are split, at
            most that many splits (``None``: the planner's rule,
            ``_attention_plan.splitkv_cluster``).
    """

    gemm_path: str | None = None
    gemm_sm90_defines: tuple[str, ...] = ()
    gemm_sm90_plain_epilogue: bool = True
    gemm_sm90_tma_store: bool = True
    attention_path: str | None = None
    attention_sm90_config: tuple[int, int, int] | None = None
    attention_sm90_defines: tuple[str, ...] = ()
    attention_splitkv_defines: tuple[str, ...] = ()
    attention_split_min_steps: int | None = None
    attention_split_blocks_per_sm: int | None = None
    attention_split_warps: int | None = None
    attention_cluster: int | None = None

    def __post_init__(self) -> None:
        if self.attention_path not in (None, "splitkv"):
            raise ValueError(
                f"KernelOverrides: attention_path={self.attention_path!r}; use None or 'splitkv'"
            )
        if self.attention_split_warps not in (None, 4, 8, 16):
            raise ValueError(
                f"KernelOverrides: attention_split_warps={self.attention_split_warps!r}; "
                "use None, 4, 8 or 16"
            )
        if self.attention_cluster not in (None, 0, 2, 4, 8):
            raise ValueError(
                f"KernelOverrides: attention_cluster={self.attention_cluster!r}; "
                "use None, 0, 2, 4 or 8"
            )
        for name in ("gemm_sm90_defines", "attention_sm90_defines", "attention_splitkv_defines"):
            val = getattr(self, name)
            if not isinstance(val, tuple) or not all(isinstance(x, str) for x in val):
                raise TypeError(f"KernelOverrides: {name} must be a tuple of str, got {val!r}")


#: The overrides in force (the planners read this module global once per call).
ACTIVE: KernelOverrides = KernelOverrides()
#: The overrides of a process no experiment changed (kernel replays run only under these:
#: a recorded launch reflects the planners' choice, :mod:`._replay`).
DEFAULT: KernelOverrides = ACTIVE


def current() -> KernelOverrides:
    """The overrides in force now."""
    return ACTIVE


def set_overrides(ov: KernelOverrides) -> KernelOverrides:
    """Install ``ov`` process-wide; return the previous overrides (restore them after)."""
    global ACTIVE
    if not isinstance(ov, KernelOverrides):
        raise TypeError(f"set_overrides: expected KernelOverrides, got {type(ov).__name__}")
    prev, ACTIVE = ACTIVE, ov
    return prev


@contextmanager
def overrides(**fields: Any) -> Iterator[KernelOverrides]:
    """Install the current overrides with ``fields`` replaced for the ``with`` block.

    Args:
        **fields: :class:`KernelOverrides` fields (unknown names raise ``TypeError``).

    Yields:
        The overrides in force inside the block.
    """
    ov = dataclasses.replace(ACTIVE, **fields)
    prev = set_overrides(ov)
    try:
        yield ov
    finally:
        set_overrides(prev)
