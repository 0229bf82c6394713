"""all-MiniLM-L6-v2 sentence embeddings: ``nn.minilm()`` beside sentence-transformers (torch).

Issue 44's bar: 256 sentences of 32-128 tokens embedded at least 3x as fast as
sentence-transformers on the same GPU, in the same dtype (float16 by default).

Inputs: ``--n`` sentences (256) of whole-word vocabulary entries, sentence ``i`` exactly
``L_i`` tokens long with [CLS] and [SEP], ``L_i`` drawn uniformly from ``--min-tokens`` ..
``--max-tokens`` (32..128) with a fixed seed, so both sides read identical token ids.

Correctness first: sentence-transformers in float32 gives the reference embeddings; ours
(in the timed dtype) must have a cosine of at least 0.9999 with them in float32 (0.999 in
float16/bfloat16) for every sentence, and sentence-transformers' own timed-dtype output
too. The cpu backend also checks the committed oracle of ``tests/fixtures/minilm_oracle.json``.

Timing, each the median of ``--reps`` runs after ``--warmup`` runs:

* ``end_to_end``: texts in, a float32 NumPy ``(N, 384)`` out (tokenising, batching,
  forward, pooling, copy to the host), wall-clock (``perf_counter``) around calls that
  return the host array: ``Encoder.embed(texts)`` and ``SentenceTransformer.encode(texts,
  batch_size=--st-batch)``.
* ``device`` (GPU only): token ids already on the host, the device span measured with CUDA
  events on the stream that runs it: ours ``embed_op(ids)`` on the encoder's stream; torch
  the model's forward over the batches sentence-transformers makes (sorted by length,
  ``--st-batch`` each, padded to the longest), features already on the device.

sentence-transformers runs in a separate process (``_st_reference.py`` run by
``--reference-python``, default this interpreter), so it may live in another environment
(transformers and torch are large: the cpu machine keeps them in a throwaway venv) and its
threads do not share this process's.

``--smoke``: 8 sentences of 8..16 tokens on the cpu backend, one timed run, the reference
only where ``--reference-python`` has sentence-transformers (else the oracle fixture alone).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import (
    Bar,
    add_common_args,
    check,
    check_close,
    main_guard,
    print_bars,
    setup,
    table,
    write_json,
)

from deviceops import nn

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "minilm_oracle.json"


# -- inputs ------------------------------------------------------------------------------------
def make_sentences(tokenizer: Any, n: int, lo: int, hi: int, seed: int = 0) -> list[str]:
    """``n`` texts of whole-word vocabulary entries; text ``i`` encodes to exactly ``L_i``
    tokens ([CLS] and [SEP] included), ``L_i`` uniform in ``[lo, hi]``."""
    vocab = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and w.islower() and len(w) >= 3)
    rng = np.random.default_rng(seed)
    out = []
    for length in rng.integers(lo, hi + 1, n):
        words = [vocab[int(i)] for i in rng.integers(0, len(vocab), int(length) - 2)]
        out.append(" ".join(words))
    return out


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)  # type: ignore[no-any-return]


# -- sentence-transformers, in its own process ---------------------------------------------------
def run_reference(python: str, folder: Path, texts: list[str], *, device: str, dtype: str,
                  batch: int, warmup: int, reps: int) -> dict[str, Any] | None:
    """sentence-transformers' results from ``python`` (``None``: not installed there)."""
    # run from a neutral folder: this checkout's top-level folders (kernels/, nn/) would
    # shadow packages of the same names that transformers may import
    neutral = tempfile.gettempdir()
    probe = subprocess.run([python, "-c", "import sentence_transformers, torch"],
                           capture_output=True, text=True, cwd=neutral)
    if probe.returncode != 0:
        print(f"# no sentence-transformers in {python}: the reference is skipped "
              f"({probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else ''})")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "spec.json"
        out = Path(tmp) / "out.json"
        spec.write_text(json.dumps({"texts": texts, "folder": str(folder), "device": device,
                                    "dtype": dtype, "batch": batch, "warmup": warmup,
                                    "reps": reps, "out": str(out)}))
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.run([python, str(Path(__file__).resolve().parent / "_st_reference.py"),
                               str(spec)], capture_output=True, text=True, env=env, cwd=neutral)
        if proc.returncode != 0:
            raise RuntimeError(f"the sentence-transformers worker failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())  # type: ignore[no-any-return]


# -- ours ----------------------------------------------------------------------------------------
def time_ours_wall(enc: nn.Encoder, texts: list[str], warmup: int, reps: int) -> list[float]:
    for _ in range(warmup):
        enc.embed(texts)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        enc.embed(texts)
        out.append(time.perf_counter() - t0)
    return out


def time_ours_device(enc: nn.Encoder, ids: list[list[int]], warmup: int, reps: int) -> list[float]:
    """CUDA-event span of ``embed_op(ids)`` on the encoder's stream, in ms."""
    import cupy

    stream = cupy.cuda.ExternalStream(enc.device_stream.native.ptr)
    out = []
    for r in range(warmup + reps):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        op = enc.embed_op(ids)  # tokens checked and batched on the host before the span
        a.record(stream)
        t = op.async_on(enc.device_stream)
        b.record(stream)
        b.synchronize()
        del t
        if r >= warmup:
            out.append(cupy.cuda.get_elapsed_time(a, b))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--n", type=int, default=256, help="sentences")
    p.add_argument("--min-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="None: float16 on CUDA, float32 on the cpu backend")
    p.add_argument("--st-batch", type=int, default=256,
                   help="sentence-transformers' batch_size (its encode sorts by length)")
    p.add_argument("--reps", type=int, default=10, help="timed runs (median)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reference-python", default=sys.executable,
                   help="the interpreter that has sentence-transformers and torch")
    args = p.parse_args()
    b = setup(args)
    if b.smoke:
        args.n, args.min_tokens, args.max_tokens, args.reps, args.warmup = 8, 8, 16, 1, 1
    dtype = args.dtype or ("float32" if not b.is_cuda else "float16")
    from deviceops.nn.encoder_load import minilm_path

    folder = minilm_path()
    enc = nn.minilm(device=b.device, dtype=dtype)
    texts = make_sentences(enc.tokenizer, args.n, args.min_tokens, args.max_tokens)
    ids = enc.encode_batch(texts)
    lengths = [len(s) for s in ids]
    check(min(lengths) >= args.min_tokens and max(lengths) <= args.max_tokens,
          f"inputs: {args.n} sentences of {min(lengths)}..{max(lengths)} tokens")
    print(f"# {args.n} sentences, {sum(lengths)} tokens ({min(lengths)}..{max(lengths)}), "
          f"{dtype}, ours on {b.device}")

    # correctness first
    ours = enc.embed(texts)
    bar_cos = 0.9999 if dtype == "float32" else 0.999
    if not b.is_cuda:
        oracle = json.loads(FIXTURE.read_text())
        got = enc.embed([s["text"] for s in oracle["sentences"]])
        want = np.array([s["embedding"] for s in oracle["sentences"]])
        c = float(_cos(got, want).min())
        check(c >= 0.9999, f"oracle fixture: min cosine {c:.6f} >= 0.9999")
        check_close(got, want, "oracle fixture: embeddings", rtol=1e-4)
    cosines: dict[str, float] = {}
    ref = run_reference(args.reference_python, folder, texts, device="cuda" if b.is_cuda else "cpu",
                        dtype=dtype, batch=args.st_batch, warmup=args.warmup, reps=args.reps)
    if ref is not None:
        ref32 = np.array(ref["ref32"])
        c_ours = float(_cos(ours, ref32).min())
        c_ref = float(_cos(np.array(ref["timed"]), ref32).min())
        check(c_ours >= bar_cos, f"ours {dtype} vs sentence-transformers float32: min cosine "
                                 f"{c_ours:.6f} >= {bar_cos}")
        check(c_ref >= bar_cos, f"sentence-transformers {dtype} vs its float32: min cosine "
                                f"{c_ref:.6f} >= {bar_cos}")
        cosines = {"ours": c_ours, "sentence_transformers": c_ref}
        print(f"# min cosine vs sentence-transformers float32: ours {c_ours:.8f}, "
              f"sentence-transformers {dtype} {c_ref:.8f}")

    rows = []
    wall = statistics.median(time_ours_wall(enc, texts, args.warmup, args.reps))
    ref_wall = statistics.median(ref["wall_s"]) if ref is not None else None
    rows.append({"variant": "end_to_end", "dtype": dtype, "n": args.n, "tokens": sum(lengths),
                 "ours_ms": wall * 1e3, "reference": "sentence-transformers encode",
                 "ref_ms": None if ref_wall is None else ref_wall * 1e3,
                 "ratio": None if ref_wall is None else ref_wall / wall,
                 "ours_sentences_per_s": args.n / wall})
    if b.is_cuda:
        dev_ms = statistics.median(time_ours_device(enc, ids, args.warmup, args.reps))
        ref_dev = statistics.median(ref["device_ms"]) if ref is not None and ref["device_ms"] else None
        rows.append({"variant": "device", "dtype": dtype, "n": args.n, "tokens": sum(lengths),
                     "ours_ms": dev_ms, "reference": "sentence-transformers forward",
                     "ref_ms": ref_dev, "ratio": None if ref_dev is None else ref_dev / dev_ms,
                     "ours_sentences_per_s": args.n / (dev_ms * 1e-3)})
    print()
    print(table(rows, [("variant", "variant", 0), ("dtype", "dtype", 0), ("n", "n", 0),
                       ("tokens", "tokens", 0), ("ours_ms", "ours ms", 2),
                       ("ref_ms", "s-t ms", 2), ("ratio", "s-t/ours", 2),
                       ("ours_sentences_per_s", "ours sent/s", 0)]))
    bars = [Bar(f"minilm {r['variant']} {args.n} sentences {dtype} vs sentence-transformers",
                r["ratio"], ">=", 3.0, "x", note="its time / ours") for r in rows]
    print_bars(bars, b)
    write_json(args.json, "embeddings", b,
               {"n": args.n, "min_tokens": args.min_tokens, "max_tokens": args.max_tokens,
                "dtype": dtype, "st_batch": args.st_batch, "reps": args.reps,
                "warmup": args.warmup, "reference_python": args.reference_python},
               rows, bars, {"reference_versions": None if ref is None else ref["versions"],
                            "min_cosine_vs_reference_float32": cosines})
    return 0


if __name__ == "__main__":
    main_guard(main)
