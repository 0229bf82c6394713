"""GEMM on CUDA: kernel loading, cached launch plans and :func:`gemm_cuda`.

The semantics are described in :mod:`deviceops.kernels.gemm`; the checks, path planning and
NumPy reference live in :mod:`._check`, :mod:`._plan` and :mod:`._reference`; this module turns
a plan into driver launches. A **launch plan** is computed once per problem key
(device; bias/epilogue, ``tf32``, ``trans_b``, workspace size, the :class:`._plan.GemmOverride`
in force; shapes, strides, dtypes, 16-byte alignment of each pointer) and kept in the runtime's
plan cache (:mod:`..runtime._plan`): the path, tiles, grid, block, shared memory (the kernel's
attribute set once), the split-K decision and the kernel handle. The ``gemm`` op checked its
arguments already (its own plan); a direct :func:`gemm_cuda` call checks them on a miss.
A call then only looks up the key, and enqueues through the driver with typed, cached
arguments (:class:`..runtime._driver.Launcher`; the TMA kernels' ``CUtensorMap`` arguments go
through :class:`._tma.TmaLaunch`, which caches the packed arguments per pointer set, so a
decode loop re-encodes no descriptor). No allocation and no synchronisation happen
here: every launch goes to the stream handed in (graph-capture safe).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from deviceops.extend import ShapeError

from ..runtime import _plan as plan_cache
from ..runtime._driver import Launcher, launcher_for
from ..runtime._module import expanded_source, load_module, set_max_dynamic_smem
from ..runtime._override import active
from ..runtime._tma import TmaLaunch
from . import _check as GC
from . import _plan as G
from ._plan import GemmOverride

__all__ = ["expanded_source", "gemm_cuda"]

# --------------------------------------------------------------------------- modules

_kcache: dict[tuple[Any, ...], Any] = {}
_lcache: dict[tuple[Any, ...], Launcher] = {}
_dev_info: dict[int, tuple[int, int]] = {}
_lock = threading.Lock()


def _device_info(device_id: int) -> tuple[int, int]:
    info = _dev_info.get(device_id)
    if info is None:
        import cupy

        dev = cupy.cuda.Device(device_id)
        cc = int(dev.compute_capability)
        n_sm = int(dev.attributes["MultiProcessorCount"])
        info = _dev_info[device_id] = (cc, n_sm)
    return info


def _kernel(device_id: int, file: str, func: str, defines: tuple[str, ...], arch_suffix: str = "") -> Any:
    key = (device_id, file, func, defines, arch_suffix)
    fn = _kcache.get(key)
    if fn is None:
        with _lock:
            fn = _kcache.get(key)
            if fn is None:
                mod = load_module(
                    expanded_source(f"gemm/{file}"),
                    options=tuple(f"-D{d}" for d in defines),
                    device_id=device_id,
                    arch_suffix=arch_suffix,
                )
                fn = _kcache[key] = mod.get_function(func)
    return fn


def _launcher(device_id: int, file: str, func: str, defines: tuple[str, ...], codes: str, smem: int = 0) -> Launcher:
    """A cached driver launcher of ``func`` (dynamic shared memory limit raised to ``smem``)."""
    key = (device_id, file, func, defines, codes)
    ln = _lcache.get(key)
    fn = _kernel(device_id, file, func, defines)
    if smem > 48 * 1024:
        set_max_dynamic_smem(fn, smem, device_id)
    if ln is None:
        ln = _lcache[key] = Launcher(fn, codes, func, device_id)
    return ln


def _sm90_smem(bn: int, ncw: int, stages: int, epi_tma: bool = False) -> int:
    """The ring, the output staging boxes (TMA-store epilogue), the barriers, alignment slack."""
    return stages * (64 * ncw * 64 * 2 + 64 * bn * 2) + epi_tma * ncw * 2 * 8192 + 2 * 8 * stages + 16 + 1024


def _sm80_smem(wm: int, tf32: bool, trans_b: bool) -> int:
    bm = 64 * wm
    if tf32:
        return 3 * (bm * (16 + 4) + (128 * (16 + 4) if trans_b else 16 * (128 + 8))) * 4
    return 3 * (bm * (32 + 8) + (128 * (32 + 8) if trans_b else 32 * (128 + 8))) * 2


# --------------------------------------------------------------------------- plans

# run(a_ptr, b_ptr, out_ptr, bias_ptr, ws_ptr, stream_ptr)
_Run = Callable[[int, int, int, int, int, int], None]


def _check_arrays(arrs: tuple[tuple[str, Any], ...]) -> int:
    dev = -1
    for name, arr in arrs:
        if arr is None:
            continue
        GC._check_layout(name, tuple(arr.shape), tuple(arr.strides), bool(arr.flags.c_contiguous), "gemm")
        if dev < 0:
            dev = int(arr.device.id)
        elif int(arr.device.id) != dev:
            raise ShapeError(f"gemm: {name} is on device {arr.device.id}, a on device {dev}", op="gemm")
    return dev


def _build_skinny_tma(dev: int, cfg: tuple[int, int, int, int, int, int, int], batch: int, m: int, n: int, k: int,
                      b_batched: bool, bf16: int, epi: tuple[float, float, int, int, int]) -> _Run:
    """The swapped-operand TMA skinny kernel: the weight as the wgmma A operand, K over a cluster
    (or, persistent, each block an equal count of tiles: ``cfg[5]`` blocks a batch entry)."""
    bn, cl, kps, stages, ncw, pb, mc = cfg
    bm = 64 * ncw
    defs = (f"BN={bn}", f"NCW={ncw}", f"STAGES={stages}", f"SW_CL={cl}", f"SW_PERSIST={int(pb > 0)}",
            f"SW_MC={mc}", f"GEMM_BF16={bf16}", "GEMM_TRANS_B=1")
    fn = _kernel(dev, "gemm_skinny_tma.cu", "gemm_skinny_tma", defs, arch_suffix="a")
    smem = G.skinny_tma_smem(bn, stages, ncw)
    set_max_dynamic_smem(fn, smem, dev)
    bb = batch if b_batched else 1
    geo_x = ((k, m, batch), (k * 2, m * k * 2), (64, bn // mc, 1))  # a block's share of the tile
    geo_w = ((k, n, bb), (k * 2, n * k * 2), (64, bm, 1))
    i32, f32 = ctypes.c_int32, ctypes.c_float
    tail = tuple(zip((i32,) * 5 + (f32, f32, i32, i32, i32), (m, n, G._cdiv(k, 64), kps, int(b_batched), *epi),
                     strict=True))  # fmt: skip
    grid_x = pb or G._cdiv(G._cdiv(n, bm), mc) * mc  # whole clusters (a tile past N streams zeros)
    tl = TmaLaunch(fn, dev, (grid_x, cl, batch), (128 * (ncw + 1), 1, 1), smem, ((0, geo_x), (1, geo_w)), tail,
                    "gemm_skinny_tma")

    def run_tma(ap: int, bp: int, op: int, biasp: int, wsp: int, sp: int) -> None:
        tl((ap, bp, op, biasp or op, op), sp)

    return run_tma


def _build(a: Any, b: Any, out: Any, bias: Any, activation: str | None, alpha: float, beta: float, tf32: bool,
           trans_b: bool, ws_nbytes: int, ov: GemmOverride | None, checked: bool,
           yields: bool = False) -> _Run:
    """The launch plan of one problem (see the module doc), after the checks unless the op
    made them already (``checked``); ``ov``: the override in force, if any; ``yields``: one
    block a tile on the ``sm90`` path (no persistent grid)."""
    if checked:
        odt = np.dtype(out.dtype)
        dev = int(a.device.id)
    else:
        _, odt = GC.gemm_check(
            tuple(a.shape), a.dtype, tuple(b.shape), b.dtype, out_shape=tuple(out.shape),
            out_dtype=out.dtype, bias_shape=None if bias is None else tuple(bias.shape),
            bias_dtype=None if bias is None else bias.dtype, activation=activation, op="gemm",
            trans_b=trans_b,
        )  # fmt: skip
        dev = _check_arrays((("a", a), ("b", b), ("out", out), ("bias", bias)))
    batch, m, n, k, b_batched = G._dims(tuple(a.shape), tuple(b.shape), trans_b)
    cc, n_sm = _device_info(dev)
    act, has_bias, has_beta = GC.ACTIVATIONS[activation], int(bias is not None), int(float(beta) != 0.0)
    alpha, beta = float(alpha), float(beta)
    is16 = odt != np.float32
    bf16 = int(is16 and odt == GC._bf16())
    tb = int(trans_b)
    a16, b16 = int(a.data.ptr) % 16 == 0, int(b.data.ptr) % 16 == 0
    ptrs16 = a16 and b16 and int(out.data.ptr) % 16 == 0
    tma_ok = is16 and cc == 90 and k % 8 == 0 and n % 8 == 0 and ptrs16

    force = None if ov is None else ov.path
    if force == "sm90" and not tma_ok:
        raise ShapeError("gemm: the forced sm_90 path is not usable for this call", op="gemm")
    gemv_ok = force is None and b16
    skinny_ok = force in (None, "skinny", "tma") and cc >= 80 and a16 and b16
    path, cfg, splits, kps = G.plan_path(batch, m, n, k, odt, tf32, tma_ok, G._NOMINAL_SMS, gemv_ok, trans_b,
                                     skinny_ok)  # fmt: skip
    if ov is not None and force == "skinny":
        if path not in ("skinny", "tma"):  # the register kernel also serves what the TMA one would
            raise ShapeError(f"gemm: forced skinny path not usable for this call (M={m}, K={k})", op="gemm")
        path, cfg = "skinny", G.skinny_config(batch, m, n, k, ov.skinny_k_warps, ov.skinny_tiles_per_warp,
                                              ov.skinny_chunks)  # fmt: skip
    elif ov is not None and force == "tma":
        if path not in ("skinny", "tma") or cc != 90:
            raise ShapeError(f"gemm: forced tma path not usable for this call (M={m}, K={k}, sm_{cc})", op="gemm")
        path, cfg = "tma", G.skinny_tma_config(batch, m, n, k, *ov.tma_geometry())
    elif ov is not None and force == "sm90":
        path, cfg = "sm90", ov.sm90_tile or G._plan_sm90(batch, m, n, k, G._NOMINAL_SMS)[0]
    elif force == "sm80" and (is16 or tf32):
        path, cfg = "sm80", 2 if m > 64 else 1
    elif force == "simt" and not is16:
        path, cfg = "simt", None
    force_s = 0 if ov is None else ov.splits
    w_bstride = k * n if b_batched else 0
    epi = (alpha, beta, act, has_bias, has_beta)
    # sm_90: the skinny, GEMV, sm_90 and split-K reduce kernels wait for their predecessor
    # (griddepcontrol.wait) and go out with programmatic dependent launch
    go = launcher_for(dev)

    if path == "skinny":
        mf, tr, u, ks, kcw = cfg
        smem = ks * tr * mf * 4 * 32 * 4
        ln = _launcher(dev, "gemm_skinny.cu", "gemm_skinny",
                       (f"SK_MF={mf}", f"SK_TR={tr}", f"SK_U={u}", f"GEMM_BF16={bf16}"), "ppppiiiqiffiii", smem)
        grid_sk = (G._cdiv(n, 16 * tr), 1, batch)
        block_sk = (32 * ks, 1, 1)
        tail_sk = (m, n, k, w_bstride, kcw, *epi)

        def run_skinny(ap: int, bp: int, op: int, biasp: int, wsp: int, sp: int) -> None:
            go(ln, grid_sk, block_sk, (ap, bp, op, biasp or op, *tail_sk), sp, smem)

        return run_skinny
    if path == "tma":
        return _build_skinny_tma(dev, cfg, batch, m, n, k, b_batched, bf16, epi)
    if path == "gemv":
        cl, mr, lpr, pf = G.gemv_config(m, n, k, cc)
        a_vec = int(k % 8 == 0 and a16)
        ln = _launcher(dev, "gemm_gemv.cu", "gemm_gemv", (f"GEMM_BF16={bf16}", f"GV_CL={cl}", f"GV_MR={mr}",
                       f"GV_LPR={lpr}", f"GV_PF={pf}"), "ppppiiiqffiiii")  # fmt: skip
        grid_gv = (G._cdiv(n, 8 * lpr), cl, batch)
        tail_gv = (m, n, k, w_bstride, *epi, a_vec)

        def run_gemv(ap: int, bp: int, op: int, biasp: int, wsp: int, sp: int) -> None:
            go(ln, grid_gv, (256, 1, 1), (ap, bp, op, biasp or op, *tail_gv), sp, 0)

        return run_gemv

    bk = {"sm90": 64, "simt": 8}.get(path, 16 if not is16 else 32)
    kt_total = G._cdiv(k, bk)
    if force_s:
        splits = max(1, min(force_s, kt_total))
    splits = max(1, min(splits, kt_total))
    kps = G._cdiv(kt_total, splits)
    splits = G._cdiv(kt_total, kps)
    if splits > 1 and ws_nbytes < splits * batch * m * n * 4:
        splits, kps = 1, kt_total
    main: _Run
    if path == "sm90":
        bn, ncw, stages = G.SM90_CONFIGS[cfg]
        bm = 64 * ncw
        plain_ok = ov is None or ov.sm90_plain_epilogue
        store_ok = ov is None or ov.sm90_tma_store
        plain = plain_ok and splits == 1 and alpha == 1.0 and not has_beta and not has_bias and not act
        epi_tma = store_ok and splits == 1 and not has_beta  # stores through shared memory + TMA
        defs90 = (f"BN={bn}", f"NCW={ncw}", f"STAGES={stages}", f"GEMM_BF16={bf16}", f"GEMM_EPI_PLAIN={int(plain)}",
                  f"GEMM_TRANS_B={tb}", f"GEMM_EPI_TMA={int(epi_tma)}")  # fmt: skip
        fn = _kernel(dev, "gemm_sm90.cu", "gemm_sm90", defs90, arch_suffix="a")
        smem = _sm90_smem(bn, ncw, stages, epi_tma)
        set_max_dynamic_smem(fn, smem, dev)
        block90 = (128 * (ncw + 1), 1, 1)
        bb = batch if b_batched else 1
        geo_a = ((k, m, batch), (k * 2, m * k * 2), (64, bm, 1))
        # b as (N, K): one box of the BN rows; as (K, N): 64 x 64 boxes
        geo_b = ((k, n, bb), (k * 2, n * k * 2), (64, bn, 1)) if trans_b else ((n, k, bb), (n * 2, k * n * 2), (64, 64, 1))
        # a persistent grid of at most one block per SM (yielding: one block a tile, so that
        # a more urgent stream's blocks get SMs as each tile ends)
        tiles_m, tiles_n = G._cdiv(m, bm), G._cdiv(n, bn)
        total = batch * splits * tiles_m * tiles_n
        slots = total if yields else n_sm
        i32, f32 = ctypes.c_int32, ctypes.c_float
        tail90 = tuple(zip((i32,) * 10 + (f32, f32, i32, i32, i32),
                           (m, n, batch, tiles_m, tiles_n, splits, kt_total, kps, int(b_batched), total, *epi),
                           strict=True))  # fmt: skip
        # out as 64 x 64 store boxes; without the TMA store the kernel ignores its third map
        # (a's, already encoded) and the call encodes no extra one
        map_c = (2, ((n, m, batch), (n * 2, m * n * 2), (64, 64, 1))) if epi_tma else (0, geo_a)
        tl = TmaLaunch(fn, dev, (min(total, slots), 1, 1), block90, smem,
                        ((0, geo_a), (1, geo_b), map_c), tail90)  # fmt: skip

        def run_sm90(ap: int, bp: int, op: int, biasp: int, wsp: int, sp: int) -> None:
            tl((ap, bp, op, biasp or op, wsp if splits > 1 else op), sp)

        main = run_sm90

    else:
        vec_align = 8 if is16 else 4
        vec = int(k % vec_align == 0 and (trans_b or n % vec_align == 0) and ptrs16)
        if path == "sm80":
            wm = int(cfg)
            smem = _sm80_smem(wm, not is16, trans_b)
            ln = _launcher(dev, "gemm_sm80.cu", "gemm_sm80",
                           (f"WARPS_M={wm}", f"GEMM_TF32={int(not is16)}", f"GEMM_BF16={bf16}", f"GEMM_TRANS_B={tb}"),
                           "pppppiiiiqiiiffiii", smem)  # fmt: skip
            grid: tuple[int, int, int] = (G._cdiv(n, 128), G._cdiv(m, 64 * wm), batch * splits)
            block = (128 * wm, 1, 1)
        else:
            smem = 0
            ln = _launcher(dev, "gemm_simt.cu", "gemm_simt", (f"GEMM_TRANS_B={tb}",), "pppppiiiiqiiiffiii")
            grid = (G._cdiv(n, 128), G._cdiv(m, 128), batch * splits)
            block = (256, 1, 1)
        if grid[1] > 65535 or grid[2] > 65535:
            raise ShapeError(f"gemm: a {tuple(a.shape)} b {tuple(b.shape)} too large for one launch", op="gemm")
        tail = (m, n, k, batch, w_bstride, splits, kps, vec, *epi)

        def run_mma(ap: int, bp: int, op: int, biasp: int, wsp: int, sp: int) -> None:
            ln(grid, block, (ap, bp, op, biasp or op, wsp if splits > 1 else op, *tail), sp, smem)

        main = run_mma

    if splits == 1:
        return main
    red = _launcher(dev, "gemm_reduce.cu", "gemm_splitk_reduce",
                    (f"GEMM_OUT_F32={int(not is16)}", f"GEMM_BF16={bf16}"), "pppqiiffiii")  # fmt: skip
    total_out = batch * m * n
    rgrid = (min(G._cdiv(total_out, 256), 8 * n_sm), 1, 1)
    rtail = (total_out, n, splits, *epi)

    def run_split(ap: int, bp: int, op: int, biasp: int, wsp: int, sp: int) -> None:
        main(ap, bp, op, biasp, wsp, sp)
        go(red, rgrid, (256, 1, 1), (wsp, op, biasp or op, *rtail), sp, 0)

    return run_split


def gemm_cuda(
    a: Any,
    b: Any,
    out: Any,
    *,
    bias: Any = None,
    activation: str | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    tf32: bool = False,
    trans_b: bool = False,
    workspace: Any = None,
    stream: Any,
) -> None:
    """Enqueue ``out = act(alpha * a @ b + beta * out + bias)`` on ``stream``.

    No device allocation and no synchronisation happen here (graph-capture safe). The
    launch plan is cached per problem (see the module docstring): a repeated call costs a
    key lookup and the driver call. Tests and benchmarks pin a path or a tile config with
    a :class:`._plan.GemmOverride` installed by :func:`..runtime.overrides`, never through
    this signature.

    Args:
        a: ``(*batch, M, K)`` cupy array, C-contiguous.
        b: ``(K, N)`` or ``(*batch, K, N)`` cupy array, C-contiguous, same dtype; with
            ``trans_b``, ``(N, K)`` or ``(*batch, N, K)`` (read as its transpose, no copy).
        out: ``(*batch, M, N)`` cupy array to write (read first when ``beta != 0``).
        bias: ``(N,)`` cupy array or None.
        activation: None, ``"relu"``, ``"gelu"``, ``"silu"``, ``"gelu_erf"``.
        alpha: scale of ``a @ b``.
        beta: scale of the previous ``out``.
        tf32: float32 inputs on tensor cores with tf32 operands.
        trans_b: ``b`` is given transposed.
        workspace: cupy array of at least :func:`._plan.gemm_workspace_nbytes` bytes, or None.
        stream: the ``cupy.cuda.Stream`` every launch goes to.

    Raises:
        ShapeError, DTypeError: before any launch.
    """
    _launch(a, b, out, bias, activation, alpha, beta, tf32, trans_b, workspace, stream, False)


def _launch(a: Any, b: Any, out: Any, bias: Any, activation: str | None, alpha: float, beta: float,
            tf32: bool, trans_b: bool, workspace: Any, stream: Any, checked: bool,
            yields: bool = False) -> None:
    """:func:`gemm_cuda`; ``checked``: the op checked the arguments already (its plan), so a
    plan-cache miss only plans; ``yields``: the stream yields SMs between tiles
    (:meth:`deviceops.Device.new_stream`): the ``sm90`` path runs one block a tile, not a
    persistent grid."""
    ad, bd, od = a.data, b.data, out.data
    ap, bp, opp = ad.ptr, bd.ptr, od.ptr
    if bias is None:
        bkey: Any = None
        biasp = 0
    else:
        biasp = bias.data.ptr
        bkey = (bias.shape, bias.dtype, bias.strides, bias.data.device_id, biasp & 15)
    wsn = 0 if workspace is None else workspace.nbytes
    ov = active(GemmOverride)
    # (device, op, statics, signature): the pointers' 16-byte alignment and the other
    # operands' devices are part of the signature (they choose the path or refuse the call)
    key = (("cuda", ad.device_id), "gemm_cuda", (activation, alpha, beta, tf32, trans_b, wsn, ov, yields),
           (a.shape, b.shape, out.shape, a.dtype, b.dtype, out.dtype, a.strides, b.strides, out.strides,
            bd.device_id, od.device_id, ap & 15, bp & 15, opp & 15, bkey))  # fmt: skip
    run = plan_cache.lookup(key)
    if run is None:
        run = plan_cache.store(key, _build(a, b, out, bias, activation, alpha, beta, tf32, trans_b, wsn,
                                           ov, checked, yields))  # fmt: skip
    run(ap, bp, opp, biasp, 0 if workspace is None else workspace.data.ptr, stream.ptr)
