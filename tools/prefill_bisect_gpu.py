"""Prefill device time of a random-weight SmolLM2-shaped model, with a per-kernel profile.

Diagnostics for the prefill regression between two code versions: run it once per package
tree (``PYTHONPATH`` pointing at a copy of that version's ``deviceops`` package) and compare.
Device time of a prefill depends on shapes only, so random weights stand in for the GGUF.

Usage (GPU machine): ``python3 tools/prefill_bisect_gpu.py LABEL [--profile]``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict

import cupy
import numpy as np

import deviceops
from deviceops.nn.config import LlamaConfig
from deviceops.nn.model import CausalLM

CFG = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                  num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=1e5)


def weights(cfg: LlamaConfig) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    h, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    w = {"model.embed_tokens.weight": rng.standard_normal((cfg.vocab_size, h), np.float32) * 0.02,
         "model.norm.weight": np.ones(h, np.float32)}
    shapes = (("self_attn.q_proj", (q, h)), ("self_attn.k_proj", (kv, h)),
              ("self_attn.v_proj", (kv, h)), ("self_attn.o_proj", (h, q)),
              ("mlp.gate_proj", (f, h)), ("mlp.up_proj", (f, h)), ("mlp.down_proj", (h, f)))
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for n, s in shapes:
            w[p + n + ".weight"] = rng.standard_normal(s, np.float32) * 0.02
        w[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
    return w


def time_prefill(m: CausalLM, n: int, reps: int, graph: bool) -> float:
    s = m.device_stream
    ids = np.random.default_rng(n).integers(100, CFG.vocab_size, n).tolist()
    m.set_sampling(0)
    m.read(m.prefill(0, ids, graph=graph)).sync_on(s)
    devs = []
    for _ in range(reps):
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record(s.native)
        view = m.prefill(0, ids, graph=graph)
        e1.record(s.native)
        m.read(view).sync_on(s)
        devs.append(cupy.cuda.get_elapsed_time(e0, e1))
    return float(np.median(devs))


def profile(m: CausalLM, n: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    s = m.device_stream
    ids = np.random.default_rng(n).integers(100, CFG.vocab_size, n).tolist()
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            m.read(m.prefill(0, ids, graph=False)).sync_on(s)
        torch.cuda.synchronize()
    tot: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            tot[ev.name][0] += ev.device_time_total / 3
            tot[ev.name][1] += 1
    print(f"  kernels of one eager prefill of {n} tokens (us, count):")
    for name, (us, c) in sorted(tot.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"    {us:9.1f} {c // 3:5d}  {name[:90]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("label")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    print(f"== {a.label}: deviceops from {deviceops.__file__}", flush=True)
    t0 = time.perf_counter()
    m = CausalLM(CFG, weights(CFG), tokenizer=None, dtype="float16", device=0, max_batch=32,
                 max_seq=2304, prefill_chunk=int(os.environ.get("PREFILL_CHUNK", "2048")))
    print(f"  model built in {time.perf_counter() - t0:.1f} s", flush=True)
    for n in (128, 512, 2048):
        g = time_prefill(m, n, 10, True)
        e = time_prefill(m, n, 5, False)
        print(f"  prefill {n:5d}: graph {g:7.3f} ms device, eager {e:7.3f} ms device", flush=True)
    if a.profile:
        for n in (512, 2048):
            profile(m, n)


if __name__ == "__main__":
    main()
