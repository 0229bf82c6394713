"""deviceops kernels: raw-PTX/CUDA kernels launched as DeviceOps.

Every kernel has a NumPy reference that the ``cpu`` backend runs, so results
are testable without a GPU. Launchers accept Tensors, Partitions, scalars and
DeviceOps producing tensors interchangeably (see :mod:`._launch`).
"""

from __future__ import annotations

from ._elementwise import add, mul, saxpy
from ._launch import KernelOp

__all__ = ["KernelOp", "add", "mul", "saxpy"]
