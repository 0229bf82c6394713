"""Split-KV decode: kernel variants (NVRTC defines, warps, split target, cluster) beside every
torch SDPA backend, all timed interleaved call by call, L2 flushed before each
(``_Timer.compare_samples``), at the decode-table points below 1.0x (``--all``: every point). Each variant's output is checked against the planned
kernel's before it is timed.

Usage (GPU machine)::

    python3 tools/attn_variants_gpu.py [--reps N] [--only 'GQA B32'] \\
        [--variants 'same;UK=2;PREFETCH=1,UK=2;warps=8,target=8'] [--all] [--json out.json]

A variant is ``,``-separated items: ``NAME=V`` (``-DATTN_NAME=V``), ``warps=W``,
``target=T`` (split blocks per SM), ``cl=C`` (cluster merge, 0 = combine kernel),
``minsteps=S``; ``same`` (or ``same#N``): the planned kernel again, a noise gauge.
``BULK=N`` forces the bulk-copy K/V ring with N stages (``BULK=0``: the register path);
either one, or ``warps=W``, turns off the planner's own ring choice for that variant.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)) + "/../benchmarks")
import attention as A

POINTS = [
    ("GQA", 32, 8, 128, 32, 32768),
    ("GQA", 32, 8, 128, 32, 1024),
    ("GQA", 32, 8, 128, 1, 4096),
    ("GQA", 32, 8, 128, 8, 32768),
    ("SmolLM2", 9, 3, 64, 32, 1024),
    ("SmolLM2", 9, 3, 64, 32, 512),
    ("SmolLM2", 9, 3, 64, 32, 256),
    # the same K/V bytes as the GQA rows with a quarter of the math (one head a block):
    # how far the CUDA-core math limits the bandwidth-bound points
    ("MHA", 8, 8, 128, 32, 32768),
    ("MHA", 8, 8, 128, 8, 32768),
]
VARIANTS = "same;UK=2;PREFETCH=1,UK=2;warps=8;warps=16"


def overrides_of(spec: str) -> Any:
    from deviceops.kernels._experiment import KernelOverrides

    defines: list[str] = []
    fields: dict[str, Any] = {}
    for item in filter(None, spec.split(",")):
        name, val = item.split("=")
        if name == "warps":
            fields["attention_split_warps"] = int(val)
        elif name == "target":
            fields["attention_split_blocks_per_sm"] = int(val)
        elif name == "cl":
            fields["attention_cluster"] = int(val)
        elif name == "minsteps":
            fields["attention_split_min_steps"] = int(val)
        else:
            defines.append(f"-DATTN_{name}={val}")
    return KernelOverrides(attention_splitkv_defines=tuple(defines), **fields)


def variant_calls(sets: list[tuple[Any, ...]], stream: Any, ws: Any, ov: Any) -> list[Any]:
    from deviceops.kernels import _experiment as X

    calls = []
    for fn in A._ours_calls(sets, stream, ws):

        def call(fn: Any = fn) -> None:
            prev = X.set_overrides(ov)
            try:
                fn()
            finally:
                X.set_overrides(prev)

        calls.append(call)
    return calls


def run_point(point: tuple, specs: list[str], reps: int) -> dict[str, Any]:
    import cupy
    import torch

    from deviceops.kernels import _attention as attn

    label, hq, hkv, d, b, lk = point
    timer = A._Timer()
    torch.manual_seed(b * 100000 + lk)
    sets = A._decode_sets(b, hq, hkv, lk, d, torch.float16)
    nbytes = attn.attention_workspace_nbytes((b, hq, 1, d), (b, hkv, lk, d), None)
    ws = cupy.empty(max(nbytes, 1), dtype=cupy.uint8)
    named: dict[str, list[Any]] = {"default": A._ours_calls(sets, timer.stream, ws)}
    o = sets[0][3]
    named["default"][0]()
    torch.cuda.synchronize()
    ref = o.float().clone()
    bad: dict[str, float] = {}
    for spec in specs:
        key = spec.split("#")[0]  # "same#1": the planned kernel again (a noise gauge)
        calls = variant_calls(sets, timer.stream, ws, overrides_of("" if key == "same" else key))
        o.fill_(float("nan"))
        try:
            calls[0]()
        except ValueError as e:  # a forced configuration that cannot serve this point
            print(f"    {spec}: {e}", flush=True)
            continue
        torch.cuda.synchronize()
        err = float((o.float() - ref).abs().max())
        if not err <= 2e-3:
            bad[spec] = err
            continue
        named[spec] = calls
    named.update(A._sdpa_calls(sets))
    samples = timer.compare_samples(named, reps)
    times = {n: statistics.median(v) for n, v in samples.items()}
    del sets
    torch.cuda.empty_cache()
    best_sdpa = min(times.get(n, float("inf")) for n in A.SDPA_NAMES)
    quart = {n: [round(x, 2) for x in statistics.quantiles(v, n=4)] for n, v in samples.items()}
    row = {"point": f"{label} B{b} Lk{lk}", "times_us": {n: round(t, 2) for n, t in times.items()},
           "quartiles_us": quart,
           "best_sdpa_us": round(best_sdpa, 2), "bad": bad}
    ours = {n: t for n, t in times.items() if n not in A.SDPA_NAMES}
    best = min(ours, key=ours.__getitem__)
    print(f"{row['point']:22s} sdpa {best_sdpa:8.2f} default {ours['default']:8.2f} "
          f"({best_sdpa / ours['default']:.3f}x) best {ours[best]:8.2f} ({best_sdpa / ours[best]:.3f}x) {best}",
          flush=True)
    for n, t in sorted(ours.items(), key=lambda x: x[1]):
        print(f"    {n:28s} {t:8.2f}  {best_sdpa / t:.3f}x  q1-q3 {quart[n][0]:.2f}-{quart[n][2]:.2f}", flush=True)
    if bad:
        print(f"    WRONG OUTPUT (max abs err vs planned): {bad}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--only", default="")
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--json", default="")
    ap.add_argument("--all", action="store_true", help="every decode-table point")
    a = ap.parse_args()
    specs = [s for s in a.variants.split(";") if s]
    points = A.decode_table_points() if a.all else POINTS
    rows = [run_point(p, specs, a.reps) for p in points if a.only in f"{p[0]} B{p[4]} Lk{p[5]}"]
    if a.json:
        with open(a.json, "w") as f:
            import torch

            json.dump({"device": torch.cuda.get_device_name(), "variants": specs, "reps": a.reps,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
