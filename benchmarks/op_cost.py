"""Per-op cost of the KernelOps users write at decode sizes, beside torch eager.

Usage::

    python benchmarks/op_cost.py [--smoke] [--json PATH] [--n N] [--rounds R]

Each case is written as a user writes it (the README's idioms: Partition arguments, ops that
allocate their output, ``out=`` buffers, ops built afresh for every call) and measured two
ways, ours and torch's alternating in the same run, torch on the same CUDA stream (set once,
outside the loops):

| column       | what is timed                                                               |
|--------------|-----------------------------------------------------------------------------|
| wall us/call | host wall time of N calls (``op.async_on(stream)``; torch eager) and one    |
|              | final synchronize, divided by N: what an eager caller waits per op          |
| dev us/call  | device time with the host hidden: a ``torch.cuda._sleep`` spin is queued    |
|              | first on the stream, the N launches pile up behind it, CUDA events bracket  |
|              | them; ``hidden`` says whether the spin outlasted the host's enqueueing      |
| host us/call | the host's time to enqueue those N launches behind the spin: the per-op     |
|              | host cost alone (wall time is the larger of host and device time)           |

Every case is checked first against a float64 NumPy reference (and torch's output against
the same reference), on random inputs. Cases whose kernel is not in ``deviceops.kernels``
(yet) are listed as skipped. On the cpu backend (``--smoke``) only ours runs, on small sizes,
and is checked: the figures there measure the NumPy emulation.

Bars (issue 12): every KernelOp's host cost per call ≤ 1.0x torch eager's for the same op
(reported beside: the wall-time ratio, which a kernel slower on the device than torch's
loses even when its host cost is lower); the saxpy partition form ≤ 1.15x the flat form
(both ours, alternating in one case) and ≤ 1.3x a raw CuPy RawKernel loop; allocating
``add`` ≤ 1.3x torch's ``y = x + x``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from _common import (
    Bar,
    Bench,
    add_common_args,
    check,
    download,
    main_guard,
    median,
    no_gc,
    print_bars,
    raw_kernels,
    setup,
    table,
    upload,
    write_json,
)

import deviceops
from deviceops import kernels


@dataclass
class Case:
    """One op as a user writes it, its torch eager twin and its float64 reference."""

    name: str
    ours: Callable[[], Any]  # builds a fresh DeviceOp
    out: Callable[[Any], deviceops.Tensor]  # the tensor to check from ours' result
    expect: np.ndarray  # float64 reference of the output
    tol: float
    ref: Callable[[], Any] | None = None  # torch eager (or raw CuPy), launched on the stream
    ref_out: Callable[[], Any] | None = None
    ref_label: str = "torch eager"
    kernel: bool = True  # a KernelOp (counts for the <= 1.0x torch bar)
    extra: dict[str, Any] = field(default_factory=dict)


class Ctx:
    """Inputs and the torch/CuPy handles shared by the cases."""

    def __init__(self, b: Bench, stream: deviceops.Stream, smoke: bool) -> None:
        self.b = b
        self.stream = stream
        self.smoke = smoke
        self.rng = np.random.default_rng(7)
        self.torch: Any = None
        self.ts: Any = None
        if b.is_cuda:
            import torch

            self.torch = torch
            self.ts = torch.cuda.ExternalStream(stream.native.ptr)  # type: ignore[attr-defined]

    def host(self, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
        return (self.rng.standard_normal(shape) * scale).astype(np.float32)

    def dev(self, x: np.ndarray, dtype: Any = None) -> deviceops.Tensor:
        t = upload(x, self.stream)
        if dtype is not None and dtype != "float32":
            t = deviceops.api.convert(t, dtype).sync_on(self.stream)
        return t

    def host_of(self, t: deviceops.Tensor) -> np.ndarray:
        if t.dtype in (deviceops.float16, deviceops.bfloat16):
            t = deviceops.api.convert(t, "float32").sync_on(self.stream)
        return download(t, self.stream)

    def tt(self, t: deviceops.Tensor) -> Any:
        """A torch view of a device tensor (same memory)."""
        return self.torch.from_dlpack(t.array)


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    got64, want64 = got.astype(np.float64), want.astype(np.float64)
    return float(np.linalg.norm(got64 - want64) / max(np.linalg.norm(want64), 1e-30))


# -- the cases ---------------------------------------------------------------------------------


def saxpy_cases(c: Ctx) -> list[Case]:
    n = 1024
    xh, zh = c.host((n,)), c.host((n,))
    x, z_part, z_flat = c.dev(xh), c.dev(zh), c.dev(zh)
    part = z_part.partition((256,))
    # saxpy accumulates: check one application on fresh buffers, then time on the same ones
    want = zh.astype(np.float64) + xh.astype(np.float64)
    cases = [
        Case("saxpy partition form (1024,)", lambda: kernels.saxpy(part, 1.0, x),
             lambda r: part.tensor, want, 1e-6, kernel=False),
        Case("saxpy flat form (1024,)", lambda: kernels.saxpy(z_flat, 1.0, x),
             lambda r: z_flat, want, 1e-6, kernel=False),
    ]
    if c.b.is_cuda:
        cp = c.b.cupy
        fn = raw_kernels(cp)["raw_saxpy"]
        rz, rx = cp.asarray(zh), cp.asarray(xh)
        native = c.stream.native  # type: ignore[attr-defined]
        a32, n64 = np.float32(1.0), np.int64(n)
        for cs in cases:
            cs.ref = lambda: fn((1,), (256,), (rz, a32, rx, n64), stream=native)
            cs.ref_label = "raw CuPy RawKernel"
        # the partition form against the flat form, alternating in one case (one host state)
        stream = c.stream
        part2, flat2 = c.dev(zh).partition((256,)), c.dev(zh)  # fresh: the check is first
        cases.append(Case(PART_VS_FLAT, lambda: kernels.saxpy(part2, 1.0, x), lambda r: part2.tensor,
                          want, 1e-6, kernel=False,
                          ref=lambda: kernels.saxpy(flat2, 1.0, x).async_on(stream),
                          ref_label="ours, flat form", extra={"accumulates": True}))
    return cases


PART_VS_FLAT = "saxpy partition form vs flat form (1024,)"


def add_case(c: Ctx) -> Case:
    n = 1024
    xh = c.host((n,))
    x = c.dev(xh)
    want = 2.0 * xh.astype(np.float64)
    cs = Case("add(x, x) allocating (1024,)", lambda: kernels.add(x, x), lambda r: r, want, 1e-6,
              kernel=False)
    if c.b.is_cuda:
        tx = c.tt(x)
        cs.ref = lambda: tx + tx
    return cs


def gemm_case(c: Ctx, m: int, n: int, k: int, dtype: str, trans_b: bool = False) -> Case:
    ah, bh = c.host((m, k)), c.host((n, k) if trans_b else (k, n), 1.0 / math.sqrt(k))
    a, b = c.dev(ah, dtype), c.dev(bh, dtype)
    out = c.dev(np.zeros((m, n), np.float32), dtype)
    a64 = c.host_of(a).astype(np.float64)
    b64 = c.host_of(b).astype(np.float64)
    want = a64 @ (b64.T if trans_b else b64)
    kw = {"trans_b": True} if trans_b else {}
    label = f"gemm {dtype} {m}x{n}x{k}" + (" trans_b" if trans_b else "") + " (out=)"
    cs = Case(label, lambda: kernels.gemm(a, b, out, **kw), lambda r: out, want, 2e-2)
    if c.b.is_cuda:
        ta, tb, to = c.tt(a), c.tt(b), c.torch.empty((m, n), dtype=c.tt(a).dtype, device="cuda")
        tbt = tb.t() if trans_b else tb
        cs.ref = lambda: c.torch.matmul(ta, tbt, out=to)
        cs.ref_out = lambda: to
    return cs


def attention_case(c: Ctx, b: int, hq: int, hkv: int, lk: int, d: int, dtype: str) -> Case:
    qh, kh, vh = c.host((b, hq, 1, d)), c.host((b, hkv, lk, d)), c.host((b, hkv, lk, d))
    q, k, v = c.dev(qh, dtype), c.dev(kh, dtype), c.dev(vh, dtype)
    out = c.dev(np.zeros((b, hq, 1, d), np.float32), dtype)
    q64, k64, v64 = (c.host_of(t).astype(np.float64) for t in (q, k, v))
    rep = hq // hkv
    k64, v64 = np.repeat(k64, rep, axis=1), np.repeat(v64, rep, axis=1)
    s = q64 @ k64.transpose(0, 1, 3, 2) / math.sqrt(d)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ v64
    label = f"flash_attention decode ({b},{hq},1,{d}) vs Lk {lk}, {hkv} kv heads, {dtype}"
    cs = Case(label, lambda: kernels.flash_attention(q, k, v, out=out), lambda r: out, want, 2e-2)
    if c.b.is_cuda:
        F = c.torch.nn.functional
        tq, tk, tv = c.tt(q), c.tt(k), c.tt(v)
        res: dict[str, Any] = {}

        def sdpa() -> None:
            res["o"] = F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)

        cs.ref, cs.ref_out, cs.ref_label = sdpa, lambda: res["o"], "torch SDPA (enable_gqa)"
    return cs


def rms_norm_case(c: Ctx, rows: int, d: int, dtype: str) -> Case:
    xh, wh = c.host((rows, d)), c.host((d,))
    x, w = c.dev(xh, dtype), c.dev(wh, dtype)
    out = c.dev(np.zeros((rows, d), np.float32), dtype)
    x64, w64 = c.host_of(x).astype(np.float64), c.host_of(w).astype(np.float64)
    want = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-6) * w64
    cs = Case(f"rms_norm ({rows}, {d}) {dtype} (out=)",
              lambda: kernels.rms_norm(x, w, eps=1e-6, out=out), lambda r: out, want, 1e-2)
    if c.b.is_cuda:
        F = c.torch.nn.functional
        tx, tw = c.tt(x), c.tt(w)
        res: dict[str, Any] = {}

        def ref() -> None:
            res["o"] = F.rms_norm(tx, (d,), tw, 1e-6)

        cs.ref, cs.ref_out = ref, lambda: res["o"]
    return cs


def embedding_case(c: Ctx, vocab: int, d: int, dtype: str) -> Case:
    th = c.host((vocab, d))
    table_t = c.dev(th, dtype)
    ids_h = np.array([vocab - 3], np.int32)
    ids = deviceops.api.from_host(ids_h).sync_on(c.stream)
    out = c.dev(np.zeros((1, d), np.float32), dtype)
    want = c.host_of(table_t).astype(np.float64)[ids_h]
    cs = Case(f"embedding 1 id, table ({vocab}, {d}) {dtype} (out=)",
              lambda: kernels.embedding(ids, table_t, out=out), lambda r: out, want, 1e-6)
    if c.b.is_cuda:
        F = c.torch.nn.functional
        ti, tt_ = c.tt(ids).long(), c.tt(table_t)
        res: dict[str, Any] = {}

        def ref() -> None:
            res["o"] = F.embedding(ti, tt_)

        cs.ref, cs.ref_out = ref, lambda: res["o"]
    return cs


def argmax_case(c: Ctx, rows: int, vocab: int, dtype: str) -> Case:
    xh = c.host((rows, vocab))
    x = c.dev(xh, dtype)
    out = deviceops.api.zeros((rows,), "int32").sync_on(c.stream)
    want = np.argmax(c.host_of(x).astype(np.float64), axis=-1).astype(np.float64)
    cs = Case(f"argmax ({rows}, {vocab}) {dtype} (out=)", lambda: kernels.argmax(x, out=out),
              lambda r: out, want, 0.0)
    if c.b.is_cuda:
        tx = c.tt(x)
        res: dict[str, Any] = {}

        def ref() -> None:
            res["o"] = c.torch.argmax(tx, dim=-1)

        cs.ref, cs.ref_out = ref, lambda: res["o"]
    return cs


def all_cases(c: Ctx) -> tuple[list[Case], list[str]]:
    s = c.smoke
    h = "float16" if c.b.is_cuda else "float32"
    cases = [*saxpy_cases(c), add_case(c)]
    cases.append(gemm_case(c, 1, 256 if s else 4096, 256 if s else 4096, h))
    cases.append(gemm_case(c, 16 if s else 128, 64 if s else 768, 64 if s else 768,
                           "bfloat16" if c.b.is_cuda else "float32"))
    skipped: list[str] = []
    cases.append(gemm_case(c, 1, 96 if s else 1728, 64 if s else 576, h, trans_b=True))
    if c.b.is_cuda:
        cases.append(attention_case(c, 1, 32, 8, 4096, 128, "float16"))
        cases.append(attention_case(c, 1, 9, 3, 1024, 64, "float16"))
    else:
        cases.append(attention_case(c, 1, 4, 2, 32, 16, "float32"))
    cases.append(rms_norm_case(c, 1, 256 if s else 4096, h))
    cases.append(rms_norm_case(c, 1, 576, h))
    cases.append(embedding_case(c, 512 if s else 49152, 64 if s else 576, h))
    cases.append(argmax_case(c, 1, 1000 if s else 49152, h))
    return cases, skipped


# -- measurement -------------------------------------------------------------------------------


def check_case(c: Ctx, cs: Case) -> None:
    r = cs.ours().sync_on(c.stream)
    got = c.host_of(cs.out(r))
    err = _rel(got, cs.expect)
    check(err <= cs.tol, f"{cs.name}: ours vs float64 reference, rel err {err:.2e} <= {cs.tol}")
    cs.extra["rel_err"] = err
    if cs.ref is not None and cs.ref_out is not None:
        with c.torch.cuda.stream(c.ts):
            cs.ref()
        c.ts.synchronize()
        ref = cs.ref_out().float().cpu().numpy()
        rerr = _rel(ref, cs.expect)
        check(rerr <= max(cs.tol, 1e-6), f"{cs.name}: reference vs float64, rel err {rerr:.2e}")


def wall_per_call(c: Ctx, launch: Callable[[], Any], sync: Callable[[], None], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        launch()
    sync()
    return (time.perf_counter() - t0) / n * 1e6


def device_per_call(c: Ctx, launch: Callable[[], Any], n: int, host_us: float
                    ) -> tuple[float, bool, float]:
    """Device us per call with the launches queued behind a spin; (device us, spin outlasted
    host, host us per call spent enqueueing them)."""
    torch, cp = c.torch, c.b.cupy
    native = c.stream.native  # type: ignore[attr-defined]
    clock_hz = cp.cuda.Device().attributes["ClockRate"] * 1e3
    spin_s = max(2e-4, 2.0 * n * host_us * 1e-6 + 1e-4)
    e0, e1, e_spin = cp.cuda.Event(), cp.cuda.Event(), cp.cuda.Event()
    with torch.cuda.stream(c.ts):
        torch.cuda._sleep(int(spin_s * clock_hz))
    e_spin.record(native)
    e0.record(native)
    t0 = time.perf_counter()
    for _ in range(n):
        launch()
    host = (time.perf_counter() - t0) / n * 1e6
    e1.record(native)
    hidden = not e_spin.done  # the spin was still running when the host finished enqueueing
    e1.synchronize()
    return cp.cuda.get_elapsed_time(e0, e1) * 1e3 / n, hidden, host


def measure(c: Ctx, cs: Case, n: int, rounds: int) -> dict[str, Any]:
    stream = c.stream

    def ours() -> None:
        cs.ours().async_on(stream)

    ref_launch = cs.ref

    walls: dict[str, list[float]] = {"ours": [], "ref": []}
    devs: dict[str, list[float]] = {"ours": [], "ref": []}
    hosts: dict[str, list[float]] = {"ours": [], "ref": []}
    hidden_all = True
    ctx_torch = c.torch.cuda.stream(c.ts) if c.torch is not None else None
    with no_gc():
        if ctx_torch is not None:
            ctx_torch.__enter__()
        try:
            for i in range(rounds + 1):  # round 0 warms up
                order = [("ours", ours, stream.synchronize)]
                if ref_launch is not None:
                    order.append(("ref", ref_launch, c.ts.synchronize))
                if i % 2:
                    order.reverse()
                for name, fn, sync in order:
                    w = wall_per_call(c, fn, sync, n)
                    if i:
                        walls[name].append(w)
                    if c.b.is_cuda:
                        d, hidden, h = device_per_call(c, fn, n, w)
                        stream.synchronize()
                        if i:
                            devs[name].append(d)
                            hosts[name].append(h)
                            hidden_all = hidden_all and hidden
        finally:
            if ctx_torch is not None:
                ctx_torch.__exit__(None, None, None)
    row: dict[str, Any] = {
        "op": cs.name, "ours_wall_us": median(walls["ours"]),
        "reference": cs.ref_label if cs.ref is not None else "n/a (cpu backend)",
        "ref_wall_us": median(walls["ref"]) if walls["ref"] else None,
        "ours_dev_us": median(devs["ours"]) if devs["ours"] else None,
        "ref_dev_us": median(devs["ref"]) if devs["ref"] else None,
        "host_hidden": hidden_all if c.b.is_cuda else None,
        "ours_host_us": median(hosts["ours"]) if hosts["ours"] else None,
        "ref_host_us": median(hosts["ref"]) if hosts["ref"] else None,
        "rel_err": cs.extra.get("rel_err"), "kernel_op": cs.kernel, "calls": n, "rounds": rounds,
    }
    row["wall_ratio"] = (row["ours_wall_us"] / row["ref_wall_us"]) if row["ref_wall_us"] else None
    row["dev_ratio"] = (row["ours_dev_us"] / row["ref_dev_us"]) if row["ref_dev_us"] else None
    row["host_ratio"] = (row["ours_host_us"] / row["ref_host_us"]) if row["ref_host_us"] else None
    return row


def bars_for(rows: list[dict[str, Any]]) -> list[Bar]:
    by = {r["op"]: r for r in rows}
    bars: list[Bar] = []
    host_ratios = [r["host_ratio"] for r in rows if r["kernel_op"] and r["host_ratio"] is not None]
    bars.append(Bar("worst KernelOp host cost per call vs torch eager",
                    max(host_ratios) if host_ratios else None, "<=", 1.0, "x"))
    kernel_ratios = [r["wall_ratio"] for r in rows if r["kernel_op"] and r["wall_ratio"] is not None]
    bars.append(Bar("worst KernelOp wall time per call vs torch eager",
                    max(kernel_ratios) if kernel_ratios else None, "<=", 1.0, "x"))
    part = by.get("saxpy partition form (1024,)")
    pvf = by.get(PART_VS_FLAT)
    bars.append(Bar("saxpy partition form vs flat form (wall, alternating)",
                    pvf["wall_ratio"] if pvf else None, "<=", 1.15, "x"))
    bars.append(Bar("saxpy partition form vs raw CuPy RawKernel loop (wall)",
                    part["wall_ratio"] if part else None, "<=", 1.3, "x"))
    add = by.get("add(x, x) allocating (1024,)")
    bars.append(Bar("allocating add vs torch y = x + x (wall)",
                    add["wall_ratio"] if add else None, "<=", 1.3, "x"))
    return bars


def per_op_table(b: Bench, n: int, rounds: int, only: str | None = None
                 ) -> tuple[list[dict[str, Any]], list[Bar], list[str]]:
    """Check and measure every case (or those whose name contains one of the comma-separated
    words of ``only``); print the table and the bars; (rows, bars, skipped)."""
    stream = b.device.new_stream()
    c = Ctx(b, stream, b.smoke or not b.is_cuda)
    cases, skipped = all_cases(c)
    if only is not None:
        words = [w for w in only.split(",") if w]
        cases = [cs for cs in cases if any(w in cs.name for w in words)]
        if not cases:
            raise SystemExit(f"op_cost: no case name contains {only!r}")
    rows: list[dict[str, Any]] = []
    for cs in cases:
        try:
            check_case(c, cs)
        except (TypeError, deviceops.DTypeError) as e:  # a feature this version lacks
            skipped.append(f"{cs.name}: {type(e).__name__}: {e}")
            print(f"# {cs.name}: skipped ({e})", flush=True)
            continue
        rows.append(measure(c, cs, n, rounds))
        print(f"# {cs.name}: done", flush=True)
    print()
    print(f"Per-call cost (us), {n} calls per sample, median of {rounds} samples, ours and the "
          "reference alternating on the same stream")
    print(table(rows, [("op", "op (as users write it)", 0), ("ours_wall_us", "ours wall", 2),
                       ("ref_wall_us", "ref wall", 2), ("wall_ratio", "wall x", 2),
                       ("ours_host_us", "ours host", 2), ("ref_host_us", "ref host", 2),
                       ("host_ratio", "host x", 2),
                       ("ours_dev_us", "ours dev", 2), ("ref_dev_us", "ref dev", 2),
                       ("dev_ratio", "dev x", 2), ("host_hidden", "hidden", 0),
                       ("reference", "reference", 0)]))
    for s in skipped:
        print(f"# skipped: {s}")
    bars = bars_for(rows) if b.is_cuda else [
        Bar("worst KernelOp host cost per call vs torch eager (GPU only)", None, "<=", 1.0, "x")]
    print_bars(bars, b)
    return rows, bars, skipped


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--n", type=int, default=None, help="calls per sample (default 200; smoke 5)")
    p.add_argument("--rounds", type=int, default=None, help="samples per case (default 9; smoke 2)")
    p.add_argument("--only", default=None, metavar="TEXT",
                   help="measure only the cases whose name contains one of these comma-separated "
                        "words (e.g. 'allocating,saxpy')")
    args = p.parse_args()
    b = setup(args)
    n = args.n or (5 if b.smoke else 200)
    rounds = args.rounds or (2 if b.smoke else 9)
    rows, bars, skipped = per_op_table(b, n, rounds, args.only)
    write_json(args.json, "op_cost", b, {"calls": n, "rounds": rounds}, rows, bars,
               {"skipped": skipped})
    return 0


if __name__ == "__main__":
    main_guard(main)
