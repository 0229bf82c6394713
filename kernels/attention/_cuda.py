"""Flash attention on CUDA: kernel loading, cached launch plans and
:func:`flash_attention_cuda` (semantics and paths: :mod:`deviceops.kernels.attention`).

A launch plan is computed once per problem key (device; ``causal``, ``scale``, workspace
size, the :class:`._plan.AttentionOverride` in force; shapes, strides, dtypes,
``kv_len``/``block_table`` layout) and kept in the runtime's plan cache
(:mod:`..runtime._plan`): the path (sm_90 wgmma or split-KV), the kernel handles, grid and
workspace layout. The ``flash_attention`` op checked its arguments already; a direct
:func:`flash_attention_cuda` call checks them on a miss. A call looks the key up, checks
pointer alignment and enqueues through the driver (:class:`..runtime._driver.Launcher`).
CuPy is imported lazily.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from deviceops.extend import DeviceError, ShapeError

from ..runtime import _plan as plan_cache
from ..runtime._driver import Launcher, fast_kernel, launcher_for
from ..runtime._module import expanded_source, load_module, set_max_dynamic_smem
from ..runtime._override import active
from ._check import attention_check
from ._plan import (
    DECODE_MAX_LQ,
    SM90_CONFIGS,
    SPLIT_BLOCKS_PER_SM,
    SPLIT_GRANULE,
    SPLIT_MIN_STEPS,
    SPLITKV_MIN_BLOCKS,
    AttentionOverride,
    logical_lk,
    plan_splitkv,
    sm90_smem_bytes,
    splitkv_bulk,
    splitkv_bulk_smem,
    splitkv_cluster,
    splitkv_warps,
    ws_layout,
)

__all__ = ["flash_attention_cuda"]


_kernels: dict[tuple[Any, ...], Any] = {}


def _sm90_kernel(
    device_id: int,
    dp: int,
    bn: int,
    nwg: int,
    nstage: int,
    bf16: bool,
    scale_pos: bool,
) -> Any:
    key = ("sm90", device_id, dp, bn, nwg, nstage, bf16, scale_pos)
    fn = _kernels.get(key)
    if fn is None:
        opts = (
            f"-DATTN_DP={dp}",
            f"-DATTN_BN={bn}",
            f"-DATTN_NWG={nwg}",
            f"-DATTN_NSTAGE={nstage}",
            f"-DATTN_SCALE_POS={int(scale_pos)}",
            f"-DATTN_BF16={int(bf16)}",
        )
        mod = load_module(
            expanded_source("attention/attn_fwd_sm90.cu"),
            options=opts,
            device_id=device_id,
            arch_suffix="a",
        )
        raw = mod.get_function("attn_fwd_sm90")
        set_max_dynamic_smem(raw, sm90_smem_bytes(dp, bn, nwg, nstage), device_id)
        fn = _kernels[key] = fast_kernel(raw, "attn_fwd_sm90", device_id)
    return fn


#: Dynamic shared memory the split-KV kernel's bulk ring may take: 227 KiB a block on sm_90,
#: less the kernel's static shared memory (per-warp maxima and sums, cluster partials).
_BULK_SMEM_MAX = 220 * 1024


def _splitkv_kernels(
    device_id: int, d: int, gt: int, bf16: bool, f32: bool, paged: bool, warps: int, cl: int,
    bulk: int,
) -> tuple[Any, Any, int]:
    """(split kernel, combine kernel, dynamic shared memory bytes of the split kernel).
    ``bulk``: stages of the bulk-copy K/V ring (0: none)."""
    key = ("splitkv", device_id, d, gt, bf16, f32, paged, warps, cl, bulk)
    fns = _kernels.get(key)
    smem = splitkv_bulk_smem(d, warps, bulk, gt) if bulk else 0
    if bulk and (paged or f32):
        raise ValueError("flash_attention: the bulk K/V ring needs contiguous 16-bit K/V")
    if smem > _BULK_SMEM_MAX or bulk * warps * 8 > 1024:
        raise ValueError(
            f"flash_attention: a {bulk}-stage bulk K/V ring of {warps}-warp blocks needs "
            f"{smem} bytes of shared memory and {bulk * warps * 8} of barriers (at most "
            f"{_BULK_SMEM_MAX} and 1024); use fewer stages or warps"
        )
    if fns is None:
        opts = (
            f"-DATTN_D={d}",
            f"-DATTN_GT={gt}",
            f"-DATTN_BF16={int(bf16)}",
            f"-DATTN_F32={int(f32)}",
            f"-DATTN_PAGED={int(paged)}",
            f"-DATTN_NWARP={warps}",
            f"-DATTN_CL={cl}",
            f"-DATTN_GRANULE={SPLIT_GRANULE}",
            *((f"-DATTN_BULK={bulk}",) if bulk else ()),
        )
        if not f32 and gt <= 4:
            # 128 registers: 4 resident blocks per SM instead of 3 (measured on H100:
            # B1 Lk32k GQA 32/8 D128 67.8 -> 56.5 us); float32 and 8 heads/block would spill.
            # Larger blocks keep the same 128-register budget (16 warps per SM).
            opts = (*opts, f"-DATTN_MINB={max(1, SPLITKV_MIN_BLOCKS * 4 // warps)}")
        mod = load_module(expanded_source("attention/attn_splitkv.cu"), options=opts,
                          device_id=device_id)
        raw = (mod.get_function("attn_splitkv"), mod.get_function("attn_splitkv_combine"))
        if smem:
            set_max_dynamic_smem(raw[0], smem, device_id)
        fns = (
            Launcher(raw[0], "pppppppp" + "iiiifiiiiiii", "attn_splitkv", device_id),
            Launcher(raw[1], "pppp" + "iii", "attn_splitkv_combine", device_id),
        )
        _kernels[key] = fns
        _kernels[(*key, "raw")] = raw  # keeps the CuPy function objects alive
    return (*fns, smem)


@functools.cache
def _bw_per_sm(device_id: int, n_sm: int) -> float:
    """Peak DRAM bandwidth per SM in bytes/s (memory clock x bus width), 0.0 where the
    runtime does not report it (the bulk ring then stays off)."""
    import cupy

    rt = cupy.cuda.runtime
    try:
        clock_khz = rt.deviceGetAttribute(getattr(rt, "cudaDevAttrMemoryClockRate", 36), device_id)
        bus_bits = rt.deviceGetAttribute(getattr(rt, "cudaDevAttrGlobalMemoryBusWidth", 37),
                                         device_id)
    except rt.CUDARuntimeError:
        return 0.0
    return 2.0 * clock_khz * 1e3 * bus_bits / 8 / n_sm


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
        raise DeviceError(
            f"flash_attention: {name} is on cuda:{a.device.id} but q is on cuda:{device_id}; "
            f"copy it first with api.to_device(t, 'cuda:{device_id}')",
            op="flash_attention", device=f"cuda:{a.device.id}",
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
    window: int | None = None,
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
        window: optional sliding window (with ``causal``; see ``flash_attention``).

    Raises:
        ShapeError, DTypeError: before any launch.
    """
    if window is not None and (not causal or int(window) < 1):
        raise ValueError(f"flash_attention: window={window} needs causal=True and must be >= 1")
    _launch(q, k, v, out, causal, scale, kv_len, block_table, workspace, stream, False, window)


