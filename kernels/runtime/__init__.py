"""The kernel runtime: the machinery every kernel family shares (families import it, never
each other).

| module              | what                                                                 |
|---------------------|----------------------------------------------------------------------|
| :mod:`._op`         | :class:`KernelOp`: how a launcher's arguments become a DeviceOp      |
| :mod:`._builder`    | ``check``/``body`` pairs to ops (Partition and DeviceOp arguments)   |
| :mod:`._spec`       | :class:`KernelSpec`: a launcher described once, planned per signature|
| :mod:`._plan`       | the one plan cache, keyed ``(device, op, statics, tensor signature)``|
| :mod:`._replay`     | recorded driver calls of a plan, replayed (part of its cache entry)  |
| :mod:`._driver`     | the one ``cuLaunchKernel`` path: typed cached arguments, PDL, replay |
| :mod:`._module`     | NVRTC compilation and module cache; ``#include`` inlining            |
| :mod:`._tma`        | ``CUtensorMap`` encoding and TMA kernel launches                     |
| :mod:`._workspace`  | the per-stream device scratch (split-K, split-KV)                    |
| :mod:`._rows`       | geometry and loading of the row-wise and vector kernels              |
| :mod:`._checks`     | argument checks several families share                               |
| :mod:`._cpu`, :mod:`._cpu_blas` | the cpu backend's mode, weight cache, activations; BLAS threads |
| :mod:`._override`   | typed overrides tests and benchmarks install (:func:`overrides`)     |
| ``include/``        | shared CUDA headers (``float16_types.cuh``, ``rows.cuh``, PTX helpers)|

**Plan cache and replays.** A kernel op's first call with a key ``(device, op, statics,
signature)`` checks its arguments and stores a :class:`._spec.Plan` in :mod:`._plan`; a CUDA
launcher with shape-dependent paths (``gemm``, ``flash_attention``, ``rms_norm``) stores its
launch plan in the same table under ``(("cuda", index), "<family>_cuda", statics, array
signature)``. On the ``cuda`` backend a plan's first execution per ``(stream, pointers)`` is
recorded and later ones replay it (:mod:`._replay`); those records live in the plan
(:attr:`._spec.Plan.replays`), so they are keyed by the same (device, op, statics,
signature) plus the stream and pointers, and go when the plan goes.
"""

from __future__ import annotations

from . import _plan as plan_cache
from ._op import KernelOp
from ._override import Override, overrides
from ._spec import KernelSpec
from ._workspace import reserve_workspace

__all__ = ["KernelOp", "KernelSpec", "Override", "overrides", "plan_cache", "reserve_workspace"]
