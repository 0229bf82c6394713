"""Fused decode on the GPU against the unfused ops: logits of teacher-forced decode steps on
a SmolLM2-shaped random model (float16 and bfloat16, buckets 1, 8 and 32, contexts short and
past 2,048 keys), then graph step times of both. A development check; the tests are
tests/test_fused_decode.py. ``--quick``: float16 only; ``--variants``: step times with parts of
the kernel left out (where the time goes)."""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from deviceops import api, nn


def model(flag: str, dtype: str, max_batch: int, max_seq: int) -> nn.CausalLM:
    os.environ["DEVICEOPS_FUSED_DECODE"] = flag
    cfg = nn.LlamaConfig(vocab_size=4096, hidden_size=576, intermediate_size=1536, num_layers=30,
                         num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=1e5)
    return nn.random_model(cfg, dtype=dtype, device=0, max_batch=max_batch, max_seq=max_seq,
                           kv_block_size=16, kv_blocks=max_batch * max_seq // 16 + 8, seed=1)


def logits_run(m: nn.CausalLM, prompts: list[list[int]], toks: list[list[int]], graph: bool) -> np.ndarray:
    n = len(prompts)
    for i, p in enumerate(prompts):
        m.prefill(i, p, sample=False)
    out = []
    for s, t in enumerate(toks):
        m.decode_step(list(range(n)), t, [len(p) + s for p in prompts], graph=graph)
        out.append(np.asarray(api.to_host(m.runner.logits).sync_on(m.device_stream))[:n].astype(np.float32))
    for i in range(n):
        m.release(i)
    return np.stack(out)


VARIANTS = {"all": 0, "no attention": 1, "no projections": 2, "no norms": 4, "no tile loads": 8,
            "no L2 prefetch": 16, "barriers doubled": 32, "barriers only": 1 | 2 | 4 | 8 | 16}


def variants() -> None:
    """Step times of the fused kernel with parts left out (FD_SKIP_*): where the time goes."""
    rng = np.random.default_rng(0)
    for b in (1, 32):
        m = model("1", "float16", 32, 512)
        f = m.runner.fused
        prompts = [rng.integers(0, 4096, 200).tolist() for _ in range(b)]
        for i, p in enumerate(prompts):
            m.prefill(i, p, sample=False)
        st, k0 = m.device_stream, 0
        line = []
        for name, v in VARIANTS.items():
            f.variant = v
            f._steps.clear()  # (new launch records, new graphs: a development tool's reset)
            m.runner.decoder.graphs.clear()
            m.runner.decoder._thunks.clear()
            m.decode_step(list(range(b)), [1] * b, [200 + k0 % 300] * b)
            k0 += 1
            ts = []
            for _ in range(3):
                api.to_host(m.runner.logits).sync_on(st)
                t0 = time.perf_counter()
                for _ in range(40):
                    m.decode_step(list(range(b)), [1] * b, [200 + k0 % 300] * b)
                    k0 += 1
                api.to_host(m.runner.logits).sync_on(st)
                ts.append((time.perf_counter() - t0) / 40 * 1e3)
            line.append(f"{name} {min(ts):.3f}")
        print(f"variants b={b} (ms/step): " + "; ".join(line), flush=True)
        del m


def main() -> int:
    if "--variants" in sys.argv:
        variants()
        return 0
    rng = np.random.default_rng(0)
    bad = 0
    dtypes = ("float16",) if "--quick" in sys.argv else ("float16", "bfloat16")
    for dtype in dtypes:
        for b, lens, mseq in ((1, [37], 512), (8, None, 512), (32, None, 512), (3, [2100, 5, 900], 2400)):
            if lens is None:
                lens = rng.integers(1, 300, b).tolist()
            prompts = [rng.integers(0, 4096, n).tolist() for n in lens]
            toks = [rng.integers(0, 4096, len(prompts)).tolist() for _ in range(4)]
            res = {}
            for flag in ("0", "1"):
                m = model(flag, dtype, max(b, 4), mseq)
                t0 = time.perf_counter()
                res[flag] = logits_run(m, prompts, toks, graph=(flag == "1"))
                res[flag + "e"] = logits_run(m, prompts, toks, graph=False) if flag == "1" else None
                del m
            ref, got = res["0"], res["1"]
            err = float(np.abs(ref - got).max())
            scale = float(np.abs(ref).max())
            agree = float((ref.argmax(-1) == got.argmax(-1)).mean())
            eg = float(np.abs(res["1e"] - got).max())
            ok = err <= 0.05 * scale and agree >= 0.9
            bad += not ok
            print(f"{dtype} b={b} lens={lens[:3]}: max|d| {err:.4f} (scale {scale:.2f}) argmax agree "
                  f"{agree:.2f} eager-vs-graph {eg:.4f} {'ok' if ok else 'MISMATCH'}", flush=True)
    # timing: graph decode steps
    for dtype in ("float16",):
        for b in (1, 8, 32):
            for flag in ("0", "1"):
                m = model(flag, dtype, 32, 512)
                prompts = [rng.integers(0, 4096, 200).tolist() for _ in range(b)]
                for i, p in enumerate(prompts):
                    m.prefill(i, p, sample=False)
                toks = [1] * b
                pos = [200] * b
                m.decode_step(list(range(b)), toks, pos)
                st = m.device_stream
                st.synchronize() if hasattr(st, "synchronize") else None
                n = 60
                ts = []
                for rep in range(3):
                    api.to_host(m.runner.logits).sync_on(st)
                    t0 = time.perf_counter()
                    for k in range(n):
                        m.decode_step(list(range(b)), toks, [p + 1 + k + rep * n for p in pos])
                    api.to_host(m.runner.logits).sync_on(st)
                    ts.append((time.perf_counter() - t0) / n * 1e3)
                print(f"timing {dtype} b={b} fused={flag}: {min(ts):.3f} ms/step (no readback)", flush=True)
                if flag == "1":  # where a fused step's time goes: block 0's clock per phase
                    f = m.runner.fused
                    m2 = model("1", dtype, 32, 512)
                    f2 = m2.runner.fused
                    f2.ticks = api.zeros((8 * f2.n_layers + 3,), "int64").sync_on(m2.device_stream)
                    for i, p in enumerate(prompts):
                        m2.prefill(i, p, sample=False)
                    for k in range(5):
                        m2.decode_step(list(range(b)), toks, [p + k for p in pos], graph=False)
                    t = np.asarray(api.to_host(f2.ticks).sync_on(m2.device_stream)).astype(np.float64)
                    nl = f2.n_layers
                    main, det = t[: 5 * nl + 3], t[5 * nl + 3:].reshape(nl, 3)
                    d = np.diff(main) / 1e3
                    print(f"  barrier us: {d[0] / 64:.2f}", flush=True)
                    d = d[1:]
                    per = d[: 5 * nl].reshape(nl, 5)
                    print(f"  phases (us, median over layers) A {np.median(per[:, 0]):.2f} B "
                          f"{np.median(per[:, 1]):.2f} C {np.median(per[:, 2]):.2f} D "
                          f"{np.median(per[:, 3]):.2f} E {np.median(per[:, 4]):.2f}; head "
                          f"{d[-1]:.2f}; total {(main[-1] - main[1]) / 1e3:.1f}", flush=True)
                    c_start = main[2 + 5 * np.arange(nl) + 1]  # after B's barrier
                    c_end = main[2 + 5 * np.arange(nl) + 2]
                    seg = np.stack([det[:, 0] - c_start, det[:, 1] - det[:, 0], det[:, 2] - det[:, 1],
                                    c_end - det[:, 2]], 1) / 1e3
                    med = np.median(seg, 0)
                    print(f"  phase C inside (block 0, us): tile load {med[0]:.2f}, gemv {med[1]:.2f}, "
                          f"arrive {med[2]:.2f}, preload + wait {med[3]:.2f}", flush=True)
                    del m2, f
                del m
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
