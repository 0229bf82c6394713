"""Two GPUs: zip over devices and peer copies, each beside a reference in the same run.

Usage::

    python benchmarks/multi_gpu.py [--devices 0,1] [--reps N] [--copy-reps N]
                                   [--n 4096] [--chain 60] [--copy-mib 1024]
                                   [--no-host] [--json PATH] [--smoke]

Sections (issue 29's bars):

1. **zip over GPUs.** Two independent chains of ``--chain`` float16 GEMMs
   (``x -> kernels.gemm(x, w_i, alpha=1/sqrt(n))``, n x n, each GEMM allocating its
   output, chained through DeviceOp arguments). Chain 0's tensors live on device 0,
   chain 1's on device 1; ``deviceops.zip(chain0, chain1).sync()`` runs under
   ``deviceops.using(MultiDeviceRoundRobin([d0, d1]))``. Reference: the same two
   chains (chain 1's tensors copied to device 0) zipped on device 0 under the default
   policy (``StreamPoolRoundRobin`` of the default device, set to device 0). Also one
   chain alone on device 0 (T: the ideal for the multi run; 2T for the single one).
   Host wall time from building the ops to the end of ``.sync()``, median of
   ``--reps`` interleaved runs after warm-up. Bar: multi / single <= 0.55. Diagnostic
   column: host time to build the ops and ``schedule()`` them (the part of a run that
   is not waiting for the devices; zip enqueues chain 1 after chain 0).
2. **peer copy.** ``api.to_device(t, d1).sync()`` of a ``--copy-mib`` float32 tensor
   from device 0 to device 1, and back (1 -> 0); beside ``torch`` ``.to("cuda:j")``
   of the same tensor. GB/s (1e9 bytes/s, bytes = the tensor's size) from host wall
   time (median of ``--copy-reps`` >= 10) and from CUDA events: ours on a stream of
   the destination (``async_on``), torch's on the source's current stream (where
   torch copies between devices). Bar: ours / torch (wall) >= 0.8.
3. **staged host copies** (context, no bar; ``--no-host`` skips): ``api.from_host``
   of a pageable NumPy array and ``api.to_host`` on device 0, beside
   ``torch.from_numpy(h).to(dev)`` and ``t.cpu()``.

Correctness (every timed run, untimed): every chain output against a float64
reference of the same chain on the device its inputs live on (CuPy float64 on the
GPU, NumPy in smoke), ||out - ref|| / ||ref|| <= 1e-2 and finite; chain 1 of the multi
run must live on device 1. Inputs rotate between two ``x`` per chain (and two
sources per copy), so a stale output from an earlier run cannot pass. Every copy
(ours and torch's) is compared bit for bit with an independent copy of its source
made at set-up. Any failure: the JSON record says ``checks.passed: false`` with the
failures, and the script exits 1. ``--inject-error`` corrupts the references (the
last GEMM dropped, the other copy source) to show the checks can fail.

``--smoke``: the same code on the emulated cpu devices ``cpu:0`` and ``cpu:1``, n = 64,
chains of 4, 1 MiB copies, no torch; seconds on two cores. Non-smoke runs need two
CUDA GPUs and exit 2 with a message otherwise. On the GPU machine::

    python benchmarks/multi_gpu.py --json benchmarks/results/multi_gpu.json
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

from _common import (
    Bar,
    Bench,
    CheckFailed,
    add_common_args,
    env_info,
    main_guard,
    print_bars,
    table,
    write_json,
)
from _multi_gpu_checks import Checks
from _multi_gpu_copies import Torch, copy_section, host_section
from _multi_gpu_devices import device_name, parse_devices
from _multi_gpu_serve import serve_section
from _multi_gpu_zip import CHAIN_TOL, ZIP_BAR, zip_section

import deviceops

COPY_BAR = 0.8
SERVE_BAR = 1.8  # tokens/s of --devices d0,d1 over one device, same clients


# -- main ----------------------------------------------------------------------------------
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--devices", default=None,
                   help="two devices, comma-separated (default 0,1; smoke cpu:0,cpu:1)")
    p.add_argument("--n", type=int, default=None, help="GEMM size n (4096; smoke 64)")
    p.add_argument("--chain", type=int, default=None, help="GEMMs per chain (60; smoke 4)")
    p.add_argument("--reps", type=int, default=None, help="timed runs per zip variant (10; smoke 3)")
    p.add_argument("--copy-mib", type=float, default=None, help="copy size in MiB (1024; smoke 1)")
    p.add_argument("--copy-reps", type=int, default=None, help="timed runs per copy variant (20; smoke 10)")
    p.add_argument("--no-host", action="store_true", help="skip the staged host copies")
    p.add_argument("--serve", default=None, metavar="GGUF",
                   help="also measure HTTP serving of this model: --devices d0,d1 against one device")
    p.add_argument("--serve-only", action="store_true", help="only the serving section (needs --serve)")
    p.add_argument("--serve-clients", type=int, default=None, help="concurrent clients (128; smoke 4)")
    p.add_argument("--serve-requests", type=int, default=None, help="requests per run (512; smoke 8)")
    p.add_argument("--client-procs", type=int, default=None,
                   help="client processes sharing the clients (4; smoke 2): the load generator "
                        "must not be the bottleneck")
    p.add_argument("--inject-error", action="store_true",
                   help="corrupt the references: the checks must fail (exit 1)")
    args = p.parse_args()
    smoke = bool(args.smoke)
    spec = args.devices or ("cpu:0,cpu:1" if smoke else "0,1")
    n = args.n or (64 if smoke else 4096)
    steps = args.chain or (4 if smoke else 60)
    reps = args.reps or (3 if smoke else 10)
    copy_reps = max(10, args.copy_reps or (10 if smoke else 20))
    nbytes = int((args.copy_mib or (1 if smoke else 1024)) * 2**20) // 4 * 4

    toks = [t.strip() for t in spec.split(",") if t.strip()]
    if len(toks) != 2:
        print(f"multi_gpu: --devices needs exactly two devices, got {spec!r}", file=sys.stderr)
        return 2
    wants_cuda = any(not t.startswith("cpu") for t in toks)
    if not smoke or wants_cuda:
        if not deviceops.cuda_available():
            print("multi_gpu: no usable CUDA GPU; this benchmark needs two GPUs "
                  "(run with --smoke for the cpu emulation)", file=sys.stderr)
            return 2
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
        if count < 2:
            print(f"multi_gpu: found {count} CUDA GPU; this benchmark needs two "
                  "(run with --smoke for the cpu emulation)", file=sys.stderr)
            return 2
    devs = parse_devices(spec)
    if devs[0] is devs[1]:
        print(f"multi_gpu: the two devices must differ, got {spec!r}", file=sys.stderr)
        return 2
    if devs[0].backend is not devs[1].backend:
        print(f"multi_gpu: cannot mix cpu and CUDA devices ({spec!r})", file=sys.stderr)
        return 2
    cp = None
    if not devs[0].is_cpu:
        import cupy

        cp = cupy
        cupy.cuda.Device(devs[0].index).use()
    deviceops.set_default_device(devs[0])  # the default policy: StreamPoolRoundRobin(devs[0])
    b = Bench(devs[0], cp, smoke)
    names = [device_name(d, cp) for d in devs]
    info = env_info(b)
    peer = None
    if cp is not None:
        peer = {f"{a.index}->{c.index}": bool(cp.cuda.runtime.deviceCanAccessPeer(a.index, c.index))
                for a, c in ((devs[0], devs[1]), (devs[1], devs[0]))}
    print(f"# devices: {devs[0]} = {names[0]}, {devs[1]} = {names[1]}; "
          f"{'smoke' if smoke else 'full'} run, {info['date']}"
          + (f"; peer access {peer}" if peer else ""), flush=True)
    if devs[0].is_cpu:
        print("# cpu backend: figures measure the NumPy/worker-thread emulation; the bars are "
              "GPU targets and only informational here", flush=True)

    torch: Torch | None = None
    torch_note = "not used on the cpu backend"
    if cp is not None:
        try:
            torch = Torch()
            torch_note = torch.version
        except ImportError:
            torch_note = "not installed: torch references skipped"
            print(f"# torch {torch_note}", flush=True)

    checks = Checks()
    t_start = time.perf_counter()
    bars: list[Bar] = []
    zip_rows: list[dict[str, Any]] = []
    zip_summary: dict[str, Any] = {}
    copy_rows: list[dict[str, Any]] = []
    host_rows: list[dict[str, Any]] = []
    if args.serve_only and not args.serve:
        print("multi_gpu: --serve-only needs --serve GGUF", file=sys.stderr)
        return 2
    if not args.serve_only:
        zip_rows, zip_summary = zip_section(b, devs, n, steps, reps, checks, args.inject_error)
        copy_rows = [copy_section(b, devs[0], devs[1], nbytes, copy_reps, checks, torch, args.inject_error),
                     copy_section(b, devs[1], devs[0], nbytes, copy_reps, checks, torch, args.inject_error)]
        host_rows = ([] if args.no_host else
                     host_section(b, devs[0], nbytes, copy_reps, checks, torch, args.inject_error))
        wall = time.perf_counter() - t_start

        print()
        print(f"copies: {nbytes / 2**20:g} MiB float32, GB/s = 1e9 B/s of the tensor's size; median of "
              f"{copy_reps} interleaved runs (wall: host clock around .sync(); events: CUDA events on "
              "the copying stream)")
        print(table(copy_rows + host_rows,
                    [("variant", "copy", 0), ("ours_GBps", "ours GB/s", 1), ("ours_ev_GBps", "ours ev", 1),
                     ("ref_GBps", "torch GB/s", 1), ("ref_ev_GBps", "torch ev", 1), ("ratio", "ours/torch", 2),
                     ("ev_ratio", "ev ratio", 2), ("ours_ms", "ours ms", 3), ("ref_ms", "torch ms", 3)]))
        if torch is None:
            print(f"# torch reference: {torch_note}")
        print(f"# {wall:.1f} s of set-up and timed runs")
        bars += [Bar(f"zip 2 chains on {devs[0]}+{devs[1]}: multi / single wall time, build..sync()",
                     zip_summary["ratio"], "<=", ZIP_BAR),
                 Bar(f"zip 2 chains on {devs[0]}+{devs[1]}: multi / single wall time, .sync() of "
                     "prebuilt ops", zip_summary["sync_ratio"], "<=", ZIP_BAR),
                 Bar(f"peer copy {devs[0]}->{devs[1]}: ours / torch GB/s (wall)",
                     copy_rows[0]["ratio"], ">=", COPY_BAR),
                 Bar(f"peer copy {devs[1]}->{devs[0]}: ours / torch GB/s (wall)",
                     copy_rows[1]["ratio"], ">=", COPY_BAR)]
    serve_rows: list[dict[str, Any]] = []
    serve_summary: dict[str, Any] = {}
    if args.serve:
        clients = args.serve_clients or (4 if smoke else 128)
        nreq = args.serve_requests or (8 if smoke else 512)
        new_tok = 4 if smoke else 128
        serve_rows, serve_summary = serve_section(args.serve, devs, clients, nreq, new_tok,
                                                  max(1, clients // 2), checks,
                                                  args.client_procs or (1 if smoke else 4))
        print()
        print(f"serving over HTTP: {nreq} requests, {new_tok} new tokens each (EOS ignored), "
              f"streaming clients in {args.client_procs or (1 if smoke else 4)} client processes; "
              "one engine of the given rows per device")
        print(table(serve_rows, [("variant", "server", 0), ("tokens_per_s", "tokens/s", 0),
                                 ("ttft_p50_ms", "TTFT p50 ms", 1), ("ttft_p99_ms", "TTFT p99 ms", 1),
                                 ("itl_p50_ms", "ITL p50 ms", 2), ("itl_p99_ms", "ITL p99 ms", 2),
                                 ("wall_s", "wall s", 1)]))
        bars += [Bar(f"serve --devices {devs[0]},{devs[1]} / best one device, {clients} clients: "
                     "tokens/s", serve_summary["ratio"], ">=", SERVE_BAR),
                 Bar(f"serve --devices, {clients} clients: p99 inter-token ms vs one device at "
                     f"{clients // 2}", serve_summary["itl_p99_two_ms"], "<=",
                     serve_summary["itl_p99_one_half_clients_ms"])]
    print_bars(bars, b)

    summary = checks.summary()
    write_json(args.json, "multi_gpu", b,
               {"devices": [str(d) for d in devs], "n": n, "chain": steps, "dtype": "float16",
                "alpha": 1.0 / math.sqrt(n), "reps": reps, "copy_bytes": nbytes,
                "copy_reps": copy_reps, "host_copies": not args.no_host,
                "inject_error": bool(args.inject_error), "chain_tol": CHAIN_TOL},
               [r for r in (zip_summary, *copy_rows, *host_rows, *serve_rows) if r], bars,
               {"devices": [str(d) for d in devs], "device_names": names, "peer_access": peer,
                "torch": torch_note, "zip_rows": zip_rows, "serve": serve_summary,
                "ratios": {"zip_multi_over_single": zip_summary.get("ratio"),
                           "copy_0to1_ours_over_torch": copy_rows[0]["ratio"] if copy_rows else None,
                           "copy_1to0_ours_over_torch": copy_rows[1]["ratio"] if copy_rows else None,
                           "serve_two_over_one": serve_summary.get("ratio")},
                "checks": summary, "correctness": checks.records[-200:]})
    if not summary["passed"]:
        first = summary["failed"][0] if summary["failed"] else {"what": "no checks ran"}
        raise CheckFailed(f"{summary['failed_count']} of {summary['count']} checks failed; first: {first}")
    print(f"# correctness: {summary['count']} checks passed")
    return 0


if __name__ == "__main__":
    main_guard(main)
