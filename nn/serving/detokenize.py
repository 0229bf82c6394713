"""Incremental detokenization of a token stream, with OpenAI stop strings.

:class:`Detokenizer` turns the tokens of one generation into text pieces as they come,
holding back an incomplete UTF-8 character and any suffix that may begin a stop string,
and ends the text at the first stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Detokenizer", "text_decoder"]


def text_decoder(model: Any) -> Callable[[list[int]], str]:
    """ids -> text: the model's tokenizer (special tokens kept, as ``CausalLM.decode``), or
    the model's own one-argument ``decode``."""
    tok = getattr(model, "tokenizer", None)
    if tok is not None and hasattr(tok, "decode"):
        return lambda ids: str(tok.decode(ids, skip_special_tokens=False))
    return lambda ids: str(model.decode(ids))


class Detokenizer:
    """Incremental detokenizer with stop strings (text held back while it may start one)."""

    def __init__(self, model: Any, eos: frozenset[int], stops: Sequence[str]) -> None:
        self.decode = text_decoder(model)
        self.eos, self.stops = eos, list(stops)
        self.ids: list[int] = []
        self.text = ""  # all text decoded so far
        self.sent = 0  # characters of text already emitted
        self._prefix = 0  # the decode window's context starts here ...
        self._read = 0  # ... and its new tokens here
        self.stopped = False

    def push(self, tok: int) -> str:
        if tok not in self.eos:
            ids = self.ids
            ids.append(tok)
            # decode a window, not every token so far (vLLM's incremental scheme): the text
            # of ids[prefix:] beyond that of ids[prefix:read] is new, unless it ends in an
            # incomplete UTF-8 sequence (then wait for the next token)
            lo, mid = self._prefix, self._read
            before = self.decode(ids[lo:mid]) if mid > lo else ""
            now = self.decode(ids[lo:])
            if len(now) > len(before) and not now.endswith("\ufffd"):
                self.text += now[len(before):]
                self._prefix, self._read = mid, len(ids)
        return self._emit(final=False)

    def finish(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        end = len(self.text)
        for s in self.stops:  # (emitted text never holds the start of a stop string)
            i = self.text.find(s, max(0, self.sent - len(s)))
            if i >= 0:
                self.stopped, end = True, min(end, i)
        if not self.stopped and not final:
            for s in self.stops:  # hold back a suffix that could begin a stop string
                for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(s[:k]):
                        end = min(end, len(self.text) - k)
                        break
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out
