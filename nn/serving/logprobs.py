"""OpenAI's ``logprobs`` objects of a completion choice, from the engine's per-token
:class:`~.requests.TokenLogprob` records.

The values are what the device computed (:func:`deviceops.kernels.logprobs`): the
log-softmax, at temperature 1, of the logits the token was drawn from **after** the request's
presence/frequency penalties and ``logit_bias`` and before temperature, top-k and top-p (so
they do not depend on the sampling parameters, as OpenAI's do not). A token's text is its
id decoded alone (a byte-level token holding part of a UTF-8 character reads as
U+FFFD); ``bytes`` are that text's UTF-8 bytes. EOS tokens (whose text is empty) get no
entry; a completion cut by a stop string keeps the entries of the tokens generated up to the
one that completed it.

* ``/v1/completions`` (``logprobs: N``): ``{"tokens", "token_logprobs", "top_logprobs"
  (one ``{text: logprob}`` per token, N entries, best first; tokens decoding to the same text
  keep the best), "text_offset" (each token's offset in the completion text)}``.
* ``/v1/chat/completions`` (``logprobs: true``, ``top_logprobs: N``): ``{"content":
  [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}],
  "refusal": null}``.

In a stream each chunk carries the entries of the tokens consumed since the previous chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .requests import TokenLogprob

__all__ = ["Entry", "choice_logprobs"]

#: A token's record and its offset in the completion text.
Entry = tuple[TokenLogprob, int]


def _text(decode: Callable[[list[int]], str], tok: int) -> str:
    return decode([tok])


def _chat_item(decode: Callable[[list[int]], str], tok: int, lp: float) -> dict[str, Any]:
    text = _text(decode, tok)
    return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}


def choice_logprobs(entries: Sequence[Entry], decode: Callable[[list[int]], str],
                    chat: bool) -> dict[str, Any]:
    """The choice's (or chunk's) ``logprobs`` object of ``entries`` (module docstring)."""
    if chat:
        content = []
        for tl, _ in entries:
            item = _chat_item(decode, tl.token, tl.logprob)
            item["top_logprobs"] = [_chat_item(decode, t, lp) for t, lp in tl.top]
            content.append(item)
        return {"content": content, "refusal": None}
    tops: list[dict[str, float]] = []
    for tl, _ in entries:
        top: dict[str, float] = {}
        for t, lp in tl.top:
            top.setdefault(_text(decode, t), lp)
        tops.append(top)
    return {"tokens": [_text(decode, tl.token) for tl, _ in entries],
            "token_logprobs": [tl.logprob for tl, _ in entries],
            "top_logprobs": tops,
            "text_offset": [off for _, off in entries]}
