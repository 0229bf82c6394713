"""Issue 35's GPU bars for first use (run on a GPU machine; each part in a fresh process).

Usage (repo root, the venv with CuPy active)::

    python tools/first_use_gpu.py [--parts ticker,server,generate,precompile] [--json out.json]

* ``ticker``: with an EMPTY kernel cache (a new ``CUPY_CACHE_DIR``), an asyncio program
  runs a 1 ms ticker while it awaits a chain of fp32 GEMMs (first use: NVRTC compiles) and
  then a second, warm chain. Bar: the ticker's worst gap <= 250 ms. Also reports how many
  awaits went to a worker thread (``deviceops._offload.stats()``).
* ``server``: with an empty cache, ``python -m deviceops.nn.serve --model smollm2`` starts;
  once ``/health`` is 200 a client polls ``/health`` every 10 ms while the first chat request
  runs. Bar: no ``/health`` answer slower than 50 ms. The load itself (graphs captured in
  the loader thread) is measured the same way while ``/health`` is 503.
* ``generate``: with an empty cache, ``python -m deviceops.nn.generate`` streams a short
  answer (SmolLM2 when ``DEVICEOPS_SMOLLM2_GGUF`` or the package is there, else a tiny random
  GGUF written for the run) with its stderr to a file; then again on the now warm cache. Bar:
  the first run shows the named "compiling kernels" bar, the warm run shows none.
* ``precompile``: ``python -m deviceops.precompile`` into an empty cache (its time and
  failures), then the ``ticker`` part again on that cache (the first chain should no longer
  compile at all: ``offloaded`` awaits still happen once per op, but fast).

Prints one line per measurement with PASS/FAIL against the bar.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TICKER = r'''
import asyncio, json, sys, time
import deviceops
from deviceops import api, kernels, _offload

async def main():
    gaps = []
    stop = False
    async def ticker():
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0.001)
            now = time.perf_counter(); gaps.append(now - last); last = now
    t = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    out = {}
    for label in ("first", "warm"):
        x = api.randn((512, 512), "float32").sync()  # (blocking: before the measured window)
        await asyncio.sleep(0.01)
        gaps.clear()
        t0 = time.perf_counter()
        for _ in range(8):
            x = await kernels.gemm(x, x, alpha=1.0 / 512)
        await api.to_host(x)
        out[label] = {"chain_s": time.perf_counter() - t0, "worst_gap_ms": max(gaps) * 1e3}
    stop = True
    await t
    out["offload"] = _offload.stats()
    print(json.dumps(out))

asyncio.run(main())
'''


def _fresh_cache(env: dict[str, str], cache: str | None = None) -> dict[str, str]:
    return {**env, "CUPY_CACHE_DIR": cache or tempfile.mkdtemp(prefix="cupy-cache-")}


def part_ticker(env: dict[str, str]) -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-c", TICKER], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for label in ("first", "warm"):
        gap = res[label]["worst_gap_ms"]
        print(f"ticker {label:5s} chain {res[label]['chain_s']:.2f} s, worst 1 ms-ticker gap "
              f"{gap:.1f} ms (bar 250): {'PASS' if gap <= 250 else 'FAIL'}", flush=True)
    print(f"  offload stats: {res['offload']}", flush=True)
    return dict(res)


def part_server(env: dict[str, str]) -> dict[str, object]:
    import tempfile

    import httpx

    port = 18000 + os.getpid() % 1000
    # the server's output goes to a file, read at the end: a pipe read only at the end fills
    # up under a chatty server and blocks it
    log_file = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed in the finally below)
        "w+", prefix="first_use_server_", suffix=".log", delete=False)
    srv = subprocess.Popen([sys.executable, "-m", "deviceops.nn.serve", "--model", "smollm2",
                            "--port", str(port)], cwd=ROOT, env=env, stdout=log_file,
                           stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    res: dict[str, object] = {}
    try:
        with httpx.Client(base_url=url, timeout=30) as c:
            worst_loading = 0.0
            t_start = time.perf_counter()
            while True:
                t0 = time.perf_counter()
                try:
                    r = c.get("/health")
                except httpx.HTTPError:
                    time.sleep(0.05)
                    continue
                dt = time.perf_counter() - t0
                if r.status_code == 200:
                    break
                worst_loading = max(worst_loading, dt)
                if time.perf_counter() - t_start > 900:
                    raise RuntimeError("the server did not become ready in 900 s")
                time.sleep(0.01)
            res["load_s"] = time.perf_counter() - t_start
            res["health_while_loading_ms"] = worst_loading * 1e3
        import threading

        worst = [0.0]
        done = threading.Event()

        def poll() -> None:
            with httpx.Client(base_url=url, timeout=30) as c:
                while not done.is_set():
                    t0 = time.perf_counter()
                    c.get("/health")
                    worst[0] = max(worst[0], time.perf_counter() - t0)
                    time.sleep(0.01)

        th = threading.Thread(target=poll)
        th.start()
        with httpx.Client(base_url=url, timeout=600) as c:
            t0 = time.perf_counter()
            r = c.post("/v1/chat/completions", json={
                "model": "smollm2", "temperature": 0, "max_tokens": 32,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]})
            res["first_request_s"] = time.perf_counter() - t0
            res["answer"] = r.json()["choices"][0]["message"]["content"]
        done.set()
        th.join()
        res["health_during_first_request_ms"] = worst[0] * 1e3
    finally:
        srv.terminate()
        srv.wait(timeout=60)
        log_file.seek(0)
        out = log_file.read()
        log_file.close()
        os.unlink(log_file.name)
    ok = float(res["health_during_first_request_ms"]) <= 50  # type: ignore[arg-type]
    print(f"server: ready after {res['load_s']:.1f} s (worst /health while loading "
          f"{res['health_while_loading_ms']:.1f} ms); first request {res['first_request_s']:.2f} s, "
          f"worst /health meanwhile {res['health_during_first_request_ms']:.1f} ms (bar 50): "
          f"{'PASS' if ok else 'FAIL'}; answer {res['answer']!r}", flush=True)
    res["log_tail"] = out[-1500:]
    return res


TINY_GGUF = r'''
import sys
from pathlib import Path
sys.path.insert(0, "tests")
import nn_tiny
nn_tiny.write_gguf(Path(sys.argv[1]), nn_tiny.hf_weights())
'''


def part_generate(env: dict[str, str]) -> dict[str, object]:
    model = env.get("DEVICEOPS_SMOLLM2_GGUF") or ""
    if not model:
        try:
            from deviceops.nn.checkpoint import smollm2_path

            model = str(smollm2_path())
        except Exception:
            model = os.path.join(tempfile.mkdtemp(prefix="first_use_"), "tiny.gguf")
            subprocess.run([sys.executable, "-c", TINY_GGUF, model], cwd=ROOT, env=env, check=True,
                           timeout=300)
    res: dict[str, object] = {"model": model}
    for label in ("empty cache", "warm cache"):
        with tempfile.NamedTemporaryFile("w+", prefix="first_use_generate_", suffix=".err") as err:
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "deviceops.nn.generate", "--model", model,
                                   "--raw", "The capital of France is", "--max-new-tokens", "8"],
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                                  timeout=900)
            dt = time.perf_counter() - t0
            err.seek(0)
            text = err.read()
        bar = "compiling kernels (first use on this GPU)" in text
        want = label == "empty cache"
        print(f"generate, {label}: exit {proc.returncode} in {dt:.1f} s; compile bar "
              f"{'shown' if bar else 'not shown'} (want {'shown' if want else 'none'}): "
              f"{'PASS' if bar == want and proc.returncode == 0 else 'FAIL'}; "
              f"stdout {proc.stdout.strip()[-80:]!r}", flush=True)
        res[label] = {"rc": proc.returncode, "s": dt, "bar": bar, "stderr_tail": text[-600:]}
    return res


def part_precompile(env: dict[str, str]) -> dict[str, object]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "deviceops.precompile"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=3600)
    dt = time.perf_counter() - t0
    print(f"precompile: {dt:.1f} s, exit {proc.returncode}; {proc.stdout.strip().splitlines()[-1]}",
          flush=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-2000:], flush=True)
    return {"precompile_s": dt, "rc": proc.returncode, "after": part_ticker(env)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="ticker,server,generate,precompile")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    out: dict[str, object] = {}
    base = {k: v for k, v in os.environ.items() if k != "DEVICEOPS_DEVICE"}
    for part in args.parts.split(","):
        env = _fresh_cache(base)  # every part starts from an empty kernel cache
        out[part] = {"ticker": part_ticker, "server": part_server, "generate": part_generate,
                     "precompile": part_precompile}[part](env)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
