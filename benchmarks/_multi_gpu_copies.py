"""Sections 2 and 3 of ``benchmarks/multi_gpu.py``, copies: peer copies between the two
devices (:func:`copy_section`) and staged copies through host memory (:func:`host_section`),
each beside torch, with the helpers that check every copy bit for bit against an independent
copy of its source and :class:`Torch`, the torch references."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from _common import Bench, EventTimer, interleave, median, pct
from _multi_gpu_checks import Checks
from _multi_gpu_devices import on, xp_of

import deviceops
from deviceops import api


# -- 2./3. copies --------------------------------------------------------------------------
def host_copy_of(t: deviceops.Tensor, cp: Any) -> np.ndarray:
    if cp is None or t.device.is_cpu:
        return np.array(t.array, copy=True)
    with cp.cuda.Device(t.device.index):
        return cp.asnumpy(t.array)


def independent_copy(t: deviceops.Tensor, dst: deviceops.Device, cp: Any) -> Any:
    """A copy of ``t``'s array on ``dst`` made without deviceops (CuPy's memcpy / NumPy)."""
    if cp is None or dst.is_cpu:
        return np.array(t.array, copy=True)
    with cp.cuda.Device(dst.index):
        r = cp.empty(t.array.shape, t.array.dtype)
        r.data.copy_from_device(t.array.data, t.array.nbytes)
    cp.cuda.Device(t.device.index).synchronize()
    cp.cuda.Device(dst.index).synchronize()
    return r


def same_bits(a: Any, ref: Any, dev: deviceops.Device, cp: Any) -> bool:
    xp = xp_of(dev)
    with on(dev, cp):
        if a.shape != ref.shape or a.dtype != ref.dtype:
            return False
        return bool(xp.array_equal(a.view(xp.uint32), ref.view(xp.uint32)))


class Torch:
    """The torch references (GPU runs only)."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.version = torch.__version__

    def wrap(self, arr: Any) -> Any:
        return self.torch.from_dlpack(arr)

    def unwrap(self, t: Any, cp: Any) -> Any:
        return cp.from_dlpack(t)


