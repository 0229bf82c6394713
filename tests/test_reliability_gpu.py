"""Issue 16 on the GPU: fault injection in a child process, and the reliability items on cuda.

A kernel that executes ``trap`` poisons the CUDA context (every later call fails), so each
fault-injection scenario runs in its own child process. The child launches the trapping
kernel through a deviceops KernelOp, and must: raise a ``DeviceError`` at the op that
launched it (``sync()``, ``await`` under asyncio and trio, a ``zip`` branch, every consumer of
a ``shared()`` op), print it, and exit cleanly (status 0) within a timeout (no hang).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent('''
    import sys, asyncio
    import deviceops
    from deviceops import api, DeviceError
    from deviceops._launch import launch
    from deviceops.kernels import KernelOp
    import cupy

    SRC = r"""extern "C" __global__ void trap_k(float* x) {
        if (threadIdx.x == 0) x[0] = 1.0f;
        __syncthreads();
        asm volatile("trap;");
    }"""
    kern = cupy.RawKernel(SRC, "trap_k")

    def trap_op(out):
        def run(ctx, o):
            def cuda(native):
                kern((1,), (32,), (o.array,), stream=native)
            launch(ctx, "trap_inject", (), (o,), lambda: None, cuda)
            return o
        return KernelOp("trap_inject", run, (out,))

    mode = sys.argv[1]
    x = api.zeros((4,)).sync()
    kern.compile() if hasattr(kern, "compile") else None
    try:
        if mode == "sync":
            trap_op(x).sync()
        elif mode == "zip":
            deviceops.zip(api.ones((3,)), trap_op(x).map(lambda t: 0)).sync()
        elif mode == "asyncio":
            async def main():
                await trap_op(x)
            asyncio.run(main())
        elif mode == "trio":
            import trio
            async def main():
                await trap_op(x)
            trio.run(main)
        elif mode == "shared":
            s = trap_op(x).shared()
            errs = []
            for _ in range(3):
                try:
                    s.sync()
                except DeviceError as exc:
                    errs.append(exc)
            print(f"SHARED_ERRORS {len(errs)}")
            raise errs[0]
        print("NOT REPORTED")
        sys.exit(1)
    except DeviceError as exc:
        notes = " | ".join(getattr(exc, "__notes__", []))
        print(f"REPORTED {type(exc).__name__}: {exc} || {notes}", flush=True)
    sys.exit(0)
''')


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "zip", "asyncio", "trio", "shared"])
def test_trapping_kernel_is_reported_and_process_exits_cleanly(mode: str, tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(script), mode], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    log = f"rc={proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, log
    assert "REPORTED DriverError" in proc.stdout, log
    # the error names the op whose sync/await raised: the trapping op, or the zip holding it
    assert ("zip[2]" if mode == "zip" else "trap_inject") in proc.stdout, log
    if mode == "shared":
        assert "SHARED_ERRORS 3" in proc.stdout, log


@pytest.mark.gpu
def test_embedding_clamp_matches_cpu_on_gpu() -> None:
    import numpy as np

    import deviceops
    from deviceops import api, kernels

    table_h = np.arange(20, dtype=np.float32).reshape(5, 4)
    ids_h = np.array([-3, 0, 4, 5, 99], np.int64)
    got = []
    for dev in (deviceops.device(0), deviceops.device("cpu")):
        s = dev.new_stream()
        out = kernels.embedding(api.from_host(ids_h), api.from_host(table_h)).sync_on(s)
        got.append(api.to_host(out).sync_on(s))
    np.testing.assert_array_equal(got[0], got[1])
    np.testing.assert_array_equal(got[0], table_h[np.clip(ids_h, 0, 4)])


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_host_task_nested_sync_on_cuda() -> None:
    import deviceops
    from deviceops import NestedExecutionError, api
    from deviceops.graphs import host_task

    s = deviceops.device(0).new_stream()
    seen: list[BaseException] = []

    def fn() -> None:
        try:
            api.ones((2,)).sync_on(s)
        except BaseException as exc:
            seen.append(exc)

    host_task(fn).sync_on(s)
    assert len(seen) == 1 and isinstance(seen[0], NestedExecutionError)
