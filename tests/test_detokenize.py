"""The front's incremental detokenizer (:mod:`deviceops.nn.serving.detokenize`) on tokens of
several characters: pieces as they come, special tokens kept, stop strings."""

from __future__ import annotations

from collections.abc import Sequence


class _Tok:
    """A tokenizer whose tokens are words (special tokens dropped on request)."""

    words = ("<s>", "Hello", ",", " wor", "ld", "!", " é", "t\u00e9")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.words[i] for i in ids
                       if not (skip_special_tokens and self.words[i] == "<s>"))


class _Model:
    tokenizer = _Tok()

    def decode(self, ids: Sequence[int]) -> str:  # what a model's own decode may do instead
        return "(model decode)"


def test_the_detokenizer_streams_multi_character_tokens_and_keeps_special_ones() -> None:
    from deviceops.nn.serving.detokenize import Detokenizer, text_decoder

    assert text_decoder(_Model())([0, 1]) == "<s>Hello"  # the tokenizer, specials kept
    d = Detokenizer(_Model(), frozenset({99}), [])
    pieces = [d.push(t) for t in (1, 2, 3, 4, 5)]
    assert pieces == ["Hello", ",", " wor", "ld", "!"]
    d = Detokenizer(_Model(), frozenset({99}), ["wor"])  # a stop string inside a token
    out = "".join(d.push(t) for t in (1, 2, 3, 4)) + d.finish()
    assert out == "Hello, " and d.stopped


class _Bytes:
    """Token 6 is the first byte of 'é', token 7 its second: alone, 6 decodes to U+FFFD."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text = "".join(_Tok.words[i] if i < 6 else chr(i) for i in ids)
        return text.replace(chr(6) + chr(7), "é").replace(chr(6), "\ufffd").replace(chr(7), "\ufffd")


class _BytesModel:
    tokenizer = _Bytes()


def test_an_incomplete_character_waits_for_its_next_byte() -> None:
    from deviceops.nn.serving.detokenize import Detokenizer

    d = Detokenizer(_BytesModel(), frozenset({99}), [])
    assert [d.push(t) for t in (1, 6, 7, 5)] == ["Hello", "", "é", "!"]
    assert "\ufffd" not in d.text


def test_finish_releases_text_held_back_for_a_stop_string() -> None:
    from deviceops.nn.serving.detokenize import Detokenizer

    d = Detokenizer(_Model(), frozenset({99}), [" world"])
    assert d.push(1) + d.push(3) == "Hello"  # " wor" may begin " world": held back
    assert d.finish() == " wor" and not d.stopped
