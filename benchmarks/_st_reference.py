"""The sentence-transformers side of ``embeddings.py``, run in its own process (its own
environment: it imports torch and sentence-transformers, not deviceops).

``python _st_reference.py SPEC.json``: SPEC holds ``texts``, ``folder`` (the model),
``device`` (``cuda`` or ``cpu``), ``dtype``, ``batch`` (encode's batch_size), ``warmup``,
``reps`` and ``out``; writes to ``out`` the float32 embeddings (``ref32``), those of the
timed dtype (``timed``), the wall-clock seconds of each timed ``encode`` (``wall_s``) and,
on CUDA, the CUDA-event milliseconds of each timed forward over its batches (``device_ms``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np


def reference_worker(spec_path: str) -> None:
    """Run sentence-transformers as the spec says; write embeddings and timings as JSON."""
    import torch
    from sentence_transformers import SentenceTransformer

    spec = json.loads(Path(spec_path).read_text())
    texts: list[str] = spec["texts"]
    cuda = spec["device"] == "cuda"
    device = "cuda" if cuda else "cpu"
    model = SentenceTransformer(spec["folder"], device=device)
    model.eval()
    ref32 = model.encode(texts, batch_size=spec["batch"], convert_to_numpy=True)
    if spec["dtype"] == "float16":
        model.half()
    elif spec["dtype"] == "bfloat16":
        model.bfloat16()
    timed = model.encode(texts, batch_size=spec["batch"], convert_to_numpy=True)

    def run() -> None:
        model.encode(texts, batch_size=spec["batch"], convert_to_numpy=True)
        if cuda:
            torch.cuda.synchronize()

    for _ in range(spec["warmup"]):
        run()
    wall = []
    for _ in range(spec["reps"]):
        t0 = time.perf_counter()
        run()
        wall.append(time.perf_counter() - t0)
    device_ms: list[float] = []
    if cuda:  # the forward over sentence-transformers' own batches, features on the device
        order = np.argsort([-len(t) for t in texts], kind="stable")  # its sort (by length)
        batches = []
        for i in range(0, len(texts), spec["batch"]):
            chunk = [texts[j] for j in order[i:i + spec["batch"]]]
            feats = model.tokenize(chunk)
            batches.append({k: v.to(device) for k, v in feats.items()})
        with torch.inference_mode():
            for r in range(spec["warmup"] + spec["reps"]):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for feats in batches:
                    model.forward(dict(feats))["sentence_embedding"]
                b.record()
                b.synchronize()
                if r >= spec["warmup"]:
                    device_ms.append(a.elapsed_time(b))
    Path(spec["out"]).write_text(json.dumps({
        "ref32": np.asarray(ref32, np.float32).tolist(),
        "timed": np.asarray(timed, np.float32).tolist(),
        "wall_s": wall, "device_ms": device_ms,
        "versions": {"torch": torch.__version__,
                     "sentence_transformers": __import__("sentence_transformers").__version__}}))


if __name__ == "__main__":
    reference_worker(sys.argv[1])
