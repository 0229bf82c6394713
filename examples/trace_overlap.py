"""See a zip overlap: a Chrome/Perfetto trace, the DAG in dot, and a PNG timeline.

Four independent branches, each a kernel that takes a fixed time T on the
device (``slow_copy``: a timed spin, then a copy), are combined with
``deviceops.zip`` and run under ``StreamPoolRoundRobin`` (branches on separate
streams, joined with events) and then under ``SingleStream`` (in order). The
example checks the results, asserts that the first run overlapped (elapsed
well under 4T) and the second did not, and writes into ``--out`` (default: a new temporary
folder, whose path it prints):

* ``trace.json``: open in https://ui.perfetto.dev or chrome://tracing;
* ``zip.dot``: the DAG with each op's stream (``dot -Tpng zip.dot``);
* ``timeline.png``: one row per stream, if matplotlib is installed
  (``pip install 'deviceops[trace]'``); skipped with a note otherwise.

Run: ``python examples/trace_overlap.py [--out DIR] [--device cpu|cuda]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

import deviceops
from deviceops import api
from deviceops.kernels.testing import slow_copy
from deviceops.scheduling import SingleStream, StreamPoolRoundRobin


def run_zip(dev: deviceops.Device, policy: deviceops.SchedulingPolicy, branches: int,
            t: float) -> tuple[float, deviceops.Trace, deviceops.DeviceOp[tuple[deviceops.Tensor, ...]]]:
    """Run ``branches`` slow copies as one zip under ``policy``; check them; time it."""
    s = dev.new_stream()
    srcs = [api.full((1 << 12,), float(i + 1)).sync_on(s) for i in range(branches)]
    dsts = [api.zeros((1 << 12,)).sync_on(s) for _ in range(branches)]
    z = deviceops.zip(*[slow_copy(d, x, t) for d, x in zip(dsts, srcs, strict=True)])
    with deviceops.using(policy), deviceops.trace() as tr:
        t0 = time.perf_counter()
        outs = z.sync()
        elapsed = time.perf_counter() - t0
    for i, o in enumerate(outs):
        np.testing.assert_array_equal(api.to_host(o).sync(), float(i + 1))
    return elapsed, tr, z


def plot(tr: deviceops.Trace, path: Path, title: str) -> bool:
    """A per-stream timeline of the traced ops; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    recs = [r for r in tr.records if r.start is not None and r.end is not None]
    t0 = min(r.start for r in recs if r.start is not None)
    rows = {sid: k for k, sid in enumerate(dict.fromkeys(r.stream for r in recs))}
    fig, ax = plt.subplots(figsize=(8, 0.6 + 0.5 * len(rows)))
    for r in recs:
        assert r.start is not None and r.end is not None
        ax.barh(rows[r.stream], (r.end - r.start) * 1e3, left=(r.start - t0) * 1e3, height=0.6)
        ax.text((r.start - t0) * 1e3, rows[r.stream], f" {r.name}", va="center", fontsize=7)
    ax.set_yticks(list(rows.values()), [f"stream {sid}" for sid in rows])
    ax.set_xlabel("ms since first op")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None,
                   help="where to write (default: a new temporary folder, printed)")
    p.add_argument("--branches", type=int, default=4)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    args = p.parse_args()
    if args.device is not None:
        deviceops.set_default_device(args.device if args.device == "cpu" else 0)
    dev = deviceops.default_device()
    t = 0.05 if dev.is_cpu else 0.005
    n = args.branches
    if args.out is None:  # never into the working tree unless asked
        args.out = Path(tempfile.mkdtemp(prefix="deviceops-trace-"))
    args.out.mkdir(parents=True, exist_ok=True)

    run_zip(dev, StreamPoolRoundRobin(dev, n), n, t / 10)  # warm-up: compile, start streams
    par, tr, z = run_zip(dev, StreamPoolRoundRobin(dev, n), n, t)
    ser, _, _ = run_zip(dev, SingleStream(dev.new_stream()), n, t)
    print(f"device {dev}: {n} branches of T = {t * 1e3:.1f} ms")
    print(f"  StreamPoolRoundRobin: {par * 1e3:7.1f} ms = {par / t:4.2f} T")
    print(f"  SingleStream:         {ser * 1e3:7.1f} ms = {ser / t:4.2f} T")
    assert par < 0.6 * n * t, "branches did not overlap under StreamPoolRoundRobin"
    assert ser > 0.95 * n * t, "branches overlapped under SingleStream"
    assert len({r.stream for r in tr.records if r.name == "slow_copy"}) == n

    trace_path = tr.save(args.out / "trace.json")
    dot_path = args.out / "zip.dot"
    dot_path.write_text(z.to_dot())
    print(f"wrote {trace_path} and {dot_path}")
    png = args.out / "timeline.png"
    if plot(tr, png, f"zip of {n} branches on {dev}: {par / t:.2f} T"):
        print(f"wrote {png}")
    else:
        print("matplotlib not installed: no PNG (pip install 'deviceops[trace]')")


if __name__ == "__main__":
    main()
