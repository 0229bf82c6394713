"""Per-op host overhead: chains of tiny saxpy DeviceOps beside raw CuPy launches.

Usage::

    python benchmarks/overhead.py [--smoke] [--json PATH]

For N = 1, 10, 100, 1000 tiny ops (``z = 2 x + z`` on 1024 float32 elements),
in the same run, interleaved round-robin:

| variant                | what is timed (host wall, incl. the final sync) / N          |
|------------------------|--------------------------------------------------------------|
| async_on chain         | ``kernels.saxpy(z, 2.0, x).async_on(s)`` N times, then sync  |
| sync_on per op         | ``kernels.saxpy(z, 2.0, x).sync_on(s)`` N times              |
| then-chain, one op     | N saxpys composed with ``then`` into one op, ``async_on``    |
| raw async loop (ref)   | a raw CuPy ``RawKernel`` saxpy launched N times, then sync   |
| raw launch+sync (ref)  | raw launch + ``stream.synchronize()`` per op                 |

Ops are built each time, as a user writes them. The raw kernel is our own tiny
RawModule with deviceops' launch shape (1 block of 256 threads per 1024
elements). On the cpu backend both references are a plain NumPy loop.

Correctness: integer-valued data, so after every timed launch the buffers must
equal ``z0 + 2 * count * x`` exactly (checked for each N and variant).

Bar: async_on chain per op at N=100 <= 1.3x the raw async loop.

Then (unless ``--no-per-op``) the per-op table of :mod:`op_cost`: the partition and flat
forms, allocating ops and every KernelOp at decode sizes (gemm 1x4096x4096 and
128x768x768, flash_attention decode, rms_norm, embedding, argmax), each beside torch eager
in the same run: wall, host (enqueue behind a spin) and device time per call, with
issue 12's bars. The README's per-op figures come from this command.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np
from _common import (
    Bar,
    Bench,
    add_common_args,
    check_equal,
    download,
    int_data,
    interleave,
    launch_geometry,
    main_guard,
    median,
    pct,
    print_bars,
    raw_kernels,
    setup,
    table,
    upload,
    write_json,
)
from op_cost import per_op_table

import deviceops
from deviceops import api, kernels

SIZE = 1024
A = 2.0
FULL = {1: 2000, 10: 500, 100: 100, 1000: 20}
SMOKE = {1: 20, 10: 10, 100: 3, 1000: 1}

PAIRS = [  # (ours, its reference, label)
    ("ours_async", "raw_async", "async_on chain"),
    ("ours_sync", "raw_sync", "sync_on per op"),
    ("ours_then", "raw_async", "then-chain, one op"),
]
REF_LABEL = {"raw_async": "raw async loop", "raw_sync": "raw launch+sync/op"}


class Buffers:
    """One z buffer per variant (separate so each variant's launch count is checked)."""

    def __init__(self, b: Bench, stream: deviceops.Stream, rng: np.random.Generator) -> None:
        self.b = b
        self.stream = stream
        self.z0 = int_data(rng, SIZE, -1000, 1000)
        self.x_host = int_data(rng, SIZE, -3, 3)
        self.x = upload(self.x_host, stream)
        self.z0_t = upload(self.z0, stream)
        self.ours: dict[str, deviceops.Tensor] = {}
        self.raw: dict[str, Any] = {}
        self.count: dict[str, int] = {}
        if b.cupy is not None:
            cp = b.cupy
            self.raw_x = cp.asarray(self.x_host)
            self.raw_fn = raw_kernels(cp)["raw_saxpy"]  # compiled once, reused for every N
            self.raw_stream = cp.cuda.Stream(non_blocking=True)
        else:
            self.raw_x = self.x_host.copy()

    def reset(self, names: list[str]) -> None:
        for n in names:
            self.count[n] = 0
            if n.startswith("ours"):
                if n not in self.ours:
                    self.ours[n] = upload(self.z0, self.stream)
                else:
                    api.memcpy(self.ours[n], self.z0_t).sync_on(self.stream)
            else:
                self.raw[n] = self.b.cupy.asarray(self.z0) if self.b.cupy is not None else self.z0.copy()
        if self.b.cupy is not None:
            self.b.cupy.cuda.Device().synchronize()

    def verify(self, n: str, label: str) -> None:
        want = self.z0 + np.float32(A) * np.float32(self.count[n]) * self.x_host
        if n.startswith("ours"):
            got = download(self.ours[n], self.stream)
        else:
            got = self.b.cupy.asnumpy(self.raw[n]) if self.b.cupy is not None else self.raw[n]
        check_equal(got, want.astype(np.float32), f"{label}: z after {self.count[n]} saxpy ops")


def make_variants(b: Bench, buf: Buffers, stream: deviceops.Stream, n: int) -> dict[str, Callable[[], Any]]:
    x = buf.x

    def ours_async() -> None:
        z = buf.ours["ours_async"]
        for _ in range(n):
            kernels.saxpy(z, A, x).async_on(stream)
        stream.synchronize()
        buf.count["ours_async"] += n

    def ours_sync() -> None:
        z = buf.ours["ours_sync"]
        for _ in range(n):
            kernels.saxpy(z, A, x).sync_on(stream)
        buf.count["ours_sync"] += n

    def ours_then() -> None:
        z = buf.ours["ours_then"]

        def step(_: Any) -> deviceops.DeviceOp[Any]:
            return kernels.saxpy(z, A, x)

        op = kernels.saxpy(z, A, x)
        for _ in range(n - 1):
            op = op.then(step)
        op.async_on(stream)
        stream.synchronize()
        buf.count["ours_then"] += n

    variants: dict[str, Callable[[], Any]] = {
        "ours_async": ours_async, "ours_sync": ours_sync, "ours_then": ours_then,
    }
    if b.cupy is not None:
        fn = buf.raw_fn
        grid, block = launch_geometry(SIZE)
        cs = buf.raw_stream
        rx = buf.raw_x
        a32, n64 = np.float32(A), np.int64(SIZE)

        def raw_async() -> None:
            z = buf.raw["raw_async"]
            for _ in range(n):
                fn(grid, block, (z, a32, rx, n64), stream=cs)
            cs.synchronize()
            buf.count["raw_async"] += n

        def raw_sync() -> None:
            z = buf.raw["raw_sync"]
            for _ in range(n):
                fn(grid, block, (z, a32, rx, n64), stream=cs)
                cs.synchronize()
            buf.count["raw_sync"] += n
    else:
        hx = buf.raw_x
        a32 = np.float32(A)

        def raw_async() -> None:
            z = buf.raw["raw_async"]
            for _ in range(n):
                z += a32 * hx
            buf.count["raw_async"] += n

        def raw_sync() -> None:
            z = buf.raw["raw_sync"]
            for _ in range(n):
                z += a32 * hx
            buf.count["raw_sync"] += n

    variants["raw_async"] = raw_async
    variants["raw_sync"] = raw_sync
    return variants


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--samples-scale", type=float, default=1.0, help="multiply the sample counts")
    p.add_argument("--no-per-op", action="store_true", help="skip the per-op table (op_cost)")
    p.add_argument("--per-op-n", type=int, default=None, help="calls per per-op sample (200)")
    p.add_argument("--per-op-rounds", type=int, default=None, help="per-op samples (9)")
    args = p.parse_args()
    b = setup(args)
    counts = SMOKE if args.smoke else FULL
    stream = b.device.new_stream()
    rng = np.random.default_rng()
    buf = Buffers(b, stream, rng)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for n, samples in counts.items():
        samples = max(1, round(samples * args.samples_scale))
        # then-chains execute iteratively: no recursion limit to raise at any N
        variants = make_variants(b, buf, stream, n)
        buf.reset(list(variants))
        times = interleave(variants, samples, warmup=1 if n >= 1000 else 2)
        for name in variants:
            buf.verify(name, f"N={n} {name}")
        per_op = {k: [t / n * 1e6 for t in v] for k, v in times.items()}
        for ours, ref, label in PAIRS:
            o, r = median(per_op[ours]), median(per_op[ref])
            rows.append({
                "N": n, "variant": label, "ours_us": o, "ours_p90_us": pct(per_op[ours], 90),
                "reference": REF_LABEL[ref] if b.is_cuda else "NumPy loop", "ref_us": r,
                "ratio": o / r, "extra_us": o - r, "samples": len(per_op[ours]),
            })
        print(f"# N={n}: done ({samples} samples per variant)", flush=True)

    print()
    print("Per-op host time (us): whole chain incl. final sync / N, median over samples")
    print(table(rows, [("N", "N", 0), ("variant", "deviceops variant", 0), ("ours_us", "ours us/op", 2),
                       ("ours_p90_us", "p90", 2), ("reference", "reference", 0), ("ref_us", "ref us/op", 2),
                       ("ratio", "ratio", 2), ("extra_us", "+us/op", 2)]))
    for note in notes:
        print(f"# note: {note}")
    row100 = next((r for r in rows if r["N"] == 100 and r["variant"] == "async_on chain"), None)
    bars = [Bar("async_on chain per op at N=100 vs raw async loop",
                None if row100 is None else row100["ratio"], "<=", 1.3, "x")]
    print_bars(bars, b)
    per_op: list[dict[str, Any]] = []
    if not args.no_per_op:
        print()
        per_op, op_bars, skipped = per_op_table(
            b, args.per_op_n or (5 if b.smoke else 200), args.per_op_rounds or (2 if b.smoke else 9))
        bars += op_bars
        notes += [f"per-op skipped: {s}" for s in skipped]
    write_json(args.json, "overhead", b,
               {"size": SIZE, "dtype": "float32", "a": A, "counts": counts, "samples_scale": args.samples_scale},
               rows, bars, {"notes": notes, "per_op": per_op})
    return 0


if __name__ == "__main__":
    main_guard(main)
