"""``generate`` through the public API against the same decode steps read back one at a time
(the host waiting for each step before enqueueing the next), on a SmolLM2-135M-shaped model
with random weights: ms per token at batch 1 and 32, 256 new tokens, greedy. A development
measurement (the real-model table is benchmarks/decode.py's)."""

from __future__ import annotations

import time

import numpy as np

from deviceops import nn


def main() -> None:
    cfg = nn.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                         num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=1e5)
    m = nn.random_model(cfg, dtype="float16", device=0, max_batch=32, max_seq=512, kv_blocks=1100)
    m.capture_graphs()
    rng = np.random.default_rng(0)
    n = 256
    for b in (1, 32):
        prompts = [rng.integers(0, 49152, 16).tolist() for _ in range(b)]
        m.generate(prompts, 8)  # warm
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            out = m.generate(prompts, n)
            ts.append(time.perf_counter() - t0)
        toks = sum(len(o) for o in out)
        best = min(ts)
        # the same steps, each read before the next is enqueued
        s = m.device_stream
        t_old = []
        for _ in range(3):
            t0 = time.perf_counter()
            for i, p in enumerate(prompts):
                m.prefill(i, p, sample=True)
            last = [int(x) for x in np.asarray(m.read(m.runner.rows.tokens[:b]).sync_on(s))]
            for k in range(n - 1):
                v = m.decode_step(list(range(b)), last, [16 + k] * b)
                last = [int(x) for x in np.asarray(m.read(v).sync_on(s))[:b]]
            t_old.append(time.perf_counter() - t0)
            for i in range(b):
                m.release(i)
        print(f"batch {b}: generate {best / n * 1e3:.3f} ms/step ({toks / best:,.0f} tok/s, "
              f"{toks} tokens); read-each-step loop {min(t_old) / n * 1e3:.3f} ms/step", flush=True)


if __name__ == "__main__":
    main()
