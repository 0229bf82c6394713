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
