"""The elementwise family's launch plans: the last cuda launch of each of ``saxpy``,
``add`` and ``mul`` on each device, reused by an identical next call.

Stored in the one plan cache (:mod:`deviceops.kernels.runtime._plan`) under ``(device, op,
"last-launch" | "last-alloc", None)``: the entry is the last launch's plan with the
identities of its tensors (held weakly), its scalar and the output's tiling, and a call
reuses it only when all of them match (the signature is the identity check inside the entry:
tensors never change their memory or layout, so identity is enough). A loop that repeats
the same launch, the common case for tiny ops, skips validation, geometry and argument
packing. A plan holds the device, pointers and the launcher, never a tensor or storage:
the cache keeps nothing of the caller's alive, and a plan is used only on its own device.
"""

from __future__ import annotations

import weakref
from typing import Any

from deviceops.extend import Tensor, normalize_dtype

from ..runtime import _plan as plan_cache


class _EwPlan:
    """The cuda launch of one elementwise op: launcher, geometry, packed-argument tuple
    (an allocating op's: the arguments after the output pointer, and ``alloc`` = the
    output's ``(shape, dtype)``)."""

    __slots__ = ("alloc", "args", "block", "device", "entry", "grid", "ln", "spare")

    def __init__(self, device: Any, ln: Any, grid: Any, block: Any, args: tuple[Any, ...],
                 alloc: tuple[Any, Any] | None = None) -> None:
        self.device, self.ln, self.grid, self.block = device, ln, grid, block
        self.args, self.alloc = args, alloc
        # an allocating op's spare-array key (deviceops.extend.take_spare)
        self.spare = None if alloc is None else (alloc[0], id(normalize_dtype(alloc[1])))
        # the launcher's packed-parameter entry for ``args`` (kept alive here; None if the
        # launch was not packed by ``ln``, e.g. a PDL launch while capturing)
        self.entry: tuple[Any, ...] | None = ln._cache.get(args) if alloc is None else None


def _remember(name: str, w: Tensor, x: Tensor, y: Tensor | None, a: float, plan: _EwPlan,
              tile: tuple[int, ...] | None) -> None:
    plan_cache.store((plan.device, name, "last-launch", None),
                     (weakref.ref(w), weakref.ref(x), None if y is None else weakref.ref(y), a,
                      plan, tile))


def remember_alloc(name: str, x: Tensor, y: Tensor, plan: _EwPlan) -> None:
    """Record an allocating ``add``/``mul``: its inputs (weakly) and its plan less the
    output (see :func:`recall_alloc`)."""
    plan_cache.store((plan.device, name, "last-alloc", None),
                     (weakref.ref(x), weakref.ref(y), plan))


def recall_alloc(name: str, x: Tensor, y: Tensor) -> _EwPlan | None:
    """The plan of the last allocating launch of ``name`` on ``x``'s device if it had these
    inputs."""
    m = _entries.get((x._storage.device, name, "last-alloc", None))
    if m is not None and m[0]() is x and m[1]() is y:
        return m[2]
    return None


_entries = plan_cache._cache  # the hot path reads the table directly (no hit counting)


def _recall(name: str, w: Any, x: Any, y: Any, a: float,
            tile: tuple[int, ...] | None = None) -> _EwPlan | None:
    """The plan of the last launch of ``name`` on ``x``'s device if it had these tensors,
    scalar and tiling (``tile``: the output Partition's tile shape, ``None`` for a plain
    Tensor)."""
    m = _entries.get((x._storage.device, name, "last-launch", None))
    if m is None or m[3] != a or m[0]() is not w or m[1]() is not x or m[5] != tile:
        return None
    yr = m[2]
    if (yr() if yr is not None else None) is not y:
        return None
    return m[4]
