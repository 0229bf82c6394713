"""The serving section of ``benchmarks/multi_gpu.py`` (``--serve GGUF``): HTTP serving
through ``python -m deviceops.nn.serve`` with ``benchmarks/serve.py``'s client, ``--devices
d0,d1`` beside one device, every token checked to arrive (:func:`serve_section`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from _multi_gpu_checks import Checks

import deviceops


# -- data-parallel serving ------------------------------------------------------------------
def serve_section(path: str, devs: Sequence[deviceops.Device], clients: int, requests: int,
                  new_tokens: int, max_batch: int, checks: Checks, client_procs: int
                  ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """HTTP serving through ``python -m deviceops.nn.serve`` (``benchmarks/serve.py``'s
    client): one device at ``clients // 2`` and ``clients`` clients, one device with twice
    the batch rows, and ``--devices d0,d1`` (one engine of ``max_batch`` rows each) at
    ``clients`` clients; the same random-token prompts (128-512 tokens), exactly
    ``new_tokens`` new tokens each (EOS ignored), greedy."""
    import random

    import gguf
    from _serve_clients import workload
    from _serve_http import bench_http

    vocab = len(gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].data)
    if devs[0].is_cpu:  # the server subprocess: the cpu backend too
        os.environ["DEVICEOPS_DEVICE"] = "cpu"
    plen = (16, 48) if devs[0].is_cpu else (128, 512)
    reqs = workload(random.Random(29), requests, vocab, plen, (new_tokens, new_tokens))
    both = f"{devs[0]},{devs[1]}"
    one = str(devs[0])
    runs = [(f"1 device ({one}), {clients // 2} clients", one, clients // 2, max_batch),
            (f"1 device ({one}), {clients} clients", one, clients, max_batch),
            (f"1 device ({one}), {clients} clients, {2 * max_batch} rows", one, clients, 2 * max_batch),
            (f"2 devices ({both}), {clients} clients", both, clients, max_batch)]
    rows: list[dict[str, Any]] = []
    for i, (label, where, c, mb) in enumerate(runs):
        r = bench_http(path, reqs, c, mb, 1024, port=18400 + i, devices=where if "," in where else None,
                       client_procs=min(client_procs, c), warm_prompts=True)
        want = len(reqs) * new_tokens
        ok = checks.add(f"serve {label}: every token arrived", r.get("tokens") == want,
                        tokens=r.get("tokens"), expected=want, error=r.get("error"))
        rows.append({"variant": label, "clients": c, "rows_per_engine": mb, "ok": ok,
                     **{k: r.get(k, float("nan")) for k in ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms",
                                                             "itl_p50_ms", "itl_p99_ms", "wall_s")}})
        print(f"# {label}: {r.get('tokens_per_s', float('nan')):.0f} tokens/s, p99 inter-token "
              f"{r.get('itl_p99_ms', float('nan')):.1f} ms" + (f"; error {r['error']}" if "error" in r else ""),
              flush=True)
    best_one = max(rows[1]["tokens_per_s"], rows[2]["tokens_per_s"])
    summary = {"variant": "serve", "tokens_per_s_two": rows[3]["tokens_per_s"],
               "tokens_per_s_one_best": best_one, "ratio": rows[3]["tokens_per_s"] / best_one,
               "itl_p99_two_ms": rows[3]["itl_p99_ms"], "itl_p99_one_half_clients_ms": rows[0]["itl_p99_ms"]}
    return rows, summary
