"""The deviceops demo (the README's first command runs it).

A short tour that checks every result it prints: lazy ops and ``sync``, a
kernel writing a Partition, ``zip`` over streams, ``await`` under asyncio,
a CUDA-graph replay with ``update``, and the GEMM and flash-attention kernels
against float64 NumPy. Uses CUDA device 0 when CuPy sees a GPU, the cpu
backend otherwise (``--device`` forces one).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

import deviceops
from deviceops import api, kernels


def step(title: str) -> None:
    print(f"\n== {title}")


def tour_basics(dev: deviceops.Device) -> None:
    step("lazy ops, streams, a kernel writing a Partition")
    stream = dev.new_stream()
    z = api.zeros((16, 16)).sync_on(stream)
    x = api.ones((16, 16)).sync_on(stream)
    kernels.saxpy(z.partition((4, 4)), 2.0, x).sync_on(stream)  # z is now all 2.0
    zh = api.to_host(z).sync_on(stream)
    assert (zh == 2.0).all()
    print(f"saxpy over a 4x4 grid of 4x4 tiles on {stream}: z = {zh[0, :4]} ...")

    step("zip: independent branches on separate streams, joined with events")
    a, b = deviceops.zip(api.full((1024,), 3.0), api.arange(1024, dtype=deviceops.float32)).sync()
    c = kernels.add(a, kernels.mul(b, b)).sync()
    ch = api.to_host(c).sync()
    np.testing.assert_allclose(ch, 3.0 + np.arange(1024.0) ** 2)
    print(f"a + b*b = {ch[:4]} ... (streams {a._storage.write[0].id}, {b._storage.write[0].id})")  # type: ignore[index]


def tour_async() -> None:
    step("await from asyncio: the loop keeps running")

    async def main() -> float:
        xs = await asyncio.gather(*(api.full((256,), float(i)) for i in range(32)))
        ys = await asyncio.gather(*(kernels.add(x, x) for x in xs))
        hs = await asyncio.gather(*(api.to_host(y) for y in ys))
        return float(sum(h.sum() for h in hs))

    total = asyncio.run(main())
    assert total == 2 * 256 * sum(range(32)), total
    print(f"32 concurrent pipelines awaited; checksum {total:.0f}")


def tour_graph(dev: deviceops.Device) -> None:
    step("CUDA graph: capture once, update the input, replay")
    s = dev.new_stream()
    inp = api.zeros((4096,)).sync_on(s)
    w = api.full((4096,), 0.5).sync_on(s)
    out = api.empty((4096,)).sync_on(s)
    g = kernels.mul(inp, w, out=out).then(lambda t: kernels.add(t, inp, out=t)).graph_on(s)
    for k in range(5):
        new = api.full((4096,), float(k)).sync_on(s)
        g.update(api.memcpy(inp, new))
        g.launch()
        got = api.to_host(out).sync_on(s)
        assert (got == 1.5 * k).all(), (k, got[:4])
    print(f"5 replays with updated inputs match eager math: {g!r}")


def tour_kernels(dev: deviceops.Device) -> None:
    step("kernels: GEMM and flash attention against float64 NumPy")
    rng = np.random.default_rng(0)
    m, n, k = (1024, 1024, 1024) if not dev.is_cpu else (96, 80, 72)
    ah = rng.standard_normal((m, k)).astype(np.float32)
    bh = rng.standard_normal((k, n)).astype(np.float32)
    a = api.convert(api.from_host(ah), deviceops.bfloat16).sync()
    b = api.convert(api.from_host(bh), deviceops.bfloat16).sync()
    c = kernels.gemm(a, b).sync()
    t0 = time.perf_counter()
    reps = 20 if not dev.is_cpu else 2
    for _ in range(reps):
        kernels.gemm(a, b, out=c).sync()
    dt = (time.perf_counter() - t0) / reps
    ref = api.to_host(api.convert(a, deviceops.float32)).sync().astype(np.float64) @ \
        api.to_host(api.convert(b, deviceops.float32)).sync().astype(np.float64)
    got = api.to_host(api.convert(c, deviceops.float32)).sync()
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    assert err < 2e-2, err
    print(f"bf16 gemm {m}x{n}x{k}: max rel err {err:.1e}, {2 * m * n * k / dt / 1e12:.2f} TFLOP/s (incl. sync)")

    b_, h, L, d = 2, 4, (512 if not dev.is_cpu else 40), 64
    q, kk, v = (api.convert(api.from_host(rng.standard_normal((b_, h, L, d)).astype(np.float32)),
                            deviceops.float16).sync() for _ in range(3))
    o = kernels.flash_attention(q, kk, v, causal=True).sync()
    qh, kh, vh = (api.to_host(api.convert(t, deviceops.float32)).sync().astype(np.float64) for t in (q, kk, v))
    s = qh @ kh.transpose(0, 1, 3, 2) / np.sqrt(d)
    s = np.where(np.tril(np.ones((L, L), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref_o = (p / p.sum(-1, keepdims=True)) @ vh
    got_o = api.to_host(api.convert(o, deviceops.float32)).sync()
    err = float(np.abs(got_o - ref_o).max())
    assert err < 2e-2, err
    print(f"fp16 causal flash attention (B={b_}, H={h}, L={L}, D={d}): max abs err {err:.1e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    args = p.parse_args()
    if args.device is not None:
        deviceops.set_default_device(args.device if args.device == "cpu" else 0)
    dev = deviceops.default_device()
    print(f"deviceops {deviceops.__version__} on {dev}")
    tour_basics(dev)
    tour_async()
    tour_graph(dev)
    tour_kernels(dev)
    print("\nall checks passed")


if __name__ == "__main__":
    main()