def _launch(q: Any, k: Any, v: Any, out: Any, causal: bool, scale: float | None, kv_len: Any,
            bt: Any, workspace: Any, stream: Any, checked: bool, window: int | None = None) -> None:
    """:func:`flash_attention_cuda`; ``checked``: the op checked the arguments already (its
    plan), so a plan-cache miss only plans."""
    ov = active(AttentionOverride)
    key = (("cuda", q.device.id), "flash_attention_cuda",
           (bool(causal), scale, None if workspace is None else workspace.nbytes, ov, window),
           (q.shape, k.shape, v.shape, out.shape, q.dtype, k.dtype, v.dtype, out.dtype,
            q.strides, k.strides, v.strides, out.strides,
            None if kv_len is None else (kv_len.shape, kv_len.dtype, kv_len.strides),
            None if bt is None else (bt.shape, bt.dtype, bt.strides)))  # fmt: skip
    plan = plan_cache.lookup(key)
    if plan is None:
        plan = plan_cache.store(key, _plan(q, k, v, out, causal, scale, kv_len, bt, workspace, ov,
                                           checked, window))
    for name, a, align in (("q", q, 16), ("k", k, 16), ("v", v, 16), ("out", out, 16),
                           ("kv_len", kv_len, 4), ("block_table", bt, 4)):
        if a is not None and a.data.ptr % align:
            _check_array(name, a, q.device.id, align)  # raises, naming the array
    plan(q, k, v, out, kv_len, bt, workspace, stream)


