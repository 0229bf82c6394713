"""deviceops kernels: raw-PTX/CUDA kernels launched as DeviceOps.

Families, one folder each (the public launchers are re-exported here):

| family          | launchers                                                          |
|-----------------|--------------------------------------------------------------------|
| ``gemm``        | ``gemm``, ``matmul``                                               |
| ``attention``   | ``flash_attention``                                                |
| ``norms``       | ``rms_norm``, ``add_rms_norm``, ``layer_norm``                     |
| ``elementwise`` | ``saxpy``, ``add``, ``mul``, ``softmax``, ``gelu``, ``silu``, ``swiglu``, ``geglu`` |
| ``transformer`` | ``rope``, ``rope_kv_write``, ``merge_heads``, ``split_qkv``, ``qk_rms_norm`` |
| ``sampling``    | ``sample``, ``penalize``, ``mask_logits``, ``logprobs``            |
| ``lookup``      | ``embedding``, ``argmax``                                          |
| ``quant``       | ``qmatmul``, ``dequantize`` (weights in GGUF block formats)         |
| ``fused``       | ``FusedDecodeModel`` (a Llama-family decode step in one kernel)    |

Every family has the same parts, under the same names (where the part exists):

| file            | part                                                               |
|-----------------|--------------------------------------------------------------------|
| ``op.py``       | the launchers and their public signatures                          |
| ``_check.py``   | argument checks (run once per call, cached per signature)          |
| ``_plan.py``    | host planning (paths, tiles, splits, workspace) and its override   |
| ``_cuda.py``    | the CUDA launcher: kernel loading, launch plans, driver launches   |
| ``_reference.py`` | the float64 NumPy reference, the tests' oracle                   |
| ``_cpu.py``     | the ``cpu`` backend's float32 fast path                            |
| ``*.cu``, ``*.cuh`` | the family's CUDA sources                                      |

:mod:`.runtime` is the machinery they share (kernel specs, the one plan cache, the driver
launcher, module loading, TMA, workspace, replay, the cpu backend's mode and BLAS, shared
CUDA headers); a family imports only the runtime, itself and :mod:`deviceops.extend`.

Every kernel has a float64 NumPy reference; the ``cpu`` backend runs the float32 paths
checked against it (``DEVICEOPS_CPU_KERNELS=reference`` runs the references), so results
are testable without a GPU. Launchers accept Tensors, Partitions, scalars and DeviceOps
producing tensors interchangeably (see :mod:`.runtime._op`).

``deviceops.kernels.gemm`` is the ``gemm`` function; the family's package is reached by
``from deviceops.kernels.gemm import GemmOverride`` (and likewise for the others).
"""

from __future__ import annotations

from .attention.op import flash_attention
from .elementwise.op import add, geglu, gelu, mul, saxpy, silu, softmax, swiglu
from .fused.op import FusedDecodeModel, FusedLayer
from .gemm.op import gemm, matmul
from .lookup.op import argmax, embedding
from .norms.op import add_rms_norm, layer_norm, rms_norm
from .quant.op import dequantize, qmatmul
from .runtime._op import KernelOp
from .runtime._workspace import reserve_workspace
from .sampling.op import logprobs, mask_logits, penalize, sample
from .transformer.op import merge_heads, qk_rms_norm, rope, rope_kv_write, split_qkv

__all__ = [
    "FusedDecodeModel",
    "FusedLayer",
    "KernelOp",
    "add",
    "add_rms_norm",
    "argmax",
    "dequantize",
    "embedding",
    "flash_attention",
    "geglu",
    "gelu",
    "gemm",
    "layer_norm",
    "logprobs",
    "mask_logits",
    "matmul",
    "merge_heads",
    "mul",
    "qmatmul",
    "penalize",
    "qk_rms_norm",
    "reserve_workspace",
    "rms_norm",
    "rope",
    "rope_kv_write",
    "sample",
    "saxpy",
    "silu",
    "softmax",
    "split_qkv",
    "swiglu",
]
