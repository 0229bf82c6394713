"""The attention family: ``flash_attention`` (:mod:`.op`), and what it is made of.

| part             | module              | what                                                    |
|------------------|---------------------|---------------------------------------------------------|
| op               | :mod:`.op`          | ``flash_attention``: public signature, the KernelSpec   |
| checks           | :mod:`._check`      | shapes, dtypes, ``kv_len``, ``block_table``             |
| plan             | :mod:`._plan`       | split-KV plan, workspace size, sm_90 configs; :class:`AttentionOverride` |
| CUDA launcher    | :mod:`._cuda`       | kernel loading, launch plans, driver launches           |
| reference        | :mod:`._reference`  | float64 NumPy oracle                                    |
| cpu fast path    | :mod:`._cpu`        | float32, one batched product per row                    |
| sources          | ``attn_*.cu``, ``attn_*.cuh`` | the sm_90 wgmma kernel and the split-KV kernels |

Semantics (shared by the ``cpu`` reference and the CUDA kernels):

* ``q`` ``(B, Hq, Lq, D)``, ``k``/``v`` ``(B, Hkv, Lk, D)``, ``Hq % Hkv == 0`` (GQA/MQA:
  query head ``h`` reads kv head ``h // (Hq // Hkv)``); output ``(B, Hq, Lq, D)`` in q's dtype.
* ``out = softmax(scale * q k^T) v`` with ``scale = 1/sqrt(D)`` by default; float32
  accumulation and softmax statistics.
* The queries are the LAST ``Lq`` positions of the key sequence: with ``causal=True`` query
  ``i`` (0-based in ``Lq``) sees keys ``j <= i + (Lk - Lq)`` (bottom-right aligned mask, as in
  decode with a KV cache). ``Lq > Lk`` is allowed; with ``causal=True`` the first
  ``Lq - Lk`` query rows see no key at all and their output is defined as **zeros** (no NaN).
  Without ``causal`` every query sees every key, whatever ``Lq`` and ``Lk`` are.
* ``kv_len`` (optional) int32 ``(B,)`` in device memory: the number of valid keys of batch
  row ``b`` (values are clamped to ``[0, Lk]``); keys at or past it are ignored, and the
  bottom-right alignment uses it in place of ``Lk``: with ``causal=True`` query ``i`` sees
  keys ``j <= kv_len[b] - Lq + i``. The kernels read it on the device and bound their key
  loops by it, so one captured graph serves every length of a growing KV cache and a cache
  of ``S`` rows holding 10 valid keys costs what ``Lk = 10`` costs.
* ``block_table`` (optional, paged KV cache; needs ``kv_len``): k/v are a block pool
  ``(num_blocks, Hkv, block_size, D)`` and ``block_table`` int32 ``(B, max_blocks)`` maps
  logical block ``n`` of row ``b`` (keys ``n*block_size .. (n+1)*block_size - 1``) to the
  physical block ``block_table[b, n]`` of the pool; the logical length is
  ``Lk = max_blocks * block_size``. Entries of blocks at or past ``kv_len[b]`` are never read.
  An entry outside ``[0, num_blocks)`` that is read is an error: the ``cpu`` reference raises
  ``IndexError``; the CUDA kernel clamps it into range (no out-of-bounds access).
* ``window`` (optional int >= 1, needs ``causal=True``): sliding-window attention (Gemma 3's
  local layers): query ``i`` at position ``p = i + kv_len[b] - Lq`` sees keys
  ``p - window < j <= p`` only, at most ``window`` of them. The kernels skip the keys before
  the window (the sm_90 kernel whole key tiles, the split-KV kernel each split's range), so a
  windowed decode step over a long cache costs what ``window`` keys cost.
* dtypes: float32, float16 or bfloat16 (``ml_dtypes.bfloat16``), the same for q, k, v and
  out. ``D`` must be a multiple of 8 and at most 256 (32, 64 and 128 are the model head dims).

CUDA paths (chosen per call, no allocation, no synchronisation, launches only on ``stream``;
the split-KV kernels go through ``cuLaunchKernelEx`` with programmatic dependent launch on
sm_90, so the combine kernel's launch overlaps the split kernel; ``DEVICEOPS_PDL=0`` turns
that off):

* ``attn_fwd_sm90`` (sm_90a): wgmma tensor-core kernel, 16-bit dtypes, ``Lq > 8``, unpaged.
* ``attn_splitkv`` (+ ``attn_splitkv_combine``): split-KV "flash-decoding" on CUDA cores for
  ``Lq <= 8`` (the KV length is split across blocks, partials merged by a second kernel; the
  split is recomputed on the device from ``kv_len``, and splits past it exit at once);
  also the portable path for every other case: float32 (fp32 storage and math), paged KV
  at any ``Lq``, and every shape on GPUs other than sm_90.

Tests and benchmarks pin a path or a configuration with an :class:`AttentionOverride`
(installed by :func:`deviceops.kernels.runtime.overrides`); the names below are re-exported
for them. CuPy is imported lazily: the package imports (and the reference runs) without it.
"""

from __future__ import annotations

from ._check import MAX_HEAD_DIM, attention_check, supported_dtypes
from ._cpu import attention_cpu
from ._cuda import flash_attention_cuda
from ._plan import (
    BULK_MIN_BW_PER_SM,
    BULK_MIN_STEPS,
    BULK_STAGES,
    CLUSTER_MAX,
    DECODE_MAX_LQ,
    MAX_SPLITS,
    SM90_CONFIGS,
    SPLIT_BLOCKS_PER_SM,
    SPLIT_GRANULE,
    SPLIT_MIN_STEPS,
    SPLITKV_MIN_BLOCKS,
    AttentionOverride,
    attention_workspace_nbytes,
    plan_splitkv,
    splitkv_bulk,
    splitkv_bulk_smem,
    splitkv_cluster,
    splitkv_warps,
)
from ._reference import attention_reference

__all__ = [
    "AttentionOverride",
    "BULK_MIN_BW_PER_SM",
    "BULK_MIN_STEPS",
    "BULK_STAGES",
    "CLUSTER_MAX",
    "DECODE_MAX_LQ",
    "MAX_HEAD_DIM",
    "MAX_SPLITS",
    "SM90_CONFIGS",
    "SPLITKV_MIN_BLOCKS",
    "SPLIT_BLOCKS_PER_SM",
    "SPLIT_GRANULE",
    "SPLIT_MIN_STEPS",
    "attention_check",
    "attention_cpu",
    "attention_reference",
    "attention_workspace_nbytes",
    "flash_attention_cuda",
    "plan_splitkv",
    "splitkv_bulk",
    "splitkv_bulk_smem",
    "splitkv_cluster",
    "splitkv_warps",
    "supported_dtypes",
]
