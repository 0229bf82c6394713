"""Several independent GPU pipelines, driven concurrently from one asyncio program.

Each pipeline is a small "request handler": it uploads a batch, runs a few
kernels on it, downloads a summary and checks it against NumPy, several rounds
in a row. All pipelines share one event loop; each ``await`` suspends only its
own task, so their GPU work interleaves on the default policy's streams while
a heartbeat task keeps ticking (its worst gap is printed).

Run: ``python examples/async_pipeline.py [--pipelines 8] [--rounds 20]``
(uses the GPU when there is one, the cpu backend otherwise; ``--device cpu``
forces it). Exits non-zero if any result is wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

import deviceops
from deviceops import api, kernels


async def pipeline(pid: int, rounds: int, n: int) -> int:
    """One pipeline: ``rounds`` batches of ``n`` floats; returns the rounds checked."""
    rng = np.random.default_rng(abs(pid))
    checked = 0
    for r in range(rounds):
        xh = rng.standard_normal(n).astype(np.float32)
        yh = rng.standard_normal(n).astype(np.float32)
        a = float(abs(pid) + r % 3)
        # Upload both, then z = (a*x + y) * x, as one lazy DAG; awaited once.
        up = deviceops.zip(api.from_host(xh), api.from_host(yh))
        z = await up.then(lambda xy, a=a: kernels.saxpy(xy[1], a, xy[0]).map(lambda y: (xy[0], y))).then(
            lambda xy: kernels.mul(xy[1], xy[0])
        )
        host = await api.to_host(z)
        ref = (a * xh.astype(np.float64) + yh) * xh
        np.testing.assert_allclose(host, ref, rtol=1e-5, atol=1e-5)
        checked += 1
    return checked


async def heartbeat(stop: asyncio.Event, gaps: list[float]) -> None:
    """Tick every millisecond; record how late each tick was."""
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


async def main(pipelines: int, rounds: int, n: int) -> None:
    await pipeline(-1, 1, 16)  # warm-up: first use compiles the kernels (not part of the timing)
    stop = asyncio.Event()
    gaps: list[float] = []
    beat = asyncio.create_task(heartbeat(stop, gaps))
    t0 = time.perf_counter()
    done = await asyncio.gather(*(pipeline(p, rounds, n) for p in range(pipelines)))
    elapsed = time.perf_counter() - t0
    stop.set()
    await beat
    assert done == [rounds] * pipelines, done
    print(f"device: {deviceops.default_device()}")
    print(f"{pipelines} pipelines x {rounds} rounds of {n} floats: all results match NumPy")
    print(f"elapsed {elapsed * 1e3:.1f} ms; heartbeat worst gap {max(gaps) * 1e3:.2f} ms over {len(gaps)} ticks")


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pipelines", type=int, default=8)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--n", type=int, default=1 << 16, help="floats per batch")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    return p.parse_args()


if __name__ == "__main__":
    args = _args()
    if args.device is not None:
        deviceops.set_default_device(args.device if args.device == "cpu" else 0)
    asyncio.run(main(args.pipelines, args.rounds, args.n))
