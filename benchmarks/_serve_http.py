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


def prompt_key(ids: list[int]) -> str:
    """A request's key in ``texts`` (:func:`run_http_clients` with ``record``): its prompt."""
    return " ".join(map(str, ids))


async def _http_clients(url: str, rs: list[Req], clients: int,
                        t_start: float | None = None, record: bool = False) -> dict[str, Any]:
    """``clients`` streaming clients taking ``rs`` in turn; tokens, TTFT and inter-token gaps
    as the clients see them, the wall-clock start and end (``time.time``) and the wall-clock
    time of every token event (``events``). ``t_start``: a ``time.time`` to wait for before
    the first request (client processes start together, whenever each finished importing).
    ``record``: each request's generated text in ``texts``, by :func:`prompt_key`."""
    import httpx

    rec: dict[str, Any] = {"tokens": 0, "ttft": [], "itl": [], "events": [], "texts": {}}
    events = rec["events"]

    async def one(c: Any, ids: list[int], n: int) -> None:
        body = {"prompt": ids, "max_tokens": n, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        last = None
        pieces: list[str] = []
        async with c.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    rec["tokens"] += ev["usage"]["completion_tokens"]
                    continue
                now = time.perf_counter()
                events.append(time.time())
                if record:
                    pieces.extend(ch.get("text", "") for ch in ev.get("choices", ()))
                if last is None:
                    rec["ttft"].append(now - t0)
                else:
                    rec["itl"].append(now - last)
                last = now
        if record:
            rec["texts"][prompt_key(ids)] = "".join(pieces)

    lim = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=lim) as c:
        nxt = 0
        if t_start is not None:
            await anyio.sleep(max(0.0, t_start - time.time()))

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


def _client_share(url: str, rs: list[Req], clients: int,
                  t_start: float | None = None, record: bool = False) -> dict[str, Any]:
    """One client process's share (a top-level function: run in a spawned process)."""
    result: dict[str, Any] = anyio.run(_http_clients, url, rs, clients, t_start, record)
    return result


#: Seconds between handing the client processes their shares and their common start: long
#: enough for a spawned process to import httpx and anyio, so none starts late.
START_DELAY_S = 3.0


def steady_rate(rec: dict[str, Any], trim: float = 0.1) -> float:
    """Tokens/s inside the run's middle window (the first and last ``trim`` of the wall time
    left out: clients starting up and the last requests draining), from the token events'
    times scaled by tokens per event (a held-back piece merges tokens into one event)."""
    ev, wall = rec["events"], rec["end"] - rec["start"]
    if not ev or wall <= 0:
        return 0.0
    lo, hi = rec["start"] + trim * wall, rec["end"] - trim * wall
    inside = sum(1 for t in ev if lo <= t < hi)
    return inside / (hi - lo) * rec["tokens"] / len(ev)


def run_http_clients(url: str, reqs: list[Req], clients: int, procs: int = 1,
                     record: bool = False) -> dict[str, Any]:
    """``clients`` streaming clients over ``procs`` client processes (one Python process
    parsing every stream's events can become the bottleneck before the server does);
    request ``i`` goes to process ``i % procs``; every process starts its clients at one
    wall-clock time (:data:`START_DELAY_S` after the shares are handed out). ``wall`` spans
    the common start to the last end; ``steady_tokens_per_s`` is :func:`steady_rate`'s."""
    if procs <= 1:
        rec = _client_share(url, reqs, clients, None, record)
    else:
        import concurrent.futures
        import multiprocessing

        procs = min(procs, clients)  # a process with no client would leave its share undone
        shares = [reqs[i::procs] for i in range(procs)]
        per = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
        t_start = time.time() + START_DELAY_S
        with concurrent.futures.ProcessPoolExecutor(
                procs, mp_context=multiprocessing.get_context("spawn")) as ex:
            recs = list(ex.map(_client_share, [url] * procs, shares, per, [t_start] * procs,
                               [record] * procs))
        late = max(r["start"] for r in recs) - t_start
        if late > 0.05:
            print(f"run_http_clients: a client process started {late:.2f} s late "
                  "(raise START_DELAY_S)", file=sys.stderr)
        rec = {"tokens": sum(r["tokens"] for r in recs), "ttft": [x for r in recs for x in r["ttft"]],
               "itl": [x for r in recs for x in r["itl"]], "start": min(r["start"] for r in recs),
               "end": max(r["end"] for r in recs),
               "events": [x for r in recs for x in r["events"]],
               "texts": {k: v for r in recs for k, v in r["texts"].items()}}
    rec["wall"] = rec["end"] - rec["start"]
    rec["steady_tokens_per_s"] = steady_rate(rec)
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
