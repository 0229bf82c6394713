"""Gemma 3 270M decode: deviceops ``generate`` beside transformers' eager ``generate``.

Prints, in one run on the same weights (the Q4_K_M GGUF of ``nn.gemma3_270m()``, dequantized
to fp16):

* ``generate`` at batch 1: a 32-token prompt and ``--new`` greedy tokens (no EOS stop), wall
  time of the whole call and of a 1-token call (prefill + first token), hence ms per decoded
  token; the decode step alone (CUDA-graph replay and eager, reading the sampled token back
  each step, as ``generate`` does);
* prefill of 512 and 2048 tokens (the local layers' 512-token sliding window matters past
  512);
* transformers (``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``, fp16, eager
  attention) ``generate`` at batch 1 on the same prompt and token count, and the ratio.

Checks (exit status 1 when one fails): the timed decode loops' greedy tokens equal
``CausalLM.generate``'s; the timed ``generate`` made tokens (``--new``, fewer at EOS). The first tokens
of ours and transformers' greedy continuations are printed and recorded (fp16 on both sides:
they agree up to a near-tie, not necessarily all the way).

Bars (issue 44, H200/H100, fp16): ``generate`` batch 1 <= 1.0 ms/token and >= 20x
transformers' eager ``generate``.

Run:  python benchmarks/gemma3.py [--json out.json] [--no-transformers] [--gguf PATH]
      python benchmarks/gemma3.py --smoke     (seconds, cpu backend, a tiny random Gemma 3)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np
from decode import bench_decode, bench_prefill, check_decode_tokens

import deviceops


def time_generate(m: Any, prompt: list[int], new: int, reps: int) -> dict[str, Any]:
    """Median wall time of ``m.generate(prompt, new)`` and of a 1-token call; ms per token
    of the decode part and overall (per token made: a row stops early at EOS)."""
    m.generate(prompt, new)  # warm-up: graphs captured, workspaces sized
    full, first = [], []
    toks: list[int] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        toks = m.generate(prompt, new)
        full.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        m.generate(prompt, 1)
        first.append(time.perf_counter() - t0)
    f, one, n = float(np.median(full)) * 1e3, float(np.median(first)) * 1e3, len(toks)
    per = (f - one) / max(1, n - 1)
    print(f"generate batch 1: {n} tokens in {f:.2f} ms (first token {one:.2f} ms): "
          f"{per:.3f} ms/token decode, {f / max(1, n):.3f} ms/token overall", flush=True)
    return {"batch": 1, "prompt": len(prompt), "new": n, "wall_ms": f, "first_token_ms": one,
            "ms_per_token": per, "ms_per_token_overall": f / max(1, n), "tokens": toks}


def bench_transformers(path: str, prompt: list[int], new: int, reps: int) -> dict[str, Any]:
    import os

    import torch
    from transformers import AutoModelForCausalLM

    d, f = os.path.dirname(path), os.path.basename(path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float16,
                                                 attn_implementation="eager").cuda().eval()
    x = torch.tensor([prompt]).cuda()
    # as many tokens as ours made (ours stops at EOS; transformers is held to the same count)
    kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": 0}
    times = []
    with torch.no_grad():
        model.generate(x, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model.generate(x, **kw)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    ms = float(np.median(times)) * 1e3 / new
    toks = [int(t) for t in out[0, len(prompt):].tolist()]
    print(f"transformers eager generate batch 1: {ms:.3f} ms/token", flush=True)
    return {"batch": 1, "new": new, "ms_per_token": ms, "tokens": toks}


def _agree(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _smoke_model() -> Any:
    from deviceops import nn
    from deviceops.nn.models import Gemma3Config

    cfg = Gemma3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=6,
                       num_heads=2, num_kv_heads=1, head_dim=16, sliding_window=8,
                       max_position_embeddings=128, bos_token_id=2, eos_token_id=1)
    return nn.random_model(cfg, device="cpu", dtype="float32", max_batch=2, max_seq=64,
                           prefill_chunk=32)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 on success."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--smoke", action="store_true", help="cpu backend, a tiny random Gemma 3 (CI)")
    p.add_argument("--json", default=None)
    p.add_argument("--gguf", default=None, help="GGUF file (default: nn.gemma3_270m()'s)")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--new", type=int, default=128, help="tokens each generate call makes")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-transformers", action="store_true")
    args = p.parse_args(argv)

    from deviceops import nn
    from deviceops.nn.checkpoint import gemma3_270m_path

    rng = np.random.default_rng(0)
    res: dict[str, Any]
    if args.smoke:
        m = _smoke_model()
        prompt = [2, *rng.integers(5, 256, 11).tolist()]
        res = {"smoke": True, "generate": time_generate(m, prompt, 12, 1),
               "prefill": bench_prefill(m, [16], 1, rng),
               "decode": [bench_decode(m, 1, 3, g, rng, prompt_len=8) for g in (True, False)]}
        checks = [check_decode_tokens(m, r, 6) for r in res["decode"]]
    else:
        if not deviceops.cuda_available():
            print("gemma3 benchmark: needs a CUDA GPU (use --smoke on the cpu backend)")
            return 1
        path = args.gguf or str(gemma3_270m_path())
        t0 = time.perf_counter()
        m = nn.load_gguf(path, dtype=args.dtype, device=0, max_batch=8, max_seq=2304,
                         prefill_chunk=2048, progress=False)
        print(f"loaded {m} in {time.perf_counter() - t0:.1f} s; weights {m.weight_bytes / 1e6:.1f} MB",
              flush=True)
        prompt = m.encode("The history of the printing press begins in")
        prompt = (prompt + rng.integers(1000, 200000, 32).tolist())[:32]
        res = {"device": str(m.device), "dtype": args.dtype, "weight_bytes": m.weight_bytes,
               "generate": time_generate(m, prompt, args.new, args.reps),
               "prefill": bench_prefill(m, [512, 2048], 10, rng),
               "decode": [bench_decode(m, b, 64, g, rng) for b in (1, 8) for g in (True, False)]}
        checks = [check_decode_tokens(m, r, 16) for r in res["decode"]]
        ours = res["generate"]
        if not args.no_transformers:
            try:
                hf = bench_transformers(path, prompt, ours["new"], max(1, args.reps // 2))
                hf["agree_tokens"] = _agree(ours["tokens"], hf["tokens"])
                res["transformers"] = hf
                res["speedup_vs_transformers"] = hf["ms_per_token"] / ours["ms_per_token_overall"]
                print(f"ours vs transformers: {res['speedup_vs_transformers']:.1f}x per token; "
                      f"greedy tokens agree for the first {hf['agree_tokens']} of {ours['new']}",
                      flush=True)
            except Exception as exc:  # reported, not fatal
                res["transformers"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
                print("transformers: FAILED:", res["transformers"]["error"], flush=True)
        bars = {"generate batch 1 <= 1.0 ms/token": ours["ms_per_token_overall"] <= 1.0}
        if "speedup_vs_transformers" in res:
            bars[">= 20x transformers eager generate"] = res["speedup_vs_transformers"] >= 20.0
        res["bars"] = bars
        for k, v in bars.items():
            print(f"bar {k}: {'MET' if v else 'NOT MET'}")
    gen = res["generate"]
    checks.append({"what": "generate made tokens", "passed": len(gen["tokens"]) >= 1})
    gen["tokens"] = gen["tokens"][:32]
    for r in res["decode"]:  # the JSON keeps the counts, not every token
        r["prompts"], r["tokens"] = len(r.pop("prompts")), len(r.pop("tokens")[0])
    res["checks"] = {"passed": bool(checks) and all(c["passed"] for c in checks),
                     "count": len(checks), "records": checks}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1, default=float)
    if not res["checks"]["passed"]:
        print("CORRECTNESS FAIL: " + "; ".join(c["what"] for c in checks if not c["passed"]),
              file=sys.stderr)
    return 0 if res["checks"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