_Plan = Callable[[Any, Any, Any, Any, Any, Any, Any, Any], None]


def _plan(q: Any, k: Any, v: Any, out: Any, causal: bool, scale: float | None, kv_len: Any,
          block_table: Any, workspace: Any, ov: AttentionOverride | None, checked: bool,
          window: int | None = None) -> _Plan:
    """Validate one problem (unless the op did: ``checked``) and choose its path, kernels,
    grid and workspace layout, once; return the per-call launch (pointers only). ``ov``: the
    override in force, if any; ``window``: the sliding window (0 in the kernels: none)."""
    device_id = q.device.id
    if not checked:
        attention_check(
            q.shape, q.dtype, k.shape, k.dtype, v.shape, v.dtype,
            out_shape=out.shape, out_dtype=out.dtype,
            kv_len_shape=None if kv_len is None else kv_len.shape,
            kv_len_dtype=None if kv_len is None else kv_len.dtype,
            block_table_shape=None if block_table is None else block_table.shape,
            block_table_dtype=None if block_table is None else block_table.dtype,
        )  # fmt: skip
        named = [("q", q), ("k", k), ("v", v), ("out", out)]
        named += [] if kv_len is None else [("kv_len", kv_len)]
        named += [] if block_table is None else [("block_table", block_table)]
        for name, a in named:
            _check_array(name, a, device_id, 4 if name in ("kv_len", "block_table") else 16)
    if ov is None:
        ov = AttentionOverride()
    b, hq, lq, d = (int(x) for x in q.shape)
    hkv = int(k.shape[1])
    paged = block_table is not None
    lk = logical_lk(tuple(k.shape), None if block_table is None else tuple(block_table.shape))
    dt = np.dtype(q.dtype)
    f32 = dt == np.dtype(np.float32)
    bf16 = not f32 and dt != np.dtype(np.float16)
    sc = 1.0 / math.sqrt(d) if scale is None else float(scale)
    scale_log2 = np.float32(sc * math.log2(math.e))
    cc, n_sm = _device_info(device_id)
    i32 = np.int32
    causal_i = int(bool(causal))
    win = int(window) if window is not None and causal else 0

    force_splitkv = ov.path == "splitkv"
    if cc == 90 and lq > DECODE_MAX_LQ and not (force_splitkv or f32 or paged):
        dp = -(-d // 64) * 64
        bn, nwg, nstage = ov.sm90_config or SM90_CONFIGS[dp]
        fn = _sm90_kernel(device_id, dp, bn, nwg, nstage, bf16, sc > 0)
        bm = 64 * nwg
        n_mblk = -(-lq // bm)
        if n_mblk > 65535:
            raise ShapeError(
                f"flash_attention: Lq={lq} too long for one launch", op="flash_attention"
            )
        grid, block = (b * hq, n_mblk, 1), (128 * nwg, 1, 1)
        smem = sm90_smem_bytes(dp, bn, nwg, nstage)
        tail9: tuple[Any, ...] = (i32(hq), i32(hkv), i32(lq), i32(lk), i32(d), scale_log2,
                                  i32(causal_i), i32(n_mblk), i32(win))

        def run_sm90(q: Any, k: Any, v: Any, out: Any, kv_len: Any, bt: Any, ws: Any,
                     stream: Any) -> None:
            kvl = np.uint64(0) if kv_len is None else np.uint64(kv_len.data.ptr)
            fn(grid, block, (q, k, v, out, kvl, *tail9), stream=stream, shared_mem=smem)

        return run_sm90

    # Split-KV path (decode, float32, paged, or the portable fallback). n_split is the most
    # splits any row may use (the workspace stride); the kernel splits each row's kv_len.
    bps = ov.split_blocks_per_sm or SPLIT_BLOCKS_PER_SM
    warps, may_split = splitkv_warps(b, hq, hkv, lq, lk, d, f32=f32, n_sm=n_sm,
                                     forced=ov.split_warps, blocks_per_sm=bps)
    gt, n_hchunk, n_split = plan_splitkv(
        b, hq, hkv, lq, lk, d, n_sm=n_sm, split=workspace is not None and may_split, warps=warps,
        blocks_per_sm=bps,
        min_steps=SPLIT_MIN_STEPS if ov.split_min_steps is None else ov.split_min_steps,
    )  # fmt: skip
    bulk = ov.bulk_stages or 0
    if cc == 90 and not (f32 or paged) and ov.split_warps is None and ov.bulk_stages is None:
        bulk, warps, n_split = splitkv_bulk(
            b, hq, hkv, lq, lk, d, warps=warps, n_split=n_split,
            may_split=workspace is not None and may_split, n_sm=n_sm,
            bw_per_sm=_bw_per_sm(device_id, n_sm))
    x_blocks = hkv * lq * n_hchunk
    rows = b * hq * lq
    o_off = ml_off = 0
    cl, n_split = splitkv_cluster(n_split, cc, d, ov.cluster, groups=b * x_blocks, n_sm=n_sm)
    if n_split > 1 and cl == 1:
        o_off, ml_off, need = ws_layout(rows, n_split, d)
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
    fn, combine, smem = _splitkv_kernels(device_id, d, gt, bf16, f32, paged, warps, cl, bulk)
    combined = n_split > 1 and cl == 1  # partials through the workspace: the combine kernel
    # Both kernels go through cuLaunchKernelEx with programmatic dependent launch on sm_90
    # (each waits with griddepcontrol.wait before touching memory), so the combine kernel's
    # launch overlaps the split kernel (DEVICEOPS_PDL=0: plain launches).
    go = launcher_for(device_id)
    grid, cgrid = (x_blocks, n_split, b), (rows, 1, 1)
    tail = (hq, hkv, lq, lk, float(scale_log2), causal_i, n_split, n_hchunk, mb, bs, nb, win)
    ctail = (n_split, lk, hq * lq)

    def run_splitkv(q: Any, k: Any, v: Any, out: Any, kv_len: Any, bt: Any, ws: Any,
                    stream: Any) -> None:
        kvl = 0 if kv_len is None else int(kv_len.data.ptr)
        btp = 0 if bt is None else int(bt.data.ptr)
        wo = wml = 0
        if combined:
            base_ptr = int(ws.data.ptr)
            wo, wml = base_ptr + o_off, base_ptr + ml_off
        sptr = int(stream.ptr)
        optr = int(out.data.ptr)
        go(fn, grid, (32 * warps, 1, 1),
           (int(q.data.ptr), int(k.data.ptr), int(v.data.ptr), optr, wo, wml, kvl, btp, *tail),
           sptr, smem)  # fmt: skip
        if combined:
            go(combine, cgrid, (64, 1, 1), (wo, wml, optr, kvl, *ctail), sptr)

    return run_splitkv

