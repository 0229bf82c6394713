"""The HTTP part of ``benchmarks/serve.py``: streaming SSE clients (httpx) against
``python -m deviceops.nn.serve``, spread over one or several client processes
(:func:`run_http_clients`), and :func:`bench_http`, which starts the server as a subprocess,
waits for its health check, warms it up and measures tokens/s, time to first token and
inter-token gaps at the client (``ray_serve.py`` uses ``run_http_clients`` too,
``_multi_gpu_serve.py`` ``bench_http``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import anyio
from _serve_clients import Req, pct


async def _http_clients(url: str, rs: list[Req], clients: int) -> dict[str, Any]:
    """``clients`` streaming clients taking ``rs`` in turn; tokens, TTFT and inter-token gaps
    as the clients see them, and the wall-clock start and end (``time.time``)."""
    import httpx

    rec: dict[str, Any] = {"tokens": 0, "ttft": [], "itl": []}

    async def one(c: Any, ids: list[int], n: int) -> None:
        body = {"prompt": ids, "max_tokens": n, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        last = None
        async with c.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    rec["tokens"] += ev["usage"]["completion_tokens"]
                    continue
                now = time.perf_counter()
                if last is None:
                    rec["ttft"].append(now - t0)
                else:
                    rec["itl"].append(now - last)
                last = now

    lim = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=lim) as c:
        nxt = 0

        async def client() -> None:
            nonlocal nxt
            while nxt < len(rs):
                i = nxt
                nxt += 1
                await one(c, rs[i][0], rs[i][1])

        rec["start"] = time.time()
        async with anyio.create_task_group() as tg:
            for _ in range(min(clients, len(rs))):
                tg.start_soon(client)
        rec["end"] = time.time()
    return rec


def _client_share(url: str, rs: list[Req], clients: int) -> dict[str, Any]:
    """One client process's share (a top-level function: run in a spawned process)."""
    result: dict[str, Any] = anyio.run(_http_clients, url, rs, clients)
    return result


def run_http_clients(url: str, reqs: list[Req], clients: int, procs: int = 1) -> dict[str, Any]:
    """``clients`` streaming clients over ``procs`` client processes (one Python process
    parsing every stream's events can become the bottleneck before the server does);
    request ``i`` goes to process ``i % procs``. ``wall`` spans the first start to the last
    end."""
    if procs <= 1:
        rec = _client_share(url, reqs, clients)
    else:
        import concurrent.futures
        import multiprocessing

        procs = min(procs, clients)  # a process with no client would leave its share undone
        shares = [reqs[i::procs] for i in range(procs)]
        per = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
        with concurrent.futures.ProcessPoolExecutor(
                procs, mp_context=multiprocessing.get_context("spawn")) as ex:
            recs = list(ex.map(_client_share, [url] * procs, shares, per))
        rec = {"tokens": sum(r["tokens"] for r in recs), "ttft": [x for r in recs for x in r["ttft"]],
               "itl": [x for r in recs for x in r["itl"]], "start": min(r["start"] for r in recs),
               "end": max(r["end"] for r in recs)}
    rec["wall"] = rec["end"] - rec["start"]
    return rec


def bench_http(path: str, reqs: list[Req], clients: int, max_batch: int, max_seq: int,
               port: int = 18321, devices: str | None = None, client_procs: int = 1,
               warm_prompts: bool = False) -> dict[str, Any]:
    """``clients`` streaming clients through ``python -m deviceops.nn.serve`` (a subprocess;
    ``devices``: its ``--devices`` value, one engine of ``max_batch`` rows per device), in
    ``client_procs`` client processes; after a warm-up of short prompts (and, with
    ``warm_prompts``, of the first ``clients`` prompts with 2 new tokens)."""
    import httpx

    url = f"http://127.0.0.1:{port}"
    where = ["--devices", devices] if devices else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "deviceops.nn.serve", "--model", path, "--port", str(port),
         "--max-batch", str(max_batch), "--max-seq", str(max_seq), "--log-level", "warning",
         "--max-queue", "4096", *where], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                return {"error": "server exited: " + proc.stderr.read().decode()[-600:]}  # type: ignore[union-attr]
            if time.monotonic() > deadline:
                return {"error": "server not healthy in 180 s"}
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)

        try:
            warm = [([100 + i, 200, 300], 4) for i in range(clients)]
            if warm_prompts:  # e.g. the same prompt lengths once, so no timed request meets a
                warm += [(list(ids), 2) for ids, _ in reqs[:clients]]  # first-use capture
            run_http_clients(url, warm, clients, client_procs)
            rec = run_http_clients(url, reqs, clients, client_procs)
        except Exception as exc:  # the server went away: say why (its stderr), not only the client's error
            proc.terminate()
            try:
                _, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            return {"error": f"client: {type(exc).__name__}: {exc}; server rc {proc.returncode}, stderr: "
                             + err.decode(errors="replace")[-1500:]}
        return {"clients": clients, "client_procs": client_procs, "requests": len(reqs), "tokens": rec["tokens"],
                "wall_s": rec["wall"], "tokens_per_s": rec["tokens"] / rec["wall"],
                "ttft_p50_ms": pct(rec["ttft"], 50) * 1e3, "ttft_p99_ms": pct(rec["ttft"], 99) * 1e3,
                "itl_p50_ms": pct(rec["itl"], 50) * 1e3, "itl_p99_ms": pct(rec["itl"], 99) * 1e3,
                "note": "token-level ITL at the client: SSE events (a held-back piece merges tokens)"}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
