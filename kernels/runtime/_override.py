"""Overrides: what a test, sanitizer or benchmark pins instead of a planner's choice.

Not public API. A family with forced paths defines one frozen dataclass deriving from
:class:`Override` (:class:`deviceops.kernels.gemm.GemmOverride`,
:class:`deviceops.kernels.attention.AttentionOverride`), typed and validated on
construction: no strings to parse, no compiler flags. It is installed for a ``with`` block::

    from deviceops.kernels.gemm import GemmOverride
    from deviceops.kernels.runtime import overrides

    with overrides(GemmOverride(path="sm80", splits=3)):
        kernels.gemm(a, b).sync()

Planners read :func:`active` (one dictionary lookup per plan-cache miss) and put the object
in their plan-cache key, so a plan made under one override is never reused under another.
Kernel replays (:mod:`._replay`) are off while any override is installed: a recorded launch
reflects the planners' own choice. Process-wide, not per thread: use it from one thread,
around launches, never in library code.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["Override", "active", "any_active", "overrides"]


@dataclass(frozen=True)
class Override:
    """Base of the families' override dataclasses (one installed per class at a time)."""


_O = TypeVar("_O", bound=Override)
#: The overrides in force, by class (empty: every planner decides alone).
installed: dict[type[Override], Override] = {}


def active(kind: type[_O]) -> _O | None:
    """The installed override of class ``kind``, or ``None``."""
    got = installed.get(kind)
    return got  # type: ignore[return-value]


def any_active() -> bool:
    """Whether any override is installed (kernel replays are off then)."""
    return bool(installed)


@contextmanager
def overrides(*ovs: Override) -> Iterator[None]:
    """Install ``ovs`` (at most one per class) for the ``with`` block; the overrides in force
    before come back after it, also on error.

    Raises:
        TypeError: an argument is not an :class:`Override`.
    """
    for ov in ovs:
        if not isinstance(ov, Override):
            raise TypeError(f"overrides: expected Override instances (GemmOverride, "
                            f"AttentionOverride, ...), got {type(ov).__name__}")
    prev = dict(installed)
    installed.update({type(ov): ov for ov in ovs})
    try:
        yield
    finally:
        installed.clear()
        installed.update(prev)
