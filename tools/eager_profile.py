"""Host cost of an eager SmolLM2-shaped decode step (random weights), with a cProfile table.

Usage: python tools/eager_profile.py [--device cpu|cuda] [--small] [--steps 40] [--no-profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from deviceops import nn
from deviceops.nn.config import LlamaConfig
from deviceops.nn.load import SMOLLM2_135M

SMALL = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=30,
                    num_heads=4, num_kv_heads=2, head_dim=16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--small", action="store_true", help="a tiny config (cpu: host cost only)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--no-profile", action="store_true")
    a = ap.parse_args()
    m = nn.random_model(SMALL if a.small else SMOLLM2_135M, device=a.device, max_batch=4,
                        max_seq=256)
    s = m.device_stream
    m.set_sampling(0)
    m.prefill(0, [1, 2, 3, 4], graph=False)
    pos = [4]

    def step() -> None:
        v = m.decode_step([0], [5], [pos[0]], graph=False)
        m.read(v).sync_on(s)
        pos[0] += 1

    for _ in range(5):
        step()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    dt = (time.perf_counter() - t0) / a.steps
    print(f"eager decode step: {dt * 1e3:.2f} ms ({m.device}, {m.dtype})")
    if a.no_profile:
        return
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(a.steps):
        step()
    pr.disable()
    st = pstats.Stats(pr)
    st.sort_stats("tottime").print_stats(40)
    st.sort_stats("cumtime").print_stats(45)


if __name__ == "__main__":
    main()
