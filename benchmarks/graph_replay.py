"""100 tiny chained kernels: eager DeviceOps vs deviceops graph replay vs raw CuPy capture.

Usage::

    python benchmarks/graph_replay.py [--smoke] [--json PATH] [--kernels 100] [--form partition|flat]

The work is 100 chained ``buf = buf + inc`` (1024 float32; each kernel reads
what the previous one wrote), written in the README's partition form
(``out=buf.partition((256,))``: one block per tile; ``--form flat``: ``out=buf``).
In the same run, interleaved:

| variant                   | one sample (host wall, ending with a sync)                      |
|---------------------------|-----------------------------------------------------------------|
| eager async_on chain      | ``kernels.add(buf, inc, out=part).async_on(s)`` x100, E passes   |
| graph replay              | ``g = chain.graph_on(s)`` once; ``g.launch()`` x K               |
| raw eager loop (ref)      | raw CuPy RawKernel add x100 on one stream, E passes             |
| raw capture replay (ref)  | ``stream.begin_capture()``, 100 launches, ``end_capture()``;     |
|                           | ``graph.launch(stream)`` x K                                    |

Per-kernel time = sample wall / (passes x kernels), median over samples; on
cuda also the device time per replay from CUDA events around the K launches.
Buffers are reset before and checked exactly after every sample
(integer-valued data: ``buf0 + passes * kernels * inc``). The chain is built
with ``then``; ``CudaGraph.update(api.memcpy(...))`` resets the captured buffer.

Bars: graph replay <= 1.0 us per kernel (host-timed, issue 12); replay >= 5x faster than eager.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np
from _common import (
    Bar,
    EventTimer,
    add_common_args,
    check,
    check_equal,
    download,
    int_data,
    interleave,
    launch_geometry,
    main_guard,
    median,
    pct,
    print_bars,
    raw_kernels,
    setup,
    table,
    upload,
    write_json,
)

import deviceops
from deviceops import api, kernels

SIZE = 1024


TILE = (256,)


def _out(buf: deviceops.Tensor, form: str) -> Any:
    """The output argument as written in ``form``: the tensor, or its partition."""
    return buf.partition(TILE) if form == "partition" else buf


def build_chain(buf: deviceops.Tensor, inc: deviceops.Tensor, k: int, form: str = "partition"
                ) -> deviceops.DeviceOp[Any]:
    """``k`` chained ``buf += inc`` kernels as one op (``then``), the output in ``form``."""
    out = _out(buf, form)

    def step(_: Any) -> deviceops.DeviceOp[Any]:
        return kernels.add(buf, inc, out=out)

    op: deviceops.DeviceOp[Any] = kernels.add(buf, inc, out=out)
    for _ in range(k - 1):
        op = op.then(step)
    return op


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--kernels", type=int, default=100, help="kernels per chain / graph")
    p.add_argument("--samples", type=int, default=None, help="samples per variant (30; smoke 3)")
    p.add_argument("--form", choices=("partition", "flat"), default="partition",
                   help="the output argument: buf.partition((256,)) (default) or buf")
    args = p.parse_args()
    b = setup(args)
    nk = args.kernels
    samples = args.samples or (3 if args.smoke else 30)
    eager_passes = 1 if args.smoke else 5
    replays = 5 if args.smoke else 100

    rng = np.random.default_rng()
    s = b.device.new_stream()
    buf0 = int_data(rng, SIZE, -1000, 1000)
    inc_h = int_data(rng, SIZE, -3, 3)
    buf0_t = upload(buf0, s)
    inc = upload(inc_h, s)
    buf_e = upload(buf0, s)
    buf_g = upload(buf0, s)

    # Warm up the kernel (module load) eagerly, then capture the chain once.
    kernels.add(buf_e, inc, out=buf_e).sync_on(s)
    api.memcpy(buf_e, buf0_t).sync_on(s)
    graph = build_chain(buf_g, inc, nk, args.form).graph_on(s)
    got = graph.take_output()
    check((got.tensor if args.form == "partition" else got) is buf_g,
          "graph output is the captured buffer")
    out_e = _out(buf_e, args.form)
    dev_times: dict[str, list[float]] = {"ours_eager": [], "ours_graph": [], "raw_eager": [], "raw_graph": []}
    passes = {"ours_eager": eager_passes, "ours_graph": replays, "raw_eager": eager_passes, "raw_graph": replays}

    def timer(native: Any) -> EventTimer | None:
        return EventTimer(b.cupy, native) if b.cupy is not None else None

    ours_native = getattr(s, "native", None)

    def ours_eager() -> None:
        t = timer(ours_native)
        if t:
            t.begin()
        for _ in range(eager_passes):
            for _ in range(nk):
                kernels.add(buf_e, inc, out=out_e).async_on(s)
        if t:
            t.end()
        s.synchronize()
        if t:
            dev_times["ours_eager"].append(t.seconds())

    def ours_graph() -> None:
        t = timer(ours_native)
        if t:
            t.begin()
        for _ in range(replays):
            graph.launch()
        if t:
            t.end()
        graph.synchronize()
        if t:
            dev_times["ours_graph"].append(t.seconds())

    variants: dict[str, Callable[[], Any]] = {"ours_eager": ours_eager, "ours_graph": ours_graph}
    def reset_graph_input() -> None:
        graph.update(api.memcpy(buf_g, buf0_t))  # ordered before the next launch
        graph.synchronize()

    resets: dict[str, Callable[[], Any]] = {
        "ours_eager": lambda: api.memcpy(buf_e, buf0_t).sync_on(s),
        "ours_graph": reset_graph_input,
    }
    results: dict[str, Callable[[], np.ndarray]] = {
        "ours_eager": lambda: download(buf_e, s),
        "ours_graph": lambda: download(buf_g, s),
    }

    if b.cupy is not None:
        cp = b.cupy
        add = raw_kernels(cp)["raw_add"]
        grid, block = launch_geometry(SIZE)
        cs = cp.cuda.Stream(non_blocking=True)
        n64 = np.int64(SIZE)
        r_inc = cp.asarray(inc_h)
        r_buf0 = cp.asarray(buf0)
        r_e = r_buf0.copy()
        r_g = r_buf0.copy()
        cp.cuda.Device().synchronize()
        add(grid, block, (r_e, r_e, r_inc, n64), stream=cs)  # load the module before capturing
        cs.synchronize()
        mode = getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", 2)
        cs.begin_capture(mode=mode)
        for _ in range(nk):
            add(grid, block, (r_g, r_g, r_inc, n64), stream=cs)
        raw_graph = cs.end_capture()

        def raw_eager() -> None:
            t = EventTimer(cp, cs)
            t.begin()
            for _ in range(eager_passes):
                for _ in range(nk):
                    add(grid, block, (r_e, r_e, r_inc, n64), stream=cs)
            t.end()
            cs.synchronize()
            dev_times["raw_eager"].append(t.seconds())

        def raw_replay() -> None:
            t = EventTimer(cp, cs)
            t.begin()
            for _ in range(replays):
                raw_graph.launch(cs)
            t.end()
            cs.synchronize()
            dev_times["raw_graph"].append(t.seconds())

        def raw_reset(arr: Any) -> None:
            with cs:
                cp.copyto(arr, r_buf0)
            cs.synchronize()

        variants["raw_eager"] = raw_eager
        variants["raw_graph"] = raw_replay
        resets["raw_eager"] = lambda: raw_reset(r_e)
        resets["raw_graph"] = lambda: raw_reset(r_g)
        results["raw_eager"] = lambda: cp.asnumpy(r_e)
        results["raw_graph"] = lambda: cp.asnumpy(r_g)
        ref_names = {"eager": "raw eager loop", "graph": "raw capture replay"}
    else:
        h_e = buf0.copy()
        h_g = buf0.copy()
        kernels_np: list[Callable[[], None]] = [lambda: np.add(h_g, inc_h, out=h_g)] * nk

        def raw_eager_np() -> None:
            for _ in range(eager_passes):
                for _ in range(nk):
                    np.add(h_e, inc_h, out=h_e)

        def raw_replay_np() -> None:  # a recorded list of callables, replayed
            for _ in range(replays):
                for f in kernels_np:
                    f()

        variants["raw_eager"] = raw_eager_np
        variants["raw_graph"] = raw_replay_np
        resets["raw_eager"] = lambda: np.copyto(h_e, buf0)
        resets["raw_graph"] = lambda: np.copyto(h_g, buf0)
        results["raw_eager"] = lambda: h_e.copy()
        results["raw_graph"] = lambda: h_g.copy()
        ref_names = {"eager": "NumPy loop", "graph": "NumPy replay of a list"}

    def after(name: str, _: Any) -> None:
        want = (buf0 + np.float32(passes[name] * nk) * inc_h).astype(np.float32)
        check_equal(results[name](), want, f"{name}: buffer after {passes[name]} x {nk} kernels")

    times = interleave(variants, samples, warmup=2, before=lambda n: resets[n](), after=after)

    def per_kernel_us(name: str, xs: list[float]) -> list[float]:
        return [x / (passes[name] * nk) * 1e6 for x in xs]

    host = {k: per_kernel_us(k, v) for k, v in times.items()}
    dev = {k: per_kernel_us(k, v[-samples:]) if v else None for k, v in dev_times.items()}

    def dmed(k: str) -> float | None:
        v = dev.get(k)
        return median(v) if v else None

    rows: list[dict[str, Any]] = []
    for mode, label in (("eager", "eager async_on chain"), ("graph", "graph replay (graph_on+launch)")):
        o, r = f"ours_{mode}", f"raw_{mode}"
        rows.append({
            "variant": label, "ours_us": median(host[o]), "ours_p90_us": pct(host[o], 90),
            "ours_gpu_us": dmed(o), "reference": ref_names[mode], "ref_us": median(host[r]),
            "ref_gpu_us": dmed(r), "ratio": median(host[o]) / median(host[r]),
            "passes_per_sample": passes[o], "samples": len(host[o]),
        })
    speed_ours = rows[0]["ours_us"] / rows[1]["ours_us"]
    speed_raw = rows[0]["ref_us"] / rows[1]["ref_us"]
    print()
    print(f"Per-kernel time (us) for {nk} chained tiny kernels; host = sample wall / kernels, "
          f"gpu = CUDA-event span / kernels; median of {samples}")
    print(table(rows, [("variant", "deviceops variant", 0), ("ours_us", "ours host", 3),
                       ("ours_p90_us", "p90", 3), ("ours_gpu_us", "ours gpu", 3), ("reference", "reference", 0),
                       ("ref_us", "ref host", 3), ("ref_gpu_us", "ref gpu", 3), ("ratio", "ratio", 2)]))
    print(f"replay speed-up over eager: deviceops {speed_ours:.1f}x, reference {speed_raw:.1f}x")
    gpu_replay = rows[1]["ours_gpu_us"]
    if gpu_replay is not None:
        print(f"device time per replay: deviceops {gpu_replay * nk:.1f} us, "
              f"raw {rows[1]['ref_gpu_us'] * nk:.1f} us")
    bars = [Bar(f"graph replay per kernel ({args.form} form, host-timed)", rows[1]["ours_us"],
                "<=", 1.0, "us"),
            Bar("graph replay speed-up over eager async_on", speed_ours, ">=", 5.0, "x")]
    print_bars(bars, b)
    write_json(args.json, "graph_replay", b,
               {"size": SIZE, "kernels": nk, "samples": samples, "eager_passes": eager_passes,
                "replays_per_sample": replays, "form": args.form},
               rows, bars, {"speedup_ours": speed_ours, "speedup_ref": speed_raw})
    return 0


if __name__ == "__main__":
    main_guard(main)
