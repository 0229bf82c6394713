"""CUDA graphs: capture a DeviceOp once, update its inputs, replay it.

See :class:`CudaGraph` and :func:`deviceops.DeviceOp.graph`.
"""

from __future__ import annotations

from . import _auto  # noqa: F401  (installs the auto_graph hook; see _hooks)
from ._graph import CudaGraph, capture, host_task

__all__ = ["CudaGraph", "capture", "host_task"]
