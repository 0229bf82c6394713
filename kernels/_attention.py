"""Flash attention forward: shape checks, NumPy reference, planning and CUDA launchers.

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

CuPy is imported lazily: the module imports (and the reference runs) without it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from deviceops._errors import DTypeError, ShapeError

from ._fastlaunch import Launcher, fast_kernel, launch_pdl, pdl_enabled
from ._module import expanded_source, load_module, set_max_dynamic_smem

__all__ = [
    "attention_check",
    "attention_reference",
    "attention_workspace_nbytes",
    "flash_attention_cuda",
]

#: Query lengths up to this use the split-KV (decode) kernel.
DECODE_MAX_LQ = 8
#: Upper bound on KV splits (sizes the workspace).
MAX_SPLITS = 64
#: Keys per split are a multiple of this.
SPLIT_GRANULE = 64
#: The decode path splits the keys until at most this many blocks per multiprocessor run
#: (two waves of 4 resident blocks; a row with fewer valid keys uses fewer splits, see
#: attn_splitkv.cu).
SPLIT_BLOCKS_PER_SM = 8
#: No split (and no combine launch) when Lk is at most this many block steps of keys: a
#: short cache costs less in one kernel than in two.
SPLIT_MIN_STEPS = 4
#: Resident blocks per SM the 16-bit split-KV kernel is compiled for (__launch_bounds__).
SPLITKV_MIN_BLOCKS = 4
#: Largest supported head dim.
MAX_HEAD_DIM = 256


def _bf16_dtype() -> np.dtype | None:
    try:
        import ml_dtypes
    except ImportError:  # pragma: no cover - ml_dtypes is a dependency
        return None
    return np.dtype(ml_dtypes.bfloat16)


def _supported_dtypes() -> tuple[np.dtype, ...]:
    base = (np.dtype(np.float32), np.dtype(np.float16))
    bf = _bf16_dtype()
    return base if bf is None else (*base, bf)


def _dtype_name(dt: Any) -> str:
    try:
        return str(np.dtype(dt))
    except TypeError:
        return repr(dt)


def attention_check(
    q_shape: tuple[int, ...],
    q_dtype: Any,
    k_shape: tuple[int, ...],
    k_dtype: Any,
    v_shape: tuple[int, ...],
    v_dtype: Any,
    *,
    out_shape: tuple[int, ...] | None = None,
    out_dtype: Any = None,
    kv_len_shape: tuple[int, ...] | None = None,
    kv_len_dtype: Any = None,
    block_table_shape: tuple[int, ...] | None = None,
    block_table_dtype: Any = None,
    op: str = "flash_attention",
) -> tuple[tuple[int, ...], np.dtype]:
    """Validate flash-attention arguments before anything is launched.

    Args:
        q_shape: ``(B, Hq, Lq, D)``.
        q_dtype: dtype of q (float32, float16 or bfloat16).
        k_shape: ``(B, Hkv, Lk, D)``; with ``block_table``, the block pool
            ``(num_blocks, Hkv, block_size, D)``.
        k_dtype: dtype of k (same as q).
        v_shape: same as ``k_shape``.
        v_dtype: dtype of v (same as q).
        out_shape: shape of a caller-provided output, if any (must equal ``q_shape``).
        out_dtype: dtype of a caller-provided output, if any (must equal q's).
        kv_len_shape: shape of ``kv_len`` if given (must be ``(B,)``).
        kv_len_dtype: dtype of ``kv_len`` if given (must be int32).
        block_table_shape: shape of ``block_table`` if given (``(B, max_blocks)``).
        block_table_dtype: dtype of ``block_table`` if given (must be int32).
        op: operation name used in error messages.

    Returns:
        ``(out_shape, out_dtype)``.

    Raises:
        ShapeError: ranks, batch/head/length/head-dim mismatches, ``Hq % Hkv != 0``,
            empty dims, head dim not a multiple of 8 or above 256, wrong ``out``,
            ``kv_len`` or ``block_table`` shape, ``block_table`` without ``kv_len``.
        DTypeError: unsupported or mismatched dtypes (``kv_len``/``block_table``: int32).
    """
    q_shape, k_shape, v_shape = tuple(q_shape), tuple(k_shape), tuple(v_shape)
    paged = block_table_shape is not None
    shapes = f"q {q_shape}, k {k_shape}, v {v_shape}"
    if paged:
        shapes += f", block_table {tuple(block_table_shape or ())}"
    for name, shp in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(shp) != 4:
            kind = "(num_blocks, Hkv, block_size, D)" if paged and name != "q" else "(B, H, L, D)"
            raise ShapeError(f"{op}: {name} must be 4-D {kind}; got {shapes}", op=op)
        if any(int(s) < 1 for s in shp):
            raise ShapeError(f"{op}: every dimension must be >= 1; got {shapes}", op=op)
    b, hq, _lq, d = q_shape
    bk, hkv, _lk, dk = k_shape
    if k_shape != v_shape:
        raise ShapeError(f"{op}: k and v shapes must be equal; got {shapes}", op=op)
    if not paged and b != bk:
        raise ShapeError(f"{op}: batch sizes differ (q B={b}, k/v B={bk}); got {shapes}", op=op)
    if d != dk:
        raise ShapeError(f"{op}: head dims differ (q D={d}, k/v D={dk}); got {shapes}", op=op)
    if hq % hkv != 0:
        raise ShapeError(
            f"{op}: query heads must be a multiple of kv heads (Hq={hq}, Hkv={hkv}); got {shapes}",
            op=op,
        )
    if d % 8 != 0 or d > MAX_HEAD_DIM:
        raise ShapeError(
            f"{op}: head dim must be a multiple of 8 and <= {MAX_HEAD_DIM} (got D={d}); {shapes}",
            op=op,
        )
    dts = {"q": q_dtype, "k": k_dtype, "v": v_dtype}
    try:
        ndts = {n: np.dtype(t) for n, t in dts.items()}
    except TypeError as exc:
        raise DTypeError(f"{op}: unknown dtype among {dts}", op=op) from exc
    supported = _supported_dtypes()
    if ndts["q"] not in supported:
        raise DTypeError(
            f"{op}: q dtype {ndts['q']} not supported (float32, float16, bfloat16); "
            f"q {ndts['q']}, k {ndts['k']}, v {ndts['v']}",
            op=op,
        )
    if ndts["k"] != ndts["q"] or ndts["v"] != ndts["q"]:
        raise DTypeError(
            f"{op}: q, k, v dtypes must match; q {ndts['q']}, k {ndts['k']}, v {ndts['v']}",
            op=op,
        )
    if out_shape is not None and tuple(out_shape) != q_shape:
        raise ShapeError(f"{op}: out shape {tuple(out_shape)} must equal q shape {q_shape}", op=op)
    if out_dtype is not None:
        try:
            odt = np.dtype(out_dtype)
        except TypeError as exc:
            raise DTypeError(f"{op}: unknown out dtype {out_dtype!r}", op=op) from exc
        if odt != ndts["q"]:
            raise DTypeError(f"{op}: out dtype {odt} must equal q dtype {ndts['q']}", op=op)
    _check_index_arg(op, "kv_len", kv_len_shape, kv_len_dtype, (b,), "(B,)", q_shape)
    if paged:
        if kv_len_shape is None:
            raise ShapeError(
                f"{op}: a paged KV cache (block_table {tuple(block_table_shape or ())}) needs "
                "kv_len, the int32 (B,) number of valid keys of each row; pass kv_len=",
                op=op,
            )
        bt = tuple(block_table_shape or ())
        if len(bt) != 2 or bt[0] != b or bt[1] < 1:
            raise ShapeError(
                f"{op}: block_table must be (B, max_blocks) = ({b}, >= 1) for q {q_shape}; "
                f"got {bt}",
                op=op,
            )
        _check_index_arg(op, "block_table", bt, block_table_dtype, bt, "(B, max_blocks)", q_shape)
    return q_shape, ndts["q"]


def _check_index_arg(
    op: str,
    name: str,
    shape: tuple[int, ...] | None,
    dtype: Any,
    want: tuple[int, ...],
    want_s: str,
    q_shape: tuple[int, ...],
) -> None:
    if shape is None:
        return
    if tuple(shape) != want:
        raise ShapeError(
            f"{op}: {name} must have shape {want_s} = {want} for q {q_shape}; got {tuple(shape)}",
            op=op,
        )
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise DTypeError(f"{op}: unknown {name} dtype {dtype!r}; use int32", op=op) from exc
    if dt != np.dtype(np.int32):
        raise DTypeError(
            f"{op}: {name} must be int32 (got {dt}, shape {tuple(shape)}); convert it with "
            "api.convert(t, 'int32')",
            op=op,
        )


def _logical_kv(
    k: np.ndarray, v: np.ndarray, kv_len: np.ndarray | None, block_table: np.ndarray | None
) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """Per batch row: (k rows, v rows) of the valid keys ``(Hkv, n_b, D)`` and ``n_b``."""
    if block_table is None:
        b, _hkv, lk, _d = k.shape
        lens = np.full(b, lk, np.int64) if kv_len is None else np.clip(kv_len, 0, lk)
        ks = [k[bi, :, : int(lens[bi])] for bi in range(b)]
        vs = [v[bi, :, : int(lens[bi])] for bi in range(b)]
        return ks, vs, lens.astype(np.int64)
    assert kv_len is not None
    nb, hkv, bs, d = k.shape
    b, mb = block_table.shape
    lens = np.clip(kv_len.astype(np.int64), 0, mb * bs)
    ks, vs = [], []
    for bi in range(b):
        n_blk = -(-int(lens[bi]) // bs)
        ids = block_table[bi, :n_blk].astype(np.int64)
        bad = (ids < 0) | (ids >= nb)
        if bad.any():
            raise IndexError(
                f"flash_attention: block_table[{bi}] holds block {int(ids[bad][0])}, outside the "
                f"pool of {nb} blocks (kv_len[{bi}] = {int(lens[bi])} reads its first {n_blk} "
                "entries)"
            )
        kk = k[ids].transpose(1, 0, 2, 3).reshape(hkv, n_blk * bs, d)[:, : int(lens[bi])]
        vv = v[ids].transpose(1, 0, 2, 3).reshape(hkv, n_blk * bs, d)[:, : int(lens[bi])]
        ks.append(kk)
        vs.append(vv)
    return ks, vs, lens


def attention_reference(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    causal: bool = False,
    scale: float | None = None,
    kv_len: np.ndarray | None = None,
    block_table: np.ndarray | None = None,
) -> np.ndarray:
    """NumPy flash-attention forward (float64 math), returned in ``q.dtype``.

    The ``cpu`` backend runs exactly this. Semantics are in the module docstring
    (GQA, bottom-right causal mask, fully masked rows give zeros, ``kv_len``, paged KV).

    Args:
        q: ``(B, Hq, Lq, D)``.
        k: ``(B, Hkv, Lk, D)``, or the block pool ``(num_blocks, Hkv, block_size, D)``.
        v: same shape as ``k``.
        causal: apply the bottom-right aligned causal mask.
        scale: softmax scale; ``1/sqrt(D)`` when None.
        kv_len: optional integer ``(B,)``: valid keys per batch row (clamped to ``[0, Lk]``).
        block_table: optional integer ``(B, max_blocks)`` (paged KV; needs ``kv_len``).

    Returns:
        ``(B, Hq, Lq, D)`` array of q's dtype.

    Raises:
        ShapeError: incompatible shapes.
        IndexError: a ``block_table`` entry that is read lies outside the pool.
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ShapeError(
            f"flash_attention: q, k, v must be 4-D; got q {q.shape}, k {k.shape}, v {v.shape}",
            op="flash_attention",
        )
    b, hq, lq, d = q.shape
    hkv = k.shape[1]
    bad_batch = block_table is None and k.shape[0] != b
    if block_table is not None and (kv_len is None or block_table.shape[0] != b):
        bad_batch = True
    if k.shape != v.shape or bad_batch or k.shape[3] != d or hkv < 1 or hq % hkv:
        raise ShapeError(
            f"flash_attention: incompatible shapes q {q.shape}, k {k.shape}, v {v.shape}"
            + ("" if block_table is None else f", block_table {block_table.shape}"),
            op="flash_attention",
        )
    g = hq // hkv
    sc = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = np.zeros((b, hq, lq, d), dtype=np.float64)
    ks, vs, lens = _logical_kv(k, v, kv_len, block_table)
    qi = np.arange(lq)[:, None]
    for bi in range(b):
        n = int(lens[bi])
        if n == 0:
            continue
        visible = np.arange(n)[None, :] <= qi + (n - lq)  # (Lq, n)
        for hk in range(hkv):
            kk = ks[bi][hk].astype(np.float64)  # (n, D)
            vv = vs[bi][hk].astype(np.float64)  # (n, D)
            qq = q[bi, hk * g : (hk + 1) * g].astype(np.float64)  # (g, Lq, D)
            s = (qq @ kk.T) * sc  # (g, Lq, n)
            if causal:
                s = np.where(visible[None], s, -np.inf)
            m = s.max(axis=-1, keepdims=True)
            m = np.where(np.isfinite(m), m, 0.0)
            p = np.exp(s - m)
            denom = p.sum(axis=-1, keepdims=True)
            o = p @ vv
            out[bi, hk * g : (hk + 1) * g] = np.divide(
                o, denom, out=np.zeros_like(o), where=denom > 0
            )
    return out.astype(q.dtype)


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
    lk = _logical_lk(k_shape, block_table_shape)
    if lq > DECODE_MAX_LQ:
        return 0
    rows = b * hq * lq
    ns = _num_splits_upper(lk)
    return _ws_layout(rows, ns, d)[2]


def _logical_lk(k_shape: tuple[int, ...], block_table_shape: tuple[int, ...] | None) -> int:
    if block_table_shape is None:
        return int(k_shape[2])
    return int(block_table_shape[1]) * int(k_shape[2])


def plan_splitkv(
    b: int, hq: int, hkv: int, lq: int, lk: int, d: int, *, n_sm: int, split: bool
) -> tuple[int, int, int]:
    """Launch plan of the split-KV kernel: ``(heads per block, head chunks, n_split)``.

    ``n_split`` is the most splits any batch row may use (the workspace stride; the kernel
    splits each row's own ``kv_len`` into at most that many). No split without a workspace
    (``split=False``), for ``Lq > DECODE_MAX_LQ``, or for a cache of at most
    ``SPLIT_MIN_STEPS`` block steps of keys. Pure host arithmetic (tested on the cpu).
    """
    g = hq // hkv
    gt = 1
    while gt < min(g, 8):
        gt *= 2
    n_hchunk = -(-g // gt)
    base_blocks = b * hkv * lq * n_hchunk
    n_split = 1
    if split and lq <= DECODE_MAX_LQ and lk > SPLIT_MIN_STEPS * _block_step(d):
        # Round down: a grid just past a whole number of waves leaves a nearly empty last
        # wave (H100, B8 Lk32k GQA 32/8 D128: 17 splits = 1088 blocks 380 us; the same
        # kernel at 16 x 2048 keys = 1024 blocks 354.5 us, benchmarks/RESULTS-attention.md).
        want = max(1, SPLIT_BLOCKS_PER_SM * n_sm // base_blocks)
        n_split = min(want, _num_splits_upper(lk))
    return gt, n_hchunk, n_split


def _block_step(d: int) -> int:
    """Keys one split-KV block covers per loop step (4 warps x keys per warp x 4)."""
    lanes = 1
    while lanes < min(32, d // 8):
        lanes *= 2
    return 4 * (32 // lanes) * 4


def _ws_layout(rows: int, n_split: int, d: int) -> tuple[int, int, int]:
    """(offset of partial outputs, offset of (m, l) pairs, total bytes) in the workspace."""
    o_bytes = rows * n_split * d * 4
    ml_off = (o_bytes + 255) // 256 * 256
    return 0, ml_off, ml_off + rows * n_split * 2 * 4


# --------------------------------------------------------------------------------------
# Sources and modules
# --------------------------------------------------------------------------------------

#: sm_90 kernel configurations by padded head dim: (BN keys per tile, NWG warpgroups of 64
#: query rows, NSTAGE K/V buffers). Measured on H100, see benchmarks/RESULTS-attention.md.
SM90_CONFIGS: dict[int, tuple[int, int, int]] = {
    64: (64, 4, 4),
    128: (96, 3, 3),
    192: (64, 2, 2),
    256: (64, 2, 2),
}

_kernels: dict[tuple[Any, ...], Any] = {}
#: Extra NVRTC defines for the sm_90 kernel (experiments only, e.g. ``("-DATTN_VSPLIT=1",)``).
EXTRA_SM90_DEFINES: tuple[str, ...] = ()
#: Extra NVRTC defines for the split-KV kernel (experiments only, e.g. ``("-DATTN_UK=8",)``).
EXTRA_SPLITKV_DEFINES: tuple[str, ...] = ()


def _sm90_smem_bytes(dp: int, bn: int, nwg: int, nstage: int) -> int:
    return 64 * nwg * dp * 2 + 2 * nstage * bn * dp * 2 + 1024


def _sm90_kernel(
    device_id: int, dp: int, bn: int, nwg: int, nstage: int, bf16: bool, scale_pos: bool
) -> Any:
    key = ("sm90", device_id, dp, bn, nwg, nstage, bf16, scale_pos, EXTRA_SM90_DEFINES)
    fn = _kernels.get(key)
    if fn is None:
        opts = (
            f"-DATTN_DP={dp}",
            f"-DATTN_BN={bn}",
            f"-DATTN_NWG={nwg}",
            f"-DATTN_NSTAGE={nstage}",
            f"-DATTN_SCALE_POS={int(scale_pos)}",
            f"-DATTN_BF16={int(bf16)}",
            *EXTRA_SM90_DEFINES,
        )
        mod = load_module(
            expanded_source("attn_fwd_sm90.cu"),
            options=opts,
            device_id=device_id,
            arch_suffix="a",
        )
        raw = mod.get_function("attn_fwd_sm90")
        set_max_dynamic_smem(raw, _sm90_smem_bytes(dp, bn, nwg, nstage))
        fn = _kernels[key] = fast_kernel(raw, "attn_fwd_sm90", device_id)
    return fn


def _splitkv_kernels(
    device_id: int, d: int, gt: int, bf16: bool, f32: bool, paged: bool
) -> tuple[Any, Any]:
    key = ("splitkv", device_id, d, gt, bf16, f32, paged, EXTRA_SPLITKV_DEFINES)
    fns = _kernels.get(key)
    if fns is None:
        opts = (
            f"-DATTN_D={d}",
            f"-DATTN_GT={gt}",
            f"-DATTN_BF16={int(bf16)}",
            f"-DATTN_F32={int(f32)}",
            f"-DATTN_PAGED={int(paged)}",
            f"-DATTN_GRANULE={SPLIT_GRANULE}",
            *EXTRA_SPLITKV_DEFINES,
        )
        overridden = any(o.startswith("-DATTN_MINB") for o in EXTRA_SPLITKV_DEFINES)
        if not f32 and gt <= 4 and not overridden:
            # 128 registers: 4 resident blocks per SM instead of 3 (measured on H100:
            # B1 Lk32k GQA 32/8 D128 67.8 -> 56.5 us); float32 and 8 heads/block would spill.
            opts = (*opts, f"-DATTN_MINB={SPLITKV_MIN_BLOCKS}")
        mod = load_module(expanded_source("attn_splitkv.cu"), options=opts, device_id=device_id)
        raw = (mod.get_function("attn_splitkv"), mod.get_function("attn_splitkv_combine"))
        fns = (
            Launcher(raw[0], "pppppppp" + "iiiifiiiiii", "attn_splitkv", device_id),
            Launcher(raw[1], "pppp" + "iii", "attn_splitkv_combine", device_id),
        )
        _kernels[key] = fns
        _kernels[(*key, "raw")] = raw  # keeps the CuPy function objects alive
    return fns


@functools.cache
def _device_info(device_id: int) -> tuple[int, int]:
    """(compute capability as int, e.g. 90; multiprocessor count)."""
    import cupy

    dev = cupy.cuda.Device(device_id)
    return int(dev.compute_capability), int(dev.attributes["MultiProcessorCount"])


def _check_array(name: str, a: Any, device_id: int, align: int = 16) -> None:
    if not a.flags.c_contiguous:
        raise ShapeError(
            f"flash_attention: {name} must be C-contiguous (got strides {a.strides} for shape "
            f"{a.shape}); pass cupy.ascontiguousarray({name})",
            op="flash_attention",
        )
    if a.data.ptr % align:
        raise ShapeError(
            f"flash_attention: {name} data pointer must be {align}-byte aligned",
            op="flash_attention",
        )
    if a.device.id != device_id:
        raise ShapeError(
            f"flash_attention: {name} is on device {a.device.id}, q on device {device_id}",
            op="flash_attention",
        )


def flash_attention_cuda(
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    *,
    causal: bool = False,
    scale: float | None = None,
    kv_len: Any = None,
    block_table: Any = None,
    workspace: Any = None,
    stream: Any,
    _sm90_config: tuple[int, int, int] | None = None,
    _force_splitkv: bool = False,
) -> None:
    """Enqueue flash attention on ``stream`` (CuPy arrays; no allocation, no sync).

    Args:
        q: ``(B, Hq, Lq, D)`` cupy array, float32, float16 or bfloat16, C-contiguous.
        k: ``(B, Hkv, Lk, D)`` cupy array, same dtype; with ``block_table``, the block pool
            ``(num_blocks, Hkv, block_size, D)``.
        v: same shape and dtype as ``k``.
        out: ``(B, Hq, Lq, D)`` cupy array to write, same dtype.
        causal: bottom-right aligned causal mask (see module docstring).
        scale: softmax scale, ``1/sqrt(D)`` when None.
        kv_len: optional int32 ``(B,)`` cupy array: valid keys per batch row, read on the
            device (never on the host).
        block_table: optional int32 ``(B, max_blocks)`` cupy array (paged KV; needs
            ``kv_len``).
        workspace: device buffer (cupy array) of at least
            :func:`attention_workspace_nbytes` bytes, or None (decode runs unsplit).
        stream: the ``cupy.cuda.Stream`` every launch goes to.
        _sm90_config: benchmarking override ``(BN, NWG, NSTAGE)`` for the sm_90 kernel.
        _force_splitkv: use the CUDA-core split-KV kernel whatever the shape (tests).

    Raises:
        ShapeError, DTypeError: before any launch.
    """
    bt = block_table
    key = (q.shape, k.shape, v.shape, out.shape, q.dtype, k.dtype, v.dtype, out.dtype,
           q.strides, k.strides, v.strides, out.strides, q.device.id,
           None if kv_len is None else (kv_len.shape, kv_len.dtype, kv_len.strides),
           None if bt is None else (bt.shape, bt.dtype, bt.strides),
           bool(causal), scale, None if workspace is None else workspace.nbytes,
           _sm90_config, _force_splitkv)  # fmt: skip
    plan = _plans.get(key)
    if plan is None:
        plan = _plan(q, k, v, out, causal, scale, kv_len, bt, workspace, _sm90_config,
                     _force_splitkv)
        if len(_plans) >= _PLANS_MAX:
            del _plans[next(iter(_plans))]
        _plans[key] = plan
    for name, a, align in (("q", q, 16), ("k", k, 16), ("v", v, 16), ("out", out, 16),
                           ("kv_len", kv_len, 4), ("block_table", bt, 4)):
        if a is not None and a.data.ptr % align:
            _check_array(name, a, q.device.id, align)  # raises, naming the array
    plan(q, k, v, out, kv_len, bt, workspace, stream)


_PLANS_MAX = 1024
_Plan = Callable[[Any, Any, Any, Any, Any, Any, Any, Any], None]
_plans: dict[Any, _Plan] = {}


def _plan(q: Any, k: Any, v: Any, out: Any, causal: bool, scale: float | None, kv_len: Any,
          block_table: Any, workspace: Any, sm90_config: tuple[int, int, int] | None,
          force_splitkv: bool) -> _Plan:
    """Validate one problem and choose its path, kernels, grid and workspace layout, once;
    return the per-call launch (pointers only)."""
    attention_check(
        q.shape, q.dtype, k.shape, k.dtype, v.shape, v.dtype,
        out_shape=out.shape, out_dtype=out.dtype,
        kv_len_shape=None if kv_len is None else kv_len.shape,
        kv_len_dtype=None if kv_len is None else kv_len.dtype,
        block_table_shape=None if block_table is None else block_table.shape,
        block_table_dtype=None if block_table is None else block_table.dtype,
    )  # fmt: skip
    device_id = q.device.id
    named = [("q", q), ("k", k), ("v", v), ("out", out)]
    named += [] if kv_len is None else [("kv_len", kv_len)]
    named += [] if block_table is None else [("block_table", block_table)]
    for name, a in named:
        _check_array(name, a, device_id, 4 if name in ("kv_len", "block_table") else 16)
    b, hq, lq, d = (int(x) for x in q.shape)
    hkv = int(k.shape[1])
    paged = block_table is not None
    lk = _logical_lk(tuple(k.shape), None if block_table is None else tuple(block_table.shape))
    dt = np.dtype(q.dtype)
    f32 = dt == np.dtype(np.float32)
    bf16 = not f32 and dt != np.dtype(np.float16)
    sc = 1.0 / math.sqrt(d) if scale is None else float(scale)
    scale_log2 = np.float32(sc * math.log2(math.e))
    cc, n_sm = _device_info(device_id)
    i32 = np.int32
    causal_i = int(bool(causal))

    if cc == 90 and lq > DECODE_MAX_LQ and not (force_splitkv or f32 or paged):
        dp = -(-d // 64) * 64
        bn, nwg, nstage = sm90_config or SM90_CONFIGS[dp]
        fn = _sm90_kernel(device_id, dp, bn, nwg, nstage, bf16, sc > 0)
        bm = 64 * nwg
        n_mblk = -(-lq // bm)
        if n_mblk > 65535:
            raise ShapeError(
                f"flash_attention: Lq={lq} too long for one launch", op="flash_attention"
            )
        grid, block = (b * hq, n_mblk, 1), (128 * nwg, 1, 1)
        smem = _sm90_smem_bytes(dp, bn, nwg, nstage)
        tail9: tuple[Any, ...] = (i32(hq), i32(hkv), i32(lq), i32(lk), i32(d), scale_log2,
                                  i32(causal_i), i32(n_mblk))

        def run_sm90(q: Any, k: Any, v: Any, out: Any, kv_len: Any, bt: Any, ws: Any,
                     stream: Any) -> None:
            kvl = np.uint64(0) if kv_len is None else np.uint64(kv_len.data.ptr)
            fn(grid, block, (q, k, v, out, kvl, *tail9), stream=stream, shared_mem=smem)

        return run_sm90

    # Split-KV path (decode, float32, paged, or the portable fallback). n_split is the most
    # splits any row may use (the workspace stride); the kernel splits each row's kv_len.
    gt, n_hchunk, n_split = plan_splitkv(
        b, hq, hkv, lq, lk, d, n_sm=n_sm, split=workspace is not None
    )
    x_blocks = hkv * lq * n_hchunk
    rows = b * hq * lq
    o_off = ml_off = 0
    if n_split > 1:
        o_off, ml_off, need = _ws_layout(rows, n_split, d)
        if workspace.nbytes < need:
            n_split = 1
    if x_blocks > 2**31 - 1 or n_split > 65535 or b > 65535:
        raise ShapeError(
            f"flash_attention: shape {q.shape} too large for one launch", op="flash_attention"
        )
    if paged:
        mb, bs, nb = int(block_table.shape[1]), int(k.shape[2]), int(k.shape[0])
    else:
        mb, bs, nb = 0, 0, 0
    fn, combine = _splitkv_kernels(device_id, d, gt, bf16, f32, paged)
    # Both kernels go through cuLaunchKernelEx with programmatic dependent launch on sm_90
    # (each waits with griddepcontrol.wait before touching memory), so the combine kernel's
    # launch overlaps the split kernel (DEVICEOPS_PDL=0: plain launches).
    go = launch_pdl if pdl_enabled(device_id) else _plain_launch
    grid, cgrid = (x_blocks, n_split, b), (rows, 1, 1)
    tail = (hq, hkv, lq, lk, float(scale_log2), causal_i, n_split, n_hchunk, mb, bs, nb)
    ctail = (n_split, lk, hq * lq)

    def run_splitkv(q: Any, k: Any, v: Any, out: Any, kv_len: Any, bt: Any, ws: Any,
                    stream: Any) -> None:
        kvl = 0 if kv_len is None else int(kv_len.data.ptr)
        btp = 0 if bt is None else int(bt.data.ptr)
        wo = wml = 0
        if n_split > 1:
            base_ptr = int(ws.data.ptr)
            wo, wml = base_ptr + o_off, base_ptr + ml_off
        sptr = int(stream.ptr)
        optr = int(out.data.ptr)
        go(fn, grid, (128, 1, 1),
           (int(q.data.ptr), int(k.data.ptr), int(v.data.ptr), optr, wo, wml, kvl, btp, *tail),
           sptr)  # fmt: skip
        if n_split > 1:
            go(combine, cgrid, (64, 1, 1), (wo, wml, optr, kvl, *ctail), sptr)

    return run_splitkv


def _plain_launch(
    ln: Launcher,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    args: tuple[Any, ...],
    stream_ptr: int,
) -> None:
    ln(grid, block, args, stream_ptr)
