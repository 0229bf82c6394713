"""Tool calls: the ``<tool_call>`` parser, tools rendered for a template without a tools
section (SmolLM2's), and ``tool_calls`` in chat responses, whole and streamed."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from deviceops.nn.serving.engine import Engine
from deviceops.nn.serving.http import create_app
from deviceops.nn.serving.tool_calls import ToolCallStream, parse
from deviceops.nn.tokenizer import GENERIC_TOOLS_PROMPT, ChatTemplate

from .test_engine import EOS, Toy
from .test_serve_http import ServerThread, sse_events

NAMES = ("get_weather", "add")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call>'


# -- the parser ------------------------------------------------------------------------------
def test_parse_reads_calls_and_leaves_everything_else_as_text() -> None:
    assert parse("just text", NAMES) == ("just text", [])
    content, calls = parse("Let me look." + CALL, NAMES)
    assert content == "Let me look."
    assert [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    content, calls = parse(CALL + "\n" + CALL2, NAMES)  # two calls, arguments as a string
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert len({c["id"] for c in calls}) == 2
    for text in ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not a tool
                 "<tool_call>{not json}</tool_call>",
                 '<tool_call>{"name": "add", "arguments": [1]}</tool_call>',
                 '<tool_call>{"name": "add", "arguments": "{not json"}</tool_call>',
                 "before <tool_call>" + CALL[11:-12]):  # never closed
        assert parse(text, NAMES) == (text, []), text


def test_the_stream_gives_what_parse_gives_at_any_split() -> None:
    text = "Sure. " + CALL + " and " + CALL2 + " done <tool_ca"
    want_content, want_calls = parse(text, NAMES)
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        s = ToolCallStream(NAMES)
        got_text, got_calls = "", []
        for p in pieces:
            t, c = s.push(p)
            got_text += t
            got_calls += c
            assert "<tool_call>" not in t  # no piece of a call leaks out as text
        tail, _ = s.finish()
        got_text += tail
        assert [c["function"] for c in got_calls] == [c["function"] for c in want_calls]
        assert got_text.strip() == want_content
        assert s.calls == 2


# -- rendering -------------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}}}}]
TURNS = [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "c1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "18C"}]


def test_a_template_without_tools_gets_them_in_the_system_message(
        smollm2_chat_template: str) -> None:
    t = ChatTemplate(smollm2_chat_template)
    assert not t.renders_tools and not t.renders_tool_calls
    text = t.render(TURNS, tools=TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(TOOLS[0]) in text and "<tool_call>" in text
    # the earlier call and its answer are in the prompt, not dropped
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>" in text
    # a user's system message comes first, the tools after it
    text = t.render([{"role": "system", "content": "Be brief."}, *TURNS[:1]], tools=TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert text != t.render([{"role": "system", "content": "Be brief."}, *TURNS[:1]])
    assert GENERIC_TOOLS_PROMPT.split("{tools}")[0] in text


def test_a_template_with_tools_renders_them_itself() -> None:
    src = (Path(__file__).parent / "fixtures" / "qwen2_5_chat_template.jinja").read_text()
    t = ChatTemplate(src)
    assert t.renders_tools and t.renders_tool_calls
    text = t.render(TURNS, tools=TOOLS)
    assert text.count("# Tools") == 1  # once: the template's own


# -- over HTTP -------------------------------------------------------------------------------
ALPHABET = sorted(set(CALL + CALL2 + "Let me check. Done"))


class Scripted(Toy):
    """A toy whose reply is a fixed text, one character a token, then EOS."""

    def __init__(self, reply: str) -> None:
        super().__init__(max_batch=4, max_seq=256)
        self.script = [1 + ALPHABET.index(c) for c in reply]

    def _sample(self, slot: int) -> int:
        c = self.counter[slot]
        self.counter[slot] = c + 1
        return self.script[c] if c < len(self.script) else EOS

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(ALPHABET[i - 1] for i in ids if 0 < i <= len(ALPHABET))

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> str:
        return "hi"


@pytest.fixture
def tool_server() -> Any:
    toy = Scripted("Let me check." + CALL)
    app = create_app(lambda: Engine(toy, max_batch=4, max_seq=256), model_name="toy")
    with ServerThread(app) as srv:
        srv.wait_healthy()
        yield srv


def _body(stream: bool, tools: bool = True) -> dict[str, Any]:
    b: dict[str, Any] = {"model": "toy", "messages": [{"role": "user", "content": "x"}],
                         "max_tokens": 200, "temperature": 0, "stream": stream}
    if tools:
        b["tools"] = TOOLS
    return b


def test_chat_returns_tool_calls(tool_server: Any) -> None:
    r = httpx.post(tool_server.url + "/v1/chat/completions", json=_body(False), timeout=30)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] == "Let me check."
    assert [c["function"] for c in msg["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    # without tools the same reply is plain text
    r = httpx.post(tool_server.url + "/v1/chat/completions", json=_body(False, tools=False),
                   timeout=30)
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "Let me check." + CALL
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]


def test_streamed_chat_sends_the_call_as_a_delta(tool_server: Any) -> None:
    with httpx.stream("POST", tool_server.url + "/v1/chat/completions", json=_body(True),
                      timeout=30) as r:
        ev = sse_events(r.iter_lines())
    assert ev[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in ev[:-1]]
    text = "".join(d.get("content") or "" for d in deltas)
    assert text == "Let me check."
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert ev[-2]["choices"][0]["finish_reason"] == "tool_calls"
