"""Host cost of an eager prefill (random-weight SmolLM2 shapes): wall per call without a sync
inside the timed region, and a cProfile of one call (top functions by own time).

Compares code versions the way ``tools/prefill_bisect_gpu.py`` does (``PYTHONPATH`` to a copy
of the other version's package). Usage (GPU machine): ``python3 tools/eager_host_gpu.py LABEL``.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prefill_bisect_gpu import CFG, weights

import deviceops
from deviceops.nn.model import CausalLM


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "?"
    print(f"== {label}: deviceops from {deviceops.__file__}", flush=True)
    m = CausalLM(CFG, weights(CFG), tokenizer=None, dtype="float16", device=0, max_batch=32,
                 max_seq=2304, prefill_chunk=512)
    s = m.device_stream
    m.set_sampling(0)
    for n in (128, 512):
        ids = np.random.default_rng(n).integers(100, CFG.vocab_size, n).tolist()
        for _ in range(3):
            m.read(m.prefill(0, ids, graph=False)).sync_on(s)
        host = []
        for _ in range(7):
            t0 = time.perf_counter()
            view = m.prefill(0, ids, graph=False)
            host.append(time.perf_counter() - t0)
            m.read(view).sync_on(s)
        print(f"  eager prefill {n}: host {np.median(host) * 1e3:.2f} ms per call (enqueue only)", flush=True)
    ids = np.random.default_rng(128).integers(100, CFG.vocab_size, 128).tolist()
    pr = cProfile.Profile()
    pr.enable()
    m.read(m.prefill(0, ids, graph=False)).sync_on(s)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