def copy_section(b: Bench, src_dev: deviceops.Device, dst_dev: deviceops.Device, nbytes: int,
                 reps: int, checks: Checks, torch: Torch | None, corrupt: bool) -> dict[str, Any]:
    """``api.to_device(src, dst).sync()`` (wall) and on a dst stream (events) vs torch."""
    cp = b.cupy
    tag = f"{src_dev}->{dst_dev}"
    s_src = src_dev.new_stream()
    srcs = [api.randn((nbytes // 4,), deviceops.float32).sync_on(s_src) for _ in range(2)]
    refs = [independent_copy(t, dst_dev, cp) for t in srcs]
    if corrupt:
        refs.reverse()
    s_dst = dst_dev.new_stream()
    turn = {"ours": 0, "ours_ev": 0, "torch": 0}
    ev_times: dict[str, list[float]] = {"ours_ev": [], "torch": []}
    variants: dict[str, Callable[[], Any]] = {}

    def run_ours() -> Any:
        k = turn["ours"] = turn["ours"] ^ 1
        return k, api.to_device(srcs[k], dst_dev).sync()

    variants["ours"] = run_ours
    if cp is not None:
        with cp.cuda.Device(dst_dev.index):
            timer = EventTimer(cp, s_dst.native)

        def run_ours_ev() -> Any:
            k = turn["ours_ev"] = turn["ours_ev"] ^ 1
            timer.begin()
            out = api.to_device(srcs[k], dst_dev).async_on(s_dst)
            timer.end()
            s_dst.synchronize()
            ev_times["ours_ev"].append(timer.seconds())
            return k, out

        variants["ours_ev"] = run_ours_ev
    if torch is not None:
        th = torch.torch
        tsrcs = [torch.wrap(t.array) for t in srcs]
        tdst = f"cuda:{dst_dev.index}"
        tstream = th.cuda.current_stream(src_dev.index)
        tev = (th.cuda.Event(enable_timing=True), th.cuda.Event(enable_timing=True))

        def run_torch() -> Any:
            k = turn["torch"] = turn["torch"] ^ 1
            tev[0].record(tstream)
            y = tsrcs[k].to(tdst)
            tev[1].record(tstream)
            th.cuda.synchronize(src_dev.index)
            th.cuda.synchronize(dst_dev.index)
            ev_times["torch"].append(tev[0].elapsed_time(tev[1]) * 1e-3)
            return k, y

        variants["torch"] = run_torch

    def after(name: str, res: Any) -> None:
        k, out = res
        if name == "torch":
            arr, dev = torch.unwrap(out, cp), dst_dev  # type: ignore[union-attr]
        else:
            arr, dev = out.array, out.device
            checks.add(f"copy {tag}/{name}: output lives on {dst_dev}", dev is dst_dev, got=str(dev))
        checks.add(f"copy {tag}/{name}: bytes equal the source's", same_bits(arr, refs[k], dst_dev, cp), src=k)

    warm = 2
    times = interleave(variants, reps, warmup=warm, after=after)
    gb = nbytes / 1e9
    row: dict[str, Any] = {"bench": "peer copy", "variant": f"{tag} {nbytes / 2**20:g} MiB",
                           "ours": f"api.to_device(t, {dst_dev!r}).sync()", "ours_ms": median(times["ours"]) * 1e3,
                           "ours_GBps": gb / median(times["ours"]), "ours_p10_GBps": gb / pct(times["ours"], 90),
                           "ours_ev_GBps": gb / median(ev_times["ours_ev"][warm:]) if ev_times["ours_ev"] else None,
                           "ours_ev_wall_GBps": gb / median(times["ours_ev"]) if "ours_ev" in times else None,
                           "reference": f"torch .to('cuda:{dst_dev.index}')" if torch else "torch (not installed)",
                           "ref_ms": None, "ref_GBps": None, "ref_ev_GBps": None, "ratio": None,
                           "ev_ratio": None, "samples": reps}
    if "torch" in times:
        row["ref_ms"] = median(times["torch"]) * 1e3
        row["ref_GBps"] = gb / median(times["torch"])
        row["ref_ev_GBps"] = gb / median(ev_times["torch"][warm:])
        row["ratio"] = row["ours_GBps"] / row["ref_GBps"]
        if row["ours_ev_GBps"]:
            row["ev_ratio"] = row["ours_ev_GBps"] / row["ref_ev_GBps"]
    return row


def host_section(b: Bench, dev: deviceops.Device, nbytes: int, reps: int, checks: Checks,
                 torch: Torch | None, corrupt: bool) -> list[dict[str, Any]]:
    """Staged copies through host memory (context): from_host of pageable data, to_host."""
    cp = b.cupy
    s = dev.new_stream()
    dsrcs = [api.randn((nbytes // 4,), deviceops.float32).sync_on(s) for _ in range(2)]
    hsrcs = [host_copy_of(t, cp) for t in dsrcs]  # pageable host data; dsrcs are their device refs
    if corrupt:
        hsrcs_ref, dsrcs_ref = hsrcs[::-1], dsrcs[::-1]
    else:
        hsrcs_ref, dsrcs_ref = hsrcs, dsrcs
    turn: dict[str, int] = {}

    def rot(name: str) -> int:
        k = turn[name] = turn.get(name, 0) ^ 1
        return k

    def h2d_ours() -> Any:
        k = rot("h2d_ours")
        return k, api.from_host(hsrcs[k]).sync()

    def d2h_ours() -> Any:
        k = rot("d2h_ours")
        return k, api.to_host(dsrcs[k]).sync()

    variants: dict[str, Callable[[], Any]] = {"h2d_ours": h2d_ours, "d2h_ours": d2h_ours}
    if torch is not None:
        th = torch.torch
        tdev = f"cuda:{dev.index}"
        thsrcs = [th.from_numpy(h) for h in hsrcs]
        tdsrcs = [torch.wrap(t.array) for t in dsrcs]

        def h2d_torch() -> Any:
            k = rot("h2d_torch")
            y = thsrcs[k].to(tdev)
            th.cuda.synchronize(dev.index)
            return k, y

        def d2h_torch() -> Any:
            k = rot("d2h_torch")
            return k, tdsrcs[k].cpu()

        variants["h2d_torch"] = h2d_torch
        variants["d2h_torch"] = d2h_torch

    def after(name: str, res: Any) -> None:
        k, out = res
        if name == "h2d_ours":
            ok = out.device is dev and same_bits(out.array, dsrcs_ref[k].array, dev, cp)
        elif name == "h2d_torch":
            ok = same_bits(torch.unwrap(out, cp), dsrcs_ref[k].array, dev, cp)  # type: ignore[union-attr]
        elif name == "d2h_ours":
            ok = same_bits(np.asarray(out), hsrcs_ref[k], deviceops.device("cpu"), None)
        else:
            ok = same_bits(out.numpy(), hsrcs_ref[k], deviceops.device("cpu"), None)
        checks.add(f"host copy {name}: bytes equal the source's", ok, src=k)

    times = interleave(variants, reps, warmup=1, after=after)
    gb = nbytes / 1e9
    rows = []
    for d, ours_desc, ref_desc in (("h2d", "api.from_host(pageable).sync()", "torch.from_numpy(h).to(dev)"),
                                   ("d2h", "api.to_host(t).sync()", "t.cpu()")):
        o = median(times[f"{d}_ours"])
        r = median(times[f"{d}_torch"]) if f"{d}_torch" in times else None
        rows.append({"bench": "host copy", "variant": f"{'host->' if d == 'h2d' else ''}{dev}"
                     f"{'->host' if d == 'd2h' else ''} {nbytes / 2**20:g} MiB",
                     "ours": ours_desc, "ours_ms": o * 1e3, "ours_GBps": gb / o,
                     "reference": ref_desc if torch else "torch (not installed)",
                     "ref_ms": None if r is None else r * 1e3, "ref_GBps": None if r is None else gb / r,
                     "ratio": None if r is None else (gb / o) / (gb / r), "samples": reps})
    return rows
