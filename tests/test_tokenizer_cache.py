"""The Gemma SentencePiece tokenizer kept on disk (``deviceops.nn.tokenizer``,
``sentencepiece_from_gguf``): built once, saved as ``tokenizers`` JSON under the weight
cache's folder, loaded the next time without building; the loaded tokenizer equals a fresh
build; a damaged file or one of another builder version is rebuilt; writes are atomic;
the knob ``DEVICEOPS_WEIGHT_CACHE=0`` turns it off; the build shows a named bar.

The real Gemma 3 270M vocabulary (262,144 tokens): the slow test at the end.
"""

from __future__ import annotations

import logging
import random
import threading
from pathlib import Path
from typing import Any

import pytest

from deviceops.nn import tokenizer as T

_WORDS = ["the", "capital", "of", "france", "is", "paris", "token", "tokenizer", "gemma",
          "model", "cache", "build", "load", "second", "first", "hello", "world", "merge",
          "pieces", "sentence", "lower", "newer", "wider", "deviceops", "kernel", "graph"]


def synthetic_meta() -> dict[str, Any]:
    """GGUF metadata of a Gemma-like SentencePiece vocabulary of ~1,900 tokens: specials,
    the 256 byte tokens, single characters, then substrings of English words (with and
    without ``▁``) by decreasing frequency, so most tokens split several ways (many merges
    of one merged token, whose order matters)."""
    toks = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>",
            "\n", "\n\n", "  "]
    types = [3, 3, 3, 2, 3, 3, 3, 4, 4, 4]
    toks += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    counts: dict[str, int] = {}
    for w in _WORDS:
        for piece in (w, "▁" + w):
            for i in range(len(piece)):
                for j in range(i + 1, min(len(piece), i + 7) + 1):
                    counts[piece[i:j]] = counts.get(piece[i:j], 0) + 1
    chars = sorted({p for p in counts if len(p) == 1})
    longer = sorted((p for p in counts if len(p) > 1), key=lambda p: (-counts[p], len(p), p))
    toks += chars + longer
    types += [1] * (len(chars) + len(longer))
    toks += [f"<unused{i}>" for i in range(40)]
    types += [3] * 40
    return {"general.architecture": "gemma3", "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": toks, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.unknown_token_id": 3}


def sample_texts(n: int, seed: int = 0) -> list[str]:
    """Strings a tokenizer may meet: words in and out of the vocabulary, runs of spaces,
    newlines, characters only byte fallback encodes, special tokens' text."""
    rng = random.Random(seed)
    extra = ["é", "中文", "🙂", "  ", "\n", "\n\n", "\t", "<start_of_turn>", "<eos>", "x9",
             "Paris.", "THE", "tokenizers", "-", "  the", "worldwide", "<unused3>"]
    out = ["", " ", "the capital of france is paris", " the capital", "hello\n\nworld  x"]
    for _ in range(n):
        parts = [rng.choice(_WORDS + extra) for _ in range(rng.randint(1, 12))]
        seps = [rng.choice(["", " ", " ", "  ", "\n"]) for _ in parts]
        out.append("".join(s + p for s, p in zip(seps, parts, strict=True)))
    return out


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "wc"
    monkeypatch.setenv("DEVICEOPS_WEIGHT_CACHE", str(root))
    return root


def _no_build(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("the tokenizer was built, not loaded from the cache")

    monkeypatch.setattr(T, "_build_sentencepiece", fail)
    monkeypatch.setattr(T, "sentencepiece_merges", fail)


def _same(a: Any, b: Any, texts: list[str]) -> None:
    for text in texts:
        ea, eb = a.encode(text, add_special_tokens=False), b.encode(text, add_special_tokens=False)
        assert ea.ids == eb.ids, text
        assert a.decode(ea.ids) == b.decode(eb.ids), text


def test_second_load_comes_from_the_cache_and_equals_a_fresh_build(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    meta = synthetic_meta()
    fresh = T._build_sentencepiece(meta, False)
    first = T.sentencepiece_from_gguf(meta, progress=False)
    path = T.sentencepiece_cache_file(meta)
    assert path is not None and path.is_file() and path.parent == cache / "tokenizers"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    with monkeypatch.context() as mp:
        _no_build(mp)
        second = T.sentencepiece_from_gguf(meta, progress=False)
        assert T.tokenizer_from_gguf(meta, progress=False).to_str() == second.to_str()
    assert second.to_str() == fresh.to_str() == first.to_str()
    texts = sample_texts(400)
    _same(fresh, second, texts)
    # the merges matter: these texts are not all single characters
    assert sum(len(fresh.encode(t).ids) for t in texts) < sum(len(t) for t in texts) // 2


def test_another_vocabulary_is_another_file(cache: Path) -> None:
    meta = synthetic_meta()
    other = {**meta, "tokenizer.ggml.tokens": [*meta["tokenizer.ggml.tokens"][:-1], "<extra>"]}
    a, b = T.sentencepiece_cache_file(meta), T.sentencepiece_cache_file(other)
    assert a is not None and b is not None and a != b
    retyped = {**meta, "tokenizer.ggml.token_type": [*meta["tokenizer.ggml.token_type"][:-1], 1]}
    assert T.sentencepiece_cache_file(retyped) != a
    T.sentencepiece_from_gguf(meta, progress=False)
    tok = T.sentencepiece_from_gguf(other, progress=False)
    assert tok.token_to_id("<extra>") == len(meta["tokenizer.ggml.tokens"]) - 1
    assert sorted(p.name for p in (cache / "tokenizers").iterdir()) == sorted([a.name, b.name])


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "other vocabulary"])
def test_damaged_cache_file_is_rebuilt(damage: str, cache: Path,
                                       caplog: pytest.LogCaptureFixture) -> None:
    meta = synthetic_meta()
    good = T.sentencepiece_from_gguf(meta, progress=False).to_str()
    path = T.sentencepiece_cache_file(meta)
    assert path is not None
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00\xffnot json")
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # a whole tokenizer, but not this vocabulary's
        small = {**meta, "tokenizer.ggml.tokens": meta["tokenizer.ggml.tokens"][:400],
                 "tokenizer.ggml.token_type": meta["tokenizer.ggml.token_type"][:400]}
        path.write_text(T._build_sentencepiece(small, False).to_str())
    with caplog.at_level(logging.WARNING, logger="deviceops.nn"):
        tok = T.sentencepiece_from_gguf(meta, progress=False)
    assert any("damaged" in r.getMessage() for r in caplog.records), caplog.text
    assert tok.to_str() == good
    assert path.read_text() == good  # saved again, whole
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deviceops.nn"):
        assert T.sentencepiece_from_gguf(meta, progress=False).to_str() == good
    assert not caplog.records


def test_another_builder_version_is_rebuilt_and_replaced(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    meta = synthetic_meta()
    T.sentencepiece_from_gguf(meta, progress=False)
    old = T.sentencepiece_cache_file(meta)
    monkeypatch.setattr(T, "SENTENCEPIECE_BUILDER_VERSION", T.SENTENCEPIECE_BUILDER_VERSION + 1)
    new = T.sentencepiece_cache_file(meta)
    assert old is not None and new is not None and new != old
    calls = []
    build = T._build_sentencepiece

    def counting(m: Any, show: bool) -> Any:
        calls.append(1)
        return build(m, show)

    monkeypatch.setattr(T, "_build_sentencepiece", counting)
    T.sentencepiece_from_gguf(meta, progress=False)
    assert calls == [1]
    assert [p.name for p in (cache / "tokenizers").iterdir()] == [new.name]  # the old removed


def test_concurrent_first_loads_leave_one_whole_file(cache: Path) -> None:
    meta = synthetic_meta()
    want = T._build_sentencepiece(meta, False).to_str()
    path = T.sentencepiece_cache_file(meta)
    assert path is not None
    path.parent.mkdir(parents=True)
    (path.parent / f".{path.name}.abc.tmp").write_text('{"half": ')  # a writer that died
    got: list[str] = []
    errors: list[BaseException] = []

    def load() -> None:
        try:
            got.append(T.sentencepiece_from_gguf(meta, progress=False).to_str())
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == [want] * 3
    assert path.read_text() == want
    assert sorted(p.name for p in path.parent.iterdir() if not p.name.startswith(".")) == [path.name]
    assert len(list(path.parent.glob("*.tmp"))) == 1  # only the dead writer's


@pytest.mark.parametrize("value", ["0", ""])
def test_knob_off_writes_nothing(value: str, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("DEVICEOPS_WEIGHT_CACHE", value)
    meta = synthetic_meta()
    assert T.sentencepiece_cache_file(meta) is None
    T.sentencepiece_from_gguf(meta, progress=False)
    assert not (tmp_path / "xdg").exists()


def test_unwritable_cache_still_gives_the_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv("DEVICEOPS_WEIGHT_CACHE", str(blocker / "cache"))
    meta = synthetic_meta()
    with caplog.at_level(logging.WARNING, logger="deviceops.nn"):
        tok = T.sentencepiece_from_gguf(meta, progress=False)
    assert tok.to_str() == T._build_sentencepiece(meta, False).to_str()
    assert any("cannot save" in r.getMessage() for r in caplog.records), caplog.text


def test_the_build_and_the_load_show_named_bars(cache: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    meta = synthetic_meta()
    T.sentencepiece_from_gguf(meta, progress=True)
    err = capsys.readouterr().err
    assert "building the tokenizer (first load)" in err
    T.sentencepiece_from_gguf(meta, progress=True)
    err = capsys.readouterr().err
    assert "loading the tokenizer (cached)" in err and "building" not in err
    T.sentencepiece_from_gguf(meta)  # a small vocabulary: quiet by default
    assert capsys.readouterr().err == ""


def test_merges_progress_counts_every_token() -> None:
    toks = synthetic_meta()["tokenizer.ggml.tokens"]
    seen: list[int] = []
    assert T.sentencepiece_merges(toks, progress=seen.append) == T.sentencepiece_merges(toks)
    assert sum(seen) == len(set(toks))


def _gemma3_270m_meta() -> dict[str, Any]:
    import gguf

    from deviceops.nn.checkpoint import gemma3_270m_path

    try:
        path = gemma3_270m_path()
    except FileNotFoundError as exc:
        pytest.skip(f"the Gemma 3 270M weights are not installed: {exc}")
    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items()
            if k.startswith("tokenizer.") or k == "general.architecture"}


@pytest.mark.slow
def test_gemma3_270m_cached_tokenizer_equals_a_fresh_build(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    meta = _gemma3_270m_meta()
    fresh = T.sentencepiece_from_gguf(meta, progress=False)  # built, then saved
    with monkeypatch.context() as mp:
        _no_build(mp)
        cached = T.sentencepiece_from_gguf(meta, progress=False)
    texts = [*sample_texts(2000, seed=1),
             "The capital of France is", "def fibonacci(n):\n    return n", "naïve café — 東京 🙂",
             "<start_of_turn>user\nHi<end_of_turn>\n", "    indented\tand\r\nCRLF", "1234567890"]
    _same(fresh, cached, texts)
    assert fresh.encode("Hello world, the capital of France is").ids == [
        9259, 1902, 236764, 506, 5279, 529, 7001, 563]
