"""The quant tests' formats and fresh random blocks (:mod:`deviceops.kernels.quant._reference`)."""

from __future__ import annotations

from deviceops.kernels.quant import FORMATS, random_blocks, random_packed

#: every format the quant family runs
ALL_FORMATS = tuple(FORMATS)

__all__ = ["ALL_FORMATS", "random_blocks", "random_packed"]
