"""The host cost of grammar masks: microseconds per constrained row per step.

Builds the model's tokenizer for llguidance from its GGUF metadata (no weights are read),
compiles a JSON-schema grammar and a tool-call grammar, and times
:class:`deviceops.nn.serving.grammar.MaskBatch.fill` for batches of ``rows`` matchers
walked through a valid reply token by token (one fill per step, every row advanced by one
token after it), as the engine's scheduler fills them. Prints a table and, with ``--json``,
writes the rows.

    python tools/grammar_mask_cost.py --model smollm2 --rows 1 8 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                         "address": {"type": "object", "properties": {
                             "city": {"type": "string"}, "zip": {"type": "string"}},
                             "required": ["city", "zip"], "additionalProperties": False}},
          "required": ["name", "age", "tags", "address"], "additionalProperties": False}
REPLY = ('{"name":"Alice Smith","age":31,"tags":["admin","ops"],'
         '"address":{"city":"Paris","zip":"75001"}}')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}}]
CALL = ('<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}}'
        '\n</tool_call>')


def _tokenizer(model: str) -> tuple[Any, int, list[int]]:
    """The model's ``tokenizers.Tokenizer``, vocabulary size and stop ids, from its GGUF."""
    import gguf

    from deviceops.nn.checkpoint import _field_value, qwen2_5_coder_path, smollm2_path
    from deviceops.nn.tokenizer import tokenizer_from_gguf

    path = smollm2_path() if model == "smollm2" else qwen2_5_coder_path()
    reader = gguf.GGUFReader(str(path))
    meta = {k: _field_value(f) for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    tok = tokenizer_from_gguf(meta)
    vocab = len(meta["tokenizer.ggml.tokens"])
    return tok, vocab, [int(meta["tokenizer.ggml.eos_token_id"])]


def measure(model: str, rows: list[int], repeats: int) -> list[dict[str, Any]]:
    from deviceops.nn.serving.grammar import (
        GrammarCompiler,
        MaskBatch,
        json_schema_grammar,
        tags_are_tokens,
        tool_call_grammar,
    )

    tok, vocab, eos = _tokenizer(model)
    t0 = time.perf_counter()
    comp = GrammarCompiler(tok.to_str(), vocab, eos)
    build_s = time.perf_counter() - t0
    out = []
    for name, grammar, text in (("json_schema", json_schema_grammar(SCHEMA), REPLY),
                                ("tool_call", tool_call_grammar(TOOLS, tag_tokens=tags_are_tokens(tok)), CALL)):
        ids = tok.encode(text, add_special_tokens=False).ids
        t0 = time.perf_counter()
        comp.matcher(grammar)
        compile_us = (time.perf_counter() - t0) * 1e6
        for n in rows:
            per_row: list[float] = []
            for _ in range(repeats):
                batch = MaskBatch(n, vocab)
                ms = [comp.matcher(grammar) for _ in range(n)]
                for t in ids:
                    t1 = time.perf_counter()
                    mask = batch.fill(ms)
                    per_row.append((time.perf_counter() - t1) * 1e6 / n)
                    if not (int(mask[0, t // 32]) >> (t % 32)) & 1:
                        raise SystemExit(f"{name}: token {t} of the reply is not allowed")
                    for m in ms:
                        if m.advance(t) == "error":
                            raise SystemExit(f"{name}: token {t} refused: {m.error}")
            out.append({"model": model, "vocab": vocab, "grammar": name, "rows": n,
                        "steps": len(ids), "median_us_per_row": statistics.median(per_row),
                        "p90_us_per_row": sorted(per_row)[int(0.9 * (len(per_row) - 1))],
                        "compile_us": compile_us, "tokenizer_build_s": build_s})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["smollm2", "qwen2.5-coder"], nargs="+",
                    default=["smollm2"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    rows = [r for m in a.model for r in measure(m, a.rows, a.repeats)]
    print(f"{'model':<14}{'vocab':>8} {'grammar':<12}{'rows':>5}{'steps':>6}"
          f"{'median us/row':>15}{'p90 us/row':>12}{'compile us':>12}")
    for r in rows:
        print(f"{r['model']:<14}{r['vocab']:>8} {r['grammar']:<12}{r['rows']:>5}{r['steps']:>6}"
              f"{r['median_us_per_row']:>15.1f}{r['p90_us_per_row']:>12.1f}"
              f"{r['compile_us']:>12.0f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
