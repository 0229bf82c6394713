"""deviceops kernels: raw-PTX/CUDA kernels launched as DeviceOps.

Every kernel has a float64 NumPy reference, the tests' oracle; the ``cpu`` backend runs
float32 NumPy/BLAS paths checked against it (:mod:`._cpu_fast`;
``DEVICEOPS_CPU_KERNELS=reference`` runs the references), so results are testable without
a GPU. Launchers accept Tensors, Partitions, scalars and
DeviceOps producing tensors interchangeably (see :mod:`._launch`).
"""

from __future__ import annotations

from ._activation_ops import gelu, silu, softmax, swiglu
from ._attention_op import flash_attention
from ._elementwise import add, mul, saxpy
from ._gemm_op import gemm, matmul
from ._launch import KernelOp
from ._lookup_ops import argmax, embedding
from ._norm_ops import add_rms_norm, layer_norm, rms_norm
from ._rope_ops import merge_heads, rope, rope_kv_write
from ._sampling import sample
from ._workspace import reserve_workspace

__all__ = [
    "KernelOp",
    "add",
    "add_rms_norm",
    "argmax",
    "embedding",
    "flash_attention",
    "gelu",
    "gemm",
    "layer_norm",
    "matmul",
    "merge_heads",
    "mul",
    "reserve_workspace",
    "rms_norm",
    "rope",
    "rope_kv_write",
    "sample",
    "saxpy",
    "silu",
    "softmax",
    "swiglu",
]
