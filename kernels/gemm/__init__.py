"""The gemm family: ``gemm`` and ``matmul`` (:mod:`.op`), and what they are made of.

| part             | module              | what                                                    |
|------------------|---------------------|---------------------------------------------------------|
| op               | :mod:`.op`          | ``gemm``, ``matmul``: public signatures, the KernelSpec |
| checks           | :mod:`._check`      | dtypes, shapes, activation, layout                      |
| plan             | :mod:`._plan`       | path, tiles, split-K, workspace size; :class:`GemmOverride` |
| CUDA launcher    | :mod:`._cuda`       | kernel loading, launch plans, driver launches           |
| reference        | :mod:`._reference`  | float64 NumPy oracle                                    |
| cpu fast path    | :mod:`._cpu`        | float32 BLAS                                            |
| sources          | ``gemm_*.cu``, ``gemm_*.cuh`` | raw-PTX kernels; :mod:`._precompile` lists their variants |

Semantics (every backend, every path)::

    out[..., m, n] = act(alpha * sum_k a[..., m, k] * b[(...,) k, n]
                         + beta * out_prev[..., m, n] + bias[n])

* ``a``: ``(*batch, M, K)``; ``b``: ``(K, N)`` (shared by every batch entry) or
  ``(*batch, K, N)`` with the same leading dims as ``a``; ``out``: ``(*batch, M, N)``.
  With ``trans_b=True``, ``b`` is ``(N, K)`` / ``(*batch, N, K)`` (a Linear weight as
  checkpoints store it) and every path reads it as its transpose, without a copy.
  Any ``M, N, K >= 1``; every leading dim ``>= 1``. Inputs row-major C-contiguous:
  non-contiguous or transposed inputs are refused (``ShapeError``; fix: ``.copy()``).
* ``bias``: shape ``(N,)``, same dtype as ``a``, broadcast over all rows.
* ``out_prev`` is the value of ``out`` before the call; it is read only when
  ``beta != 0`` (so whatever ``out`` held, e.g. NaN, does not leak in when ``beta == 0``).
* ``act``: ``None``; ``"relu"`` ``max(x, 0)``; ``"gelu"`` the tanh approximation
  ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (torch ``approximate="tanh"``);
  ``"silu"`` ``x * sigmoid(x)``.
* dtypes: ``float16`` and ``bfloat16`` (``ml_dtypes.bfloat16``) with float32
  accumulation; ``float32`` on CUDA cores (FFMA) or, with ``tf32=True``, on tensor cores
  with operands rounded to tf32 (round to nearest, ties away). The output dtype is the
  input dtype; the epilogue runs in float32 and rounds once (round to nearest even).

CUDA paths (chosen by :func:`._plan.plan_path` once per problem: the plan is cached, see
:mod:`._cuda`; no allocation, no synchronisation, every launch on the ``stream``
handed in, so calls can be captured into CUDA graphs):

* ``gemm_sm90`` (sm_90a only: H100/H200): TMA (``cp.async.bulk.tensor``) + ``mbarrier``
  ring, one producer warpgroup and one or two consumer warpgroups issuing ``wgmma``
  (``setmaxnreg`` rebalances registers), persistent grid, tiles 128x256, 128x128 or
  64x128, split-K for small ``M * N``; with one K slice and ``beta == 0`` the epilogue
  stores through 128B-swizzled shared memory and TMA (else from registers). Needs ``K % 8 == 0``, ``N % 8 == 0``
  and 16-byte aligned base pointers (TMA strides); otherwise the sm_80 path runs.
* ``gemm_skinny`` (sm_80+): f16/bf16, ``trans_b``, at most 64 rows (decode, small
  batches), ``K % 8 == 0``: streams the ``(N, K)`` weight once with 16-byte loads straight
  into ``mma.sync`` fragments (``out^T = W a^T``, the k order permuted identically in both
  operands), warps of a block split K and reduce through shared memory, no workspace;
  :func:`._plan.skinny_config` (geometry from an H100 sweep).
* ``gemm_skinny_tma`` (sm_90a): f16/bf16, ``trans_b``, 17 to 64 rows on weights of 8 MB or
  more with ``N > 6144`` (wide projections, LM heads) or ``N <= 4096`` (narrow ones):
  ``out^T = W a^T`` with the weight as the ``wgmma`` A operand streamed through the TMA
  ring of ``gemm_sm90`` (64 or 128 weight rows a block: one or two consumer warpgroups) and
  the activation as B (rows padded to 32 or 64 by TMA zero fill); K may be split over a
  cluster and summed through distributed shared memory (one launch, no workspace,
  deterministic); for a short K over many tiles a persistent grid streams every tile of a
  block through one ring; for one wave of tiles a cluster of 4 shares each activation tile
  by TMA multicast; :func:`._plan.skinny_tma_config`.
* ``gemm_gemv`` (any sm): f16/bf16, b not transposed, at most 8 rows and ``N % 8 == 0``:
  CUDA-core FMA streaming B once, each half-warp reading 256 contiguous bytes of a row; on
  sm_90 a cluster of up to 8 blocks splits K and reduces through distributed shared memory
  (one launch, no workspace, deterministic); :func:`._plan.gemv_config`.
* ``gemm_sm80`` (sm_80+: A100, L4, H100, ...): ``cp.async`` 3-stage pipeline, ``ldmatrix``
  and ``mma.sync`` m16n8k16 (f16/bf16) or m16n8k8 (tf32); any shape and alignment.
* ``gemm_simt`` (any sm_70+): float32 FFMA register-tiled SGEMM (128x128x8 tiles).
* ``gemm_splitk_reduce``: sums float32 split-K partials from ``workspace`` and applies
  the epilogue.

On sm_90 every kernel above but ``gemm_sm80`` and ``gemm_simt`` is launched with
programmatic dependent launch (``cuLaunchKernelEx``, programmatic stream serialization):
it sets up its shared memory, waits for the previous kernel of the stream
(``griddepcontrol.wait``) before touching global memory, then lets the next kernel begin
launching, so launch latency and prologue overlap the previous kernel. ``DEVICEOPS_PDL=0``
turns it off (plain launches; the wait is then a no-op).

Supported architectures: sm_90 / sm_90a (all paths, wgmma for f16/bf16), sm_80, sm_86,
sm_89 (mma.sync / SIMT paths), sm_70+ for float32 without tf32. No cuBLAS, CUTLASS,
Triton or CuPy matmul is used in any kernel path.

Tests and benchmarks pin a path or a geometry with a :class:`GemmOverride` (installed by
:func:`deviceops.kernels.runtime.overrides`). The names below are re-exported for them (the
public launchers are :func:`deviceops.kernels.gemm` and :func:`deviceops.kernels.matmul`;
note that ``deviceops.kernels.gemm`` is the function: import this package's names with
``from deviceops.kernels.gemm import ...``).
"""

from __future__ import annotations

from ._check import ACTIVATIONS, _check_layout, gemm_check
from ._cpu import gemm_cpu
from ._cuda import gemm_cuda
from ._plan import (
    _NOMINAL_SMS,
    GEMV_MAX_M,
    SKINNY_MAX_M,
    SM90_CONFIGS,
    GemmOverride,
    _dims,
    gemm_workspace_nbytes,
    gemv_config,
    plan_path,
    skinny_config,
    skinny_tma_blocks_per_sm,
    skinny_tma_config,
    skinny_tma_smem,
)
from ._reference import _act_np, _round_tf32, gemm_reference

__all__ = [
    "ACTIVATIONS",
    "GemmOverride",
    "GEMV_MAX_M",
    "SKINNY_MAX_M",
    "SM90_CONFIGS",
    "_NOMINAL_SMS",
    "_act_np",
    "_check_layout",
    "_dims",
    "plan_path",
    "_round_tf32",
    "gemm_check",
    "gemm_cpu",
    "gemm_cuda",
    "gemm_reference",
    "gemm_workspace_nbytes",
    "gemv_config",
    "skinny_config",
    "skinny_tma_blocks_per_sm",
    "skinny_tma_config",
    "skinny_tma_smem",
]
