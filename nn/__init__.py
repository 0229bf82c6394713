"""deviceops.nn: layers built on deviceops kernels (in progress; nothing public yet)."""

from __future__ import annotations

__all__: list[str] = []
