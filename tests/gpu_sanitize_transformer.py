"""compute-sanitizer target for the transformer kernels (not a pytest module).

Runs every kernel of ``src/transformer.cu`` once per geometry on small odd shapes (vector
and scalar paths, held and streamed rows, greedy/top-k/top-p sampling), synchronizing
after each, and checks the results loosely (the pytest suite checks them exactly). Run:

    compute-sanitizer --tool memcheck python3 tests/gpu_sanitize_transformer.py
    compute-sanitizer --tool racecheck python3 tests/gpu_sanitize_transformer.py
"""

from __future__ import annotations

import sys

import numpy as np

import deviceops
from deviceops import api, kernels


def main() -> int:
    dev = deviceops.default_device()
    if dev.is_cpu:
        print("no GPU: nothing to sanitize")
        return 0
    s = dev.new_stream()
    rng = np.random.default_rng(0)

    def up(a: np.ndarray) -> deviceops.Tensor:
        return api.from_host(np.ascontiguousarray(a)).sync_on(s)

    for dt in (np.float32, np.float16):
        for shape in [(3, 5), (2, 768), (1, 4096), (3, 9000), (1, 70000), (300, 64), (2, 767)]:
            x, r = up(rng.standard_normal(shape).astype(dt)), up(rng.standard_normal(shape).astype(dt))
            w = up(rng.standard_normal(shape[-1]).astype(dt))
            y = kernels.rms_norm(x, w).sync_on(s)
            o, _ = kernels.add_rms_norm(x, r, w).sync_on(s)
            assert np.isfinite(np.asarray(api.to_host(o).sync_on(s), np.float64)).all()
            assert np.isfinite(np.asarray(api.to_host(y).sync_on(s), np.float64)).all()
        for b, length, hq, hkv, d, sl in [(2, 3, 4, 2, 64, 9), (1, 1, 3, 1, 6, 4), (2, 5, 2, 2, 34, 6)]:
            qkv = up(rng.standard_normal((b, length, (hq + 2 * hkv) * d)).astype(dt))
            st = up(np.array([sl - 2] + [0] * (b - 1), np.int32))  # row 0 runs past the cache
            kc, vc = up(np.zeros((b, hkv, sl, d), dt)), up(np.zeros((b, hkv, sl, d), dt))
            kernels.rope_kv_write(qkv, st, kc, vc, n_heads=hq, n_kv_heads=hkv).sync_on(s)
            x4 = up(rng.standard_normal((b, length, hq, d)).astype(dt))
            kernels.rope(x4, st, out=x4).sync_on(s)
            kernels.merge_heads(kernels.rope(x4, st)).sync_on(s)
        for shape in [(3, 10), (2, 3 * 1536), (5, 2 * 1001)]:
            kernels.swiglu(up(rng.standard_normal(shape).astype(dt))).sync_on(s)
        for b, v in [(3, 50), (2, 9001), (1, 49152)]:
            lg = up(rng.standard_normal((b, v)).astype(dt))
            t = up(np.array([0.0, 1.0, 0.7][:b], np.float32))
            k = up(np.array([0, 20, 0][:b], np.int32))
            p = up(np.array([1.0, 0.9, 0.5][:b], np.float32))
            sd, ct = up(np.arange(b, dtype=np.int64)), up(np.zeros(b, np.int64))
            tok = np.asarray(api.to_host(kernels.sample(lg, t, k, p, sd, ct)).sync_on(s))
            assert ((tok >= 0) & (tok < v)).all(), tok
    dev.synchronize()
    print("sanitize run: all transformer kernels ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
