"""Tool calls in generated text: the Hermes convention, ``<tool_call>{json}</tool_call>``.

Qwen2.5's chat template asks for it, and a template without a tools section gets the same
instructions (:data:`deviceops.nn.tokenizer.GENERIC_TOOLS_PROMPT`), so one parser reads the
calls of every model we serve. A block holds ``{"name": ..., "arguments": {...}}``; it is a
call when it parses as JSON and names one of the request's tools, else it stays text (the
client sees what the model wrote). :func:`parse` reads a whole reply; :class:`ToolCallStream`
reads it piece by piece as tokens arrive, holding back text that may be the start of a
block, and gives each call once its block is closed (OpenAI streams a call's name and
arguments as deltas; one delta per call is a valid stream of them).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from typing import Any

__all__ = ["CLOSE", "OPEN", "ToolCallStream", "parse"]

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def _call(body: str, names: frozenset[str]) -> dict[str, Any] | None:
    """The OpenAI ``tool_calls`` entry of one block's text, or ``None`` if it is not a call
    of a known tool."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def parse(text: str, names: Iterable[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """The content and the tool calls of a whole reply.

    Returns:
        ``(content, calls)``: with calls, the text outside the blocks (stripped; ``None``
        when empty); without, ``text`` unchanged and ``[]``.
    """
    s = ToolCallStream(names)
    content, calls = s.push(text)
    tail, more = s.finish()
    calls += more
    content += tail
    if not calls:
        return text, []
    return (content.strip() or None), calls


class ToolCallStream:
    """Reads a reply piece by piece (module docstring).

    Args:
        names: the request's tool names.
    """

    def __init__(self, names: Iterable[str]) -> None:
        self.names = frozenset(names)
        self.calls = 0  # calls given so far
        self._buf = ""

    def push(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        """Take ``piece``; return the text that is surely not part of a call, and the calls
        whose blocks closed."""
        self._buf += piece
        text: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            i = self._buf.find(OPEN)
            if i < 0:  # no block: keep back a suffix that may begin one
                keep = _partial(self._buf, OPEN)
                text.append(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            j = self._buf.find(CLOSE, i + len(OPEN))
            if j < 0:  # a block under way: its text so far waits
                text.append(self._buf[:i])
                self._buf = self._buf[i:]
                break
            call = _call(self._buf[i + len(OPEN):j].strip(), self.names)
            end = j + len(CLOSE)
            if call is None:  # not a call of ours: the model's text, as written
                text.append(self._buf[:end])
            else:
                text.append(self._buf[:i])
                calls.append(call)
            self._buf = self._buf[end:]
        self.calls += len(calls)
        return "".join(text), calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The end of the reply: what was held back (an unclosed block is text)."""
        rest, self._buf = self._buf, ""
        return rest, []


def _partial(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
