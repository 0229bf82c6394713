"""The in-process client load of ``benchmarks/serve.py``: the request type and workload
generator, percentiles, process and GPU memory readings, the 1 ms event-loop ticker, the
concurrent ``engine.submit`` clients with their per-token timings at the client, the warm-up
of every decode bucket, and the one-line summary of a run (``ray_serve.py`` and
``_multi_gpu_serve.py`` use ``workload`` and ``pct`` too).
"""

from __future__ import annotations

import random
import time
from typing import Any

import anyio

Req = tuple[list[int], int]  # (prompt ids, new tokens)


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile (0-100) of xs, nearest rank; NaN if empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def gpu_mb() -> dict[str, float]:
    try:
        import cupy

        pool = cupy.get_default_memory_pool()
        free, total = cupy.cuda.runtime.memGetInfo()
        return {"pool_used_mb": pool.used_bytes() / 2**20, "pool_total_mb": pool.total_bytes() / 2**20,
                "device_used_mb": (total - free) / 2**20}
    except Exception:
        return {}


def workload(rng: random.Random, n: int, vocab: int, plen: tuple[int, int],
             nnew: tuple[int, int]) -> list[Req]:
    return [([rng.randrange(100, vocab) for _ in range(rng.randint(*plen))], rng.randint(*nnew))
            for _ in range(n)]


class Ticker:
    """A 1 ms ticker in the event loop: the worst interval between its wake-ups."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.running = True

    async def run(self) -> None:
        last = time.perf_counter()
        while self.running:
            await anyio.sleep(0.001)
            now = time.perf_counter()
            self.worst = max(self.worst, now - last)
            last = now


async def idle_gap(seconds: float = 0.5) -> float:
    t = Ticker()
    async with anyio.create_task_group() as tg:
        tg.start_soon(t.run)
        await anyio.sleep(seconds)
        t.running = False
    return t.worst


async def run_clients(engine: Any, reqs: list[Req], clients: int, *, ignore_eos: bool = True,
                      cancel: dict[int, int] | None = None) -> dict[str, Any]:
    """``clients`` tasks take requests in order; per-token times at the client."""
    ttft: list[float] = []
    itl: list[float] = []
    results: dict[int, list[int]] = {}
    tokens = 0
    nxt = 0
    ticker = Ticker()

    async def client() -> None:
        nonlocal nxt, tokens
        while nxt < len(reqs):
            i = nxt
            nxt += 1
            ids, n = reqs[i]
            t0 = time.perf_counter()
            s = await engine.submit(ids, n, ignore_eos=ignore_eos)
            got: list[int] = []
            last = None
            stop_at = (cancel or {}).get(i)
            async with s:
                async for tok in s:
                    now = time.perf_counter()
                    if last is None:
                        ttft.append(now - t0)
                    else:
                        itl.append(now - last)
                    last = now
                    got.append(tok)
                    if stop_at is not None and len(got) >= stop_at:
                        break
            tokens += len(got)
            if stop_at is None:
                results[i] = got

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker.run)
        async with anyio.create_task_group() as cg:
            for _ in range(min(clients, len(reqs))):
                cg.start_soon(client)
        ticker.running = False
    wall = time.perf_counter() - t0
    return {"clients": clients, "requests": len(reqs), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "ttft_p50_ms": pct(ttft, 50) * 1e3,
            "ttft_p99_ms": pct(ttft, 99) * 1e3, "itl_p50_ms": pct(itl, 50) * 1e3,
            "itl_p99_ms": pct(itl, 99) * 1e3, "loop_worst_gap_ms": ticker.worst * 1e3,
            "_results": results}


def show(name: str, r: dict[str, Any]) -> None:
    print(f"{name:>22}: {r['clients']:4d} clients {r['requests']:5d} req {r['tokens']:7d} tok "
          f"{r['tokens_per_s']:9.0f} tok/s  TTFT p50 {r['ttft_p50_ms']:8.1f} p99 "
          f"{r['ttft_p99_ms']:8.1f} ms  ITL p50 {r['itl_p50_ms']:6.2f} p99 {r['itl_p99_ms']:6.2f} ms"
          f"  loop gap {r.get('loop_worst_gap_ms', float('nan')):6.2f} ms", flush=True)


async def warm_up(engine: Any, lm: Any, max_clients: int, long: bool = True) -> None:
    """Run every decode bucket once (captures its graph) and compile the prefill paths."""
    from deviceops.nn.model import buckets

    for b in buckets(min(max_clients, engine.max_batch)):
        await engine.generate([[100 + i, 200, 300] for i in range(b)], 3)
    if long:
        await engine.generate([list(range(100, 100 + min(512, engine.max_seq - 4)))], 2)


def sanitize(r: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in r.items() if not k.startswith("_")}
