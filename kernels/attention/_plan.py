"""Flash attention: host-side planning (pure arithmetic, no CuPy): the path constants, the
split-KV launch plan, the workspace size and layout, the sm_90 tile configurations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..runtime._override import Override

__all__ = [
    "AttentionOverride",
    "BULK_MIN_BW_PER_SM",
    "BULK_MIN_STEPS",
    "BULK_STAGES",
    "CLUSTER_MAX",
    "DECODE_MAX_LQ",
    "MAX_SPLITS",
    "SM90_CONFIGS",
    "SPLITKV_MIN_BLOCKS",
    "SPLIT_BLOCKS_PER_SM",
    "SPLIT_GRANULE",
    "SPLIT_MIN_STEPS",
    "attention_workspace_nbytes",
    "logical_lk",
    "plan_splitkv",
    "sm90_smem_bytes",
    "splitkv_bulk",
    "splitkv_bulk_smem",
    "splitkv_cluster",
    "splitkv_warps",
    "ws_layout",
]

#: Query lengths up to this use the split-KV (decode) kernel.
DECODE_MAX_LQ = 8
#: Upper bound on KV splits (sizes the workspace).
MAX_SPLITS = 64
#: Keys per split are a multiple of this.
SPLIT_GRANULE = 64
#: The decode path splits the keys until at most this many 4-warp blocks per multiprocessor
#: run (one wave of 4 resident blocks; two waves measured slower: GQA 32/8 B8 Lk1k 21.6 ->
#: 19.3 us, SmolLM2 B8 Lk2k 16.0 -> 13.2 us; a row with fewer valid keys uses fewer splits,
#: see attn_splitkv.cu).
SPLIT_BLOCKS_PER_SM = 4
#: No split (and no combine launch) when Lk is at most this many block steps of keys: a
#: short cache costs less in one kernel than in two.
SPLIT_MIN_STEPS = 4
#: Most splits one thread-block cluster merges (sm_90: the portable cluster size).
CLUSTER_MAX = 8
#: Resident blocks per SM the 16-bit split-KV kernel is compiled for (__launch_bounds__).
SPLITKV_MIN_BLOCKS = 4
#: The split-KV kernel streams K/V through its bulk-copy ring (``ATTN_BULK``) on GPUs with at
#: least this peak DRAM bandwidth per SM (bytes/s): H200, 4.8 TB/s over 132 SMs, ~37 GB/s;
#: not H100 SXM, 3.35 TB/s, ~25 GB/s, where the ring measured slower.
BULK_MIN_BW_PER_SM = 30e9
#: ... and only for blocks of at least this many loop steps of keys (the ring's set-up and
#: first fill cost more than they win on a short range).
BULK_MIN_STEPS = 8
#: Stages of each warp's ring (3 measured slower than 2 at every H200 decode point).
BULK_STAGES = 2

#: sm_90 kernel configurations by padded head dim: (BN keys per tile, NWG warpgroups of 64
#: query rows, NSTAGE K/V buffers). Measured on H100 (benchmarks/RESULTS.md, attention).
SM90_CONFIGS: dict[int, tuple[int, int, int]] = {
    64: (64, 4, 4),
    128: (96, 3, 3),
    192: (64, 2, 2),
    256: (64, 2, 2),
}


def sm90_smem_bytes(dp: int, bn: int, nwg: int, nstage: int) -> int:
    """Dynamic shared memory of the sm_90 kernel: Q tiles, NSTAGE K and V tiles, barriers."""
    return 64 * nwg * dp * 2 + 2 * nstage * bn * dp * 2 + 1024


def _num_splits_upper(lk: int) -> int:
    return max(1, min(MAX_SPLITS, -(-lk // SPLIT_GRANULE)))


def attention_workspace_nbytes(
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    dtype: Any,
    *,
    block_table_shape: tuple[int, ...] | None = None,
) -> int:
    """Bytes of device workspace that lets ``flash_attention_cuda`` split the KV length.

    Non-zero only for the decode path (``Lq <= DECODE_MAX_LQ``): float32 partial outputs
    and (max, sum) pairs for up to ``MAX_SPLITS`` splits. Without it (``workspace=None``)
    the decode path still runs, unsplit and slower.

    Args:
        q_shape: ``(B, Hq, Lq, D)``.
        k_shape: ``(B, Hkv, Lk, D)`` (or the paged block pool).
        dtype: element dtype (does not change the size; partials are float32).
        block_table_shape: ``(B, max_blocks)`` for a paged cache (logical
            ``Lk = max_blocks * block_size``).

    Returns:
        Size in bytes (0 if the call needs none).
    """
    del dtype
    b, hq, lq, d = (int(x) for x in q_shape)
    lk = logical_lk(k_shape, block_table_shape)
    if lq > DECODE_MAX_LQ:
        return 0
    rows = b * hq * lq
    ns = _num_splits_upper(lk)
    return ws_layout(rows, ns, d)[2]


def logical_lk(k_shape: tuple[int, ...], block_table_shape: tuple[int, ...] | None) -> int:
    """Keys per row: ``Lk``, or ``max_blocks * block_size`` for a paged cache."""
    if block_table_shape is None:
        return int(k_shape[2])
    return int(block_table_shape[1]) * int(k_shape[2])


def plan_splitkv(
    b: int,
    hq: int,
    hkv: int,
    lq: int,
    lk: int,
    d: int,
    *,
    n_sm: int,
    split: bool,
    blocks_per_sm: int = SPLIT_BLOCKS_PER_SM,
    min_steps: int = SPLIT_MIN_STEPS,
    warps: int = 4,
) -> tuple[int, int, int]:
    """Launch plan of the split-KV kernel: ``(heads per block, head chunks, n_split)``.

    ``n_split`` is the most splits any batch row may use (the workspace stride; the kernel
    splits each row's own ``kv_len`` into at most that many). No split without a workspace
    (``split=False``), for ``Lq > DECODE_MAX_LQ``, or for a cache of at most
    ``min_steps`` block steps of keys; at most ``blocks_per_sm * n_sm`` blocks of 4 warps
    otherwise (blocks of ``warps`` warps count ``warps / 4`` each; benchmarks sweep all
    three through :class:`AttentionOverride`). Pure host arithmetic (tested on the cpu).
    """
    g = hq // hkv
    gt = _heads_per_block(g)
    n_hchunk = -(-g // gt)
    base_blocks = b * hkv * lq * n_hchunk
    n_split = 1
    if split and lq <= DECODE_MAX_LQ and lk > min_steps * _block_step(d, warps):
        # Round down: a grid just past a whole number of waves leaves a nearly empty last
        # wave (H100, B8 Lk32k GQA 32/8 D128: 17 splits = 1088 blocks 380 us; the same
        # kernel at 16 x 2048 keys = 1024 blocks 354.5 us).
        want = max(1, blocks_per_sm * n_sm * 4 // (warps * base_blocks))
        n_split = min(want, _num_splits_upper(lk))
    return gt, n_hchunk, n_split


def _heads_per_block(g: int) -> int:
    """Query heads one split-KV block serves: all ``g`` heads of a kv head when ``g <= 8``,
    else ``g`` cut into equal chunks of at most 8 (``g = 12``: two chunks of 6).

    Exactly ``g``, not ``g`` rounded up to a power of two: no block computes a head it does
    not write, and fewer heads leave registers for the K/V loads (H100, SmolLM2 9/3 heads of
    64: ``GT = 3`` instead of 4 was faster at every decode-table point,
    B32 Lk1k 15.42 -> 14.94 us, B8 Lk2k 12.93 -> 12.22 us, B1 Lk2k 10.78 -> 10.22 us).
    """
    chunks = -(-g // 8)
    return -(-g // chunks)


def splitkv_warps(
    b: int, hq: int, hkv: int, lq: int, lk: int, d: int, *, f32: bool, n_sm: int,
    forced: int | None = None, blocks_per_sm: int = SPLIT_BLOCKS_PER_SM,
) -> tuple[int, bool]:
    """Warps per split-KV block (4, 8 or 16) and whether the keys may be split.

    Blocks of more than 4 warps need 16-bit data, at most 4 heads per block and their
    per-warp partials within 32 KiB of shared memory. Measured on H100 (every decode-table
    point of ``benchmarks/attention.py --decode-tables``), with ``P`` the
    (batch row, kv head, query, head chunk) pairs and ``R = 16 n_sm`` the resident warps:

    * a cache of at most ``SPLIT_MIN_STEPS`` 4-warp steps: 8 warps, unsplit;
    * ``R / 2 <= P w <= R`` for ``w`` = 16 or 8: ``w`` warps, unsplit (one wave, no combine
      launch: SmolLM2 B32 Lk512 14.8 -> 10.5 us, GQA 32/8 B32 Lk1k 53.6 -> 48.7 us);
    * too few pairs for 4-warp splits (the split count would pass its cap) and a cache long
      enough for a full 16-warp step per split: 16 warps, split (GQA B1 Lk4k 16.6 -> 14.8 us);
    * otherwise 4 warps, split.

    ``forced`` (:attr:`AttentionOverride.split_warps`) must fit the same constraints;
    otherwise ``ValueError``.
    """
    gt = _heads_per_block(hq // hkv)

    def ok(w: int) -> bool:
        return w == 4 or (w in (8, 16) and not f32 and gt <= 4 and w * gt * d * 4 <= 32768)

    if forced is not None:
        if not ok(forced):
            raise ValueError(
                f"flash_attention: {forced} warps per split-KV block cannot serve head dim {d}, "
                f"{gt} heads per block, float32={f32}; use 4"
            )
        return forced, True
    if lq > DECODE_MAX_LQ or not ok(8):
        return 4, True
    pairs = b * hkv * lq * -(-(hq // hkv) // gt)
    resident = 16 * n_sm
    if lk <= SPLIT_MIN_STEPS * _block_step(d, 4):
        return 8, False
    for w in (16, 8):
        if ok(w) and resident <= 2 * pairs * w <= 2 * resident:
            return w, False
    want4 = blocks_per_sm * n_sm // pairs
    capped = want4 > min(MAX_SPLITS, _num_splits_upper(lk))
    if ok(16) and capped and 1 <= want4 // 4 <= lk // _block_step(d, 16):
        return 16, True
    return 4, True


def _block_step(d: int, warps: int = 4, uk: int = 4) -> int:
    """Keys one split-KV block covers per loop step (warps x keys per warp x ``uk``)."""
    lanes = 1
    while lanes < min(32, d // 8):
        lanes *= 2
    return warps * (32 // lanes) * uk


def splitkv_bulk(
    b: int, hq: int, hkv: int, lq: int, lk: int, d: int, *, warps: int, n_split: int,
    may_split: bool, n_sm: int, bw_per_sm: float,
) -> tuple[int, int, int]:
    """Whether the split-KV kernel streams K/V through its bulk-copy ring: ``(stages, warps,
    n_split)``, stages 0 = no (the plan unchanged).

    Call it only where the ring can run (sm_90, 16-bit contiguous K/V). The rule, from the
    H200 and H100 decode tables (benchmarks/RESULTS.md):

    * ``bw_per_sm >= BULK_MIN_BW_PER_SM`` and at least ``BULK_MIN_STEPS`` loop steps of keys
      per block: the ring (H200 GQA 32/8 D128 B32 Lk1k 39.8 -> 37.9 us);
    * and then 16-warp blocks, re-split for 16 warps, where each gets at least 64 steps, or
      at least 16 in one wave (blocks <= ``n_sm``): H200 B8 Lk32k 267 -> 250 us, B32 Lk32k
      1011 -> 954 us, B8 Lk4k 45.0 -> 42.6 us; at B32 Lk1k (8 steps) and B32 Lk4k (32 steps,
      two waves) 16 warps measured slower than the planned 8.

    Pure host arithmetic (tested on the cpu).
    """
    if bw_per_sm < BULK_MIN_BW_PER_SM or lq > DECODE_MAX_LQ:
        return 0, warps, n_split
    if -(-lk // n_split) < BULK_MIN_STEPS * _block_step(d, warps):
        return 0, warps, n_split
    gt = _heads_per_block(hq // hkv)
    if warps != 16 and gt <= 4 and 16 * gt * d * 4 <= 32768:
        gt, n_hchunk, ns16 = plan_splitkv(b, hq, hkv, lq, lk, d, n_sm=n_sm, split=may_split,
                                          warps=16)
        steps16 = -(-lk // ns16) // _block_step(d, 16)
        blocks16 = b * hkv * lq * n_hchunk * ns16
        if steps16 >= 64 or (steps16 >= 16 and blocks16 <= n_sm):
            return BULK_STAGES, 16, ns16
    return BULK_STAGES, warps, n_split


def splitkv_bulk_smem(d: int, warps: int, stages: int, gt: int, uk: int = 4) -> int:
    """Dynamic shared memory of the split-KV kernel's bulk-copy ring (``ATTN_BULK``):
    1024 bytes of mbarriers, then ``stages`` block steps of K and of V (16-bit), which the
    per-warp float32 partials of ``gt`` heads overlay after the key loop."""
    return 1024 + max(2 * stages * _block_step(d, warps, uk) * d * 2, warps * gt * d * 4)


def splitkv_cluster(n_split: int, cc: int, d: int, forced: int | None = None, groups: int = 0,
                    n_sm: int = 132) -> tuple[int, int]:
    """``(cluster size, n_split)``: how the split-KV partials of a row group are merged.

    Cluster size 1: through the workspace and the combine kernel (``n_split`` unchanged).
    Otherwise (sm_90) the split blocks of a row group form one thread-block cluster and
    merge through distributed shared memory (no workspace traffic, no second kernel), with
    the split rounded down to a power of two of at most ``CLUSTER_MAX``. The planner's rule,
    from an H100 sweep of the decode tables (``benchmarks/attention.py --decode-tables``
    under each ``AttentionOverride(cluster=...)``): head dim at most 64 and a planned split of 2 to
    ``2 * CLUSTER_MAX`` (SmolLM2 B8 Lk1k 11.3 -> 10.0 us, B1 Lk512 7.6 -> 6.9 us); head dim
    128 keeps the combine kernel (GQA 32/8 B8 Lk4k 52.8 -> 65.7 us in clusters of 8). A longer
    split is capped to a cluster only while the capped grid, ``groups`` row groups (blocks
    per split) x ``CLUSTER_MAX``, still fills ``n_sm`` SMs: SmolLM2 B8 Lk2k, 24 groups and 22
    splits, 13.34 -> 12.53 us in clusters of 8; B1 Lk2k, 3 groups and 32 splits, keeps the
    combine kernel (9.4 us; 10.0 in clusters of 8). ``groups`` = 0: unknown, no long splits.
    ``forced`` = 0: never; 2/4/8: whenever the keys are split, capping them at that many.
    Pure host arithmetic (tested on the cpu).
    """
    if cc < 90 or n_split <= 1 or forced == 0:
        return 1, n_split
    if forced is None and (d > 64 or (n_split > 2 * CLUSTER_MAX and groups * CLUSTER_MAX < n_sm)):
        return 1, n_split
    cap = CLUSTER_MAX if forced is None else forced
    cl = 2
    while cl * 2 <= min(n_split, cap):
        cl *= 2
    return cl, cl


def ws_layout(rows: int, n_split: int, d: int) -> tuple[int, int, int]:
    """(offset of partial outputs, offset of (m, l) pairs, total bytes) in the workspace."""
    o_bytes = rows * n_split * d * 4
    ml_off = (o_bytes + 255) // 256 * 256
    return 0, ml_off, ml_off + rows * n_split * 2 * 4


@dataclass(frozen=True)
class AttentionOverride(Override):
    """A flash-attention path or configuration pinned by a test or benchmark (every field:
    the planner's choice when left at its default). Installed with
    :func:`..runtime.overrides`.

    Attributes:
        path: ``"splitkv"``: the CUDA-core split-KV kernel whatever the shape.
        sm90_config: ``(BN, NWG, NSTAGE)`` of the sm_90 kernel instead of
            :data:`SM90_CONFIGS`' entry for the head dim.
        split_min_steps: replaces :data:`SPLIT_MIN_STEPS` (no split for a cache of at most
            this many block steps of keys).
        split_blocks_per_sm: replaces :data:`SPLIT_BLOCKS_PER_SM` (the split target).
        split_warps: warps per split-KV block (4, 8 or 16).
        cluster: split-KV merge in a thread-block cluster (sm_90): ``0`` never (workspace +
            combine kernel), ``2``/``4``/``8`` whenever the keys are split, at most that many
            splits (``None``: :func:`splitkv_cluster`'s rule).
        bulk_stages: stages of the split-KV kernel's bulk-copy K/V ring (``0``: none;
            ``None``: :func:`splitkv_bulk`'s rule); 16-bit contiguous K/V on sm_90.
    """

    path: str | None = None
    sm90_config: tuple[int, int, int] | None = None
    split_min_steps: int | None = None
    split_blocks_per_sm: int | None = None
    split_warps: int | None = None
    cluster: int | None = None
    bulk_stages: int | None = None

    def __post_init__(self) -> None:
        if self.path not in (None, "splitkv"):
            raise ValueError(f"AttentionOverride: path={self.path!r}; use None or 'splitkv'")
        if self.split_warps not in (None, 4, 8, 16):
            raise ValueError(f"AttentionOverride: split_warps={self.split_warps!r}; use None, "
                             "4, 8 or 16")
        if self.cluster not in (None, 0, 2, 4, 8):
            raise ValueError(f"AttentionOverride: cluster={self.cluster!r}; use None, 0, 2, 4 "
                             "or 8")
        if self.sm90_config is not None and (
                not isinstance(self.sm90_config, tuple) or len(self.sm90_config) != 3
                or not all(type(x) is int and x > 0 for x in self.sm90_config)):
            raise TypeError(f"AttentionOverride: sm90_config must be a (BN, NWG, NSTAGE) tuple "
                            f"of positive ints, got {self.sm90_config!r}")
        for name in ("split_min_steps", "split_blocks_per_sm", "bulk_stages"):
            v = getattr(self, name)
            if v is not None and (type(v) is not int or v < 0):
                raise TypeError(f"AttentionOverride: {name} must be None or an int >= 0, "
                                f"got {v!r}")
