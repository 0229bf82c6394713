"""``benchmarks/serve.py --http-levels``: the multi-process server (a front and one engine
core per device) under streaming clients in several processes, beside ``generate`` with no
server in the same run, with the per-step profile of the cores (``--profile``).

For each level: tokens/s, TTFT and inter-token p50/p99 at the client; with ``--profile``,
from ``/metrics`` before and after: engine steps, rows per step, and the core's host time
per step by phase (admit, enqueue, wait for the device, deliver, recv, send), plus the CPU
seconds each process (front, cores) used per second of the level (1.0 = one core busy).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from typing import Any

from _serve_clients import Req, pct
from _serve_http import run_http_clients

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / _TICKS


def scrape(url: str) -> dict[str, float]:
    """The engine counters of ``/metrics`` summed over devices: steps, decode rows, and
    host seconds by phase (``phase:<name>``)."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        h = re.match(r'deviceops_time_to_first_token_seconds_bucket\{le="([^"]+)"\} (\S+)$',
                     line)
        if h:
            out[f"ttft_le:{h.group(1)}"] = float(h.group(2))
            continue
        m = re.match(r"(deviceops_engine_(?:steps|decode_rows|host_seconds))(?:_total)?"
                     r"(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        ph = re.search(r'phase="([^"]+)"', labels)
        key = f"phase:{ph.group(1)}" if ph else name.removeprefix("deviceops_engine_")
        out[key] = out.get(key, 0.0) + value
    return out


def profile(before: dict[str, float], after: dict[str, float], wall: float) -> dict[str, Any]:
    """Per-step figures between two :func:`scrape` results over ``wall`` seconds."""
    steps = after.get("steps", 0.0) - before.get("steps", 0.0)
    rows = after.get("decode_rows", 0.0) - before.get("decode_rows", 0.0)
    out: dict[str, Any] = {"steps": steps, "steps_per_s": steps / wall if wall else 0.0,
                           "rows_per_step": rows / steps if steps else 0.0}
    # the front's own time to first token (request arrival to the first token's chunk),
    # the median from the histogram's buckets (upper bound of the bucket holding it)
    les = sorted((float(k[8:]), after[k] - before.get(k, 0.0)) for k in after
                 if k.startswith("ttft_le:"))
    if les and les[-1][1] > 0:
        half = les[-1][1] / 2
        out["server_ttft_p50_le_ms"] = next(1e3 * le for le, n in les if n >= half)
    for k in sorted(after):
        if k.startswith("phase:"):
            d = after[k] - before.get(k, 0.0)
            out[f"{k[6:]}_us_per_step"] = 1e6 * d / steps if steps else 0.0
    return out


def start_server(path: str, port: int, max_batch: int, max_seq: int,
                 extra: list[str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m deviceops.nn.serve`` with its cores; waits for ``/health`` 200."""
    import httpx

    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "deviceops.nn.serve", "--model", path, "--port", str(port),
         "--max-batch", str(max_batch), "--max-seq", str(max_seq), "--log-level", "warning",
         "--max-queue", "4096", *(extra or [])], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("server not healthy in 300 s")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def core_pids(url: str) -> list[int]:
    """The engine cores' process ids, from ``/health`` (per-device servers list them)."""
    import httpx

    h = httpx.get(url + "/health", timeout=10).json()
    return [int(e["pid"]) for e in h.get("engines", []) if e.get("pid")]


def huge_prompts(url: str, n: int = 4, chars: int = 1_000_000) -> dict[str, Any]:
    """``n`` concurrent prompts of ``chars`` characters while ``/health`` is polled every
    5 ms: their statuses and the slowest ``/health`` answer."""
    import threading

    import httpx

    statuses: list[int] = []
    lat: list[float] = []
    done = threading.Event()
    text = ("lorem ipsum dolor sit amet " * (chars // 27 + 1))[:chars]

    def post() -> None:
        r = httpx.post(url + "/v1/completions", json={"prompt": text, "max_tokens": 4},
                       timeout=120)
        statuses.append(r.status_code)

    def poll() -> None:
        with httpx.Client(base_url=url, timeout=30) as c:
            while not done.is_set():
                t0 = time.perf_counter()
                c.get("/health")
                lat.append(time.perf_counter() - t0)
                time.sleep(0.005)

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.05)
    posts = [threading.Thread(target=post) for _ in range(n)]
    t0 = time.perf_counter()
    for t in posts:
        t.start()
    for t in posts:
        t.join()
    wall = time.perf_counter() - t0
    time.sleep(0.05)
    done.set()
    poller.join()
    out = {"prompts": n, "chars": chars, "statuses": sorted(statuses), "wall_s": wall,
           "health_polls": len(lat), "health_max_ms": 1e3 * max(lat) if lat else None}
    print(f"{n} prompts of {chars:,} characters: statuses {out['statuses']} in {wall:.2f} s; "
          f"/health slowest {out['health_max_ms']:.1f} ms over {len(lat)} polls", flush=True)
    return out


def bench_levels(path: str, reqs_for: Any, levels: list[int], *, client_procs: int,
                 max_batch: int, max_seq: int, port: int = 18331,
                 extra: list[str] | None = None) -> dict[str, Any]:
    """Start the server once, then for each level run ``reqs_for(level)`` through it."""
    proc, url = start_server(path, port, max_batch, max_seq, extra)
    out: dict[str, Any] = {"server_args": extra or []}
    try:
        pids = {"front": proc.pid}
        for i, pid in enumerate(core_pids(url)):
            pids[f"core{i}"] = pid
        out["huge_prompts"] = huge_prompts(url)
        warm = [([100 + i, 200, 300], 4) for i in range(max(levels))]
        run_http_clients(url, warm, max(levels), client_procs)
        for c in levels:
            reqs: list[Req] = reqs_for(c)
            before, cpu0 = scrape(url), {k: cpu_seconds(p) for k, p in pids.items()}
            rec = run_http_clients(url, reqs, c, client_procs)
            after, cpu1 = scrape(url), {k: cpu_seconds(p) for k, p in pids.items()}
            wall = rec["wall"]
            r = {"clients": c, "client_procs": client_procs, "requests": len(reqs),
                 "tokens": rec["tokens"], "wall_s": wall, "tokens_per_s": rec["tokens"] / wall,
                 "steady_tokens_per_s": rec["steady_tokens_per_s"],
                 "ttft_p50_ms": pct(rec["ttft"], 50) * 1e3,
                 "ttft_p99_ms": pct(rec["ttft"], 99) * 1e3,
                 "itl_p50_ms": pct(rec["itl"], 50) * 1e3, "itl_p99_ms": pct(rec["itl"], 99) * 1e3,
                 "profile": profile(before, after, wall),
                 "cpu_per_s": {k: (cpu1[k] - cpu0[k]) / wall for k in pids}}
            out[str(c)] = r
            prof = r["profile"]
            phases = ", ".join(f"{k[:-12]} {v:.0f}" for k, v in prof.items()
                               if k.endswith("_us_per_step"))
            if "server_ttft_p50_le_ms" in prof:
                phases += f"; server TTFT p50 <= {prof['server_ttft_p50_le_ms']:g} ms"
            print(f"http {c:4d} clients ({client_procs} client procs): "
                  f"{r['tokens_per_s']:9,.0f} tok/s (steady {r['steady_tokens_per_s']:,.0f})  TTFT p50 {r['ttft_p50_ms']:.1f} ms  "
                  f"ITL p50/p99 {r['itl_p50_ms']:.2f}/{r['itl_p99_ms']:.2f} ms | "
                  f"{prof['steps_per_s']:.0f} steps/s, {prof['rows_per_step']:.1f} rows/step, "
                  f"us/step: {phases} | CPU/s: " + ", ".join(
                      f"{k} {v:.2f}" for k, v in r["cpu_per_s"].items()), flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return out
