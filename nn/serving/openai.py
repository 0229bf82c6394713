"""The OpenAI side of the HTTP API: request parsing and validation, response and event
bodies, errors in OpenAI's JSON shape.

:func:`parse_request` turns a ``/v1/completions`` or ``/v1/chat/completions`` body into a
:class:`Job` or raises :class:`BadRequest` naming the offending field (400,
``{"error": {"message", "type": "invalid_request_error", "param", "code"}}``, built by
:func:`error_response`). :func:`completion_body` and :func:`stream_chunk` are the
responses of :mod:`.http`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

from .engine import Engine, EngineFailed, RequestStream
from .grammar import (
    check_grammar,
    json_object_grammar,
    json_schema_grammar,
    tags_are_tokens,
    tool_call_grammar,
)
from .guard import openai_error_body
from .router import Replica

__all__ = ["MAX_N", "BadRequest", "Job", "Limits", "choice_body", "choice_seed",
           "completion_body", "device_failed_message", "error_response", "finish_reason",
           "parse_request", "PieceChunks", "sse_event", "stream_chunk", "usage"]

#: The most choices (``n``) one request may ask for.
MAX_N = 16

_ROLES = ("system", "developer", "user", "assistant", "tool")

#: Fields accepted with an effect, or (``user``, ``parallel_tool_calls``, ``store``,
#: ``metadata``) without one by their meaning; every other field is refused with a 400
#: naming it.
_KNOWN = frozenset({
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream",
    "stream_options", "temperature", "top_p", "top_k", "seed", "stop", "n", "ignore_eos",
    "user", "tools", "tool_choice", "parallel_tool_calls", "logprobs", "top_logprobs",
    "logit_bias", "presence_penalty", "frequency_penalty", "store", "metadata",
    # checked below: refused unless they ask for nothing
    "best_of", "suffix", "echo",
    # checked below: turned into a grammar (:mod:`.grammar`)
    "response_format",
})


class BadRequest(Exception):
    """A request the server refuses (400 unless ``status`` says), naming the offending field
    (``param``); ``code`` is OpenAI's error code where it has one."""

    def __init__(self, param: str | None, message: str, *, status: int = 400,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.message = message
        self.status = status
        self.code = code


@dataclass(frozen=True)
class Limits:
    """What a request may hold, checked before anything is tokenised (``serve`` flags
    ``--max-messages``, ``--max-prompt-chars``)."""

    max_messages: int = 4096
    max_prompt_chars: int = 1_000_000


def error_response(status: int, message: str, param: str | None = None, *,
           kind: str = "invalid_request_error", retry_after: int | None = None,
           code: str | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(openai_error_body(message, kind, code, param), status_code=status,
                        headers=headers)


def device_failed_message(replica: Replica, exc: EngineFailed, serving: int) -> str:
    cause = exc.__cause__
    what = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)
    kind = getattr(replica, "kind", "device")  # "replica" for Ray replicas (serve --ray)
    return (f"{kind} {replica.device} failed while handling this request ({what}); it was "
            f"taken out of service and the request was not completed. Retry it: "
            f"{serving} other {kind}(s) are serving")


@dataclass
class Job:
    """A validated completion request."""

    ids: list[int]
    max_tokens: int
    stream: bool
    temperature: float
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: list[str]
    ignore_eos: bool = False
    include_usage: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # top log-probabilities per token (0: the token's only)
    echo: str | None = None  # completions ``echo``: the prompt's text, sent before the completion
    #: chat with ``tools``: their names; the reply's ``<tool_call>`` blocks naming one of them
    #: become ``tool_calls`` (:mod:`.tool_calls`)
    tool_names: tuple[str, ...] = ()
    #: choices to generate, each its own request (seed ``seed + i``: :func:`choice_seed`)
    n: int = 1
    #: the grammar the reply follows (``response_format``, ``tool_choice`` required or named)
    grammar: str | None = None

    def features(self) -> dict[str, Any]:
        """The engine arguments of the optional features this job asks for (only those, so
        an engine without them is never handed one)."""
        out: dict[str, Any] = {}
        if self.presence_penalty:
            out["presence_penalty"] = self.presence_penalty
        if self.frequency_penalty:
            out["frequency_penalty"] = self.frequency_penalty
        if self.logit_bias:
            out["logit_bias"] = self.logit_bias
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        if self.grammar is not None:
            out["grammar"] = self.grammar
        return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _text_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for p in content:
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                raise BadRequest(where, "only text content parts are supported")
            parts.append(p["text"])
        return "".join(parts)
    raise BadRequest(where, "content must be a string or a list of text parts")


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list) or not calls:
        raise BadRequest(where, "tool_calls must be a non-empty list")
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments", ""), str)):
            raise BadRequest(f"{where}[{j}]", 'each tool call must be {"id": ..., "type": '
                             '"function", "function": {"name": str, "arguments": str}}')
    return [dict(c) for c in calls]


def _message(m: Any, i: int) -> dict[str, Any]:
    """One chat message, checked; ``developer`` is rendered as ``system``."""
    if not isinstance(m, dict):
        raise BadRequest(f"messages[{i}]", "each message must be an object")
    role = m.get("role")
    if role not in _ROLES:
        raise BadRequest(f"messages[{i}].role", f"role must be one of {list(_ROLES)}")
    content = m.get("content")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    if role == "assistant" and m.get("tool_calls") is not None:
        out["tool_calls"] = _tool_calls(m["tool_calls"], i)
        if content is None:
            content = ""
    elif content is None:
        raise BadRequest(f"messages[{i}].content", "content is required (it may be null only "
                         "in an assistant message with tool_calls)")
    out["content"] = _text_content(content, f"messages[{i}].content")
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise BadRequest(f"messages[{i}].tool_call_id", "a tool message needs the "
                             "tool_call_id it answers")
        out["tool_call_id"] = m["tool_call_id"]
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


def _tool_choice(body: dict[str, Any]) -> tuple[str, str | None]:
    """``tool_choice`` as ``(kind, name)``: kind ``"auto"`` (also when absent), ``"none"``,
    ``"required"`` or ``"function"`` (``name``: the named function)."""
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none", "required"):
        return (choice or "auto"), None
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(fn, dict) and isinstance(fn.get("name"), str)):
        raise BadRequest("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                         '{"type": "function", "function": {"name": str}}')
    return "function", fn["name"]


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The tools the template renders (``None``: none, or ``tool_choice`` ``none``)."""
    tools = body.get("tools")
    choice, _ = _tool_choice(body)
    if tools is None:
        if choice in ("required", "function"):
            raise BadRequest("tool_choice", f"tool_choice {body['tool_choice']!r} needs 'tools' "
                             "(the functions the reply may call)")
        return None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function"
            and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise BadRequest("tools", 'tools must be a list of {"type": "function", "function": '
                         '{"name": str, "description": str, "parameters": object}}')
    if not tools and choice in ("required", "function"):
        raise BadRequest("tool_choice", "tool_choice 'required' or a named function needs a "
                         "non-empty 'tools'")
    return None if choice == "none" or not tools else tools


def _response_format(fmt: Any) -> str | None:
    """The grammar of ``response_format`` (``None``: plain text)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_grammar()
    if kind != "json_schema":
        raise BadRequest("response_format", "'response_format' must be {\"type\": \"text\"}, "
                         "{\"type\": \"json_object\"} or {\"type\": \"json_schema\", "
                         "\"json_schema\": {\"name\": str, \"schema\": object, \"strict\": bool}}")
    js = fmt.get("json_schema")
    schema = js.get("schema", {}) if isinstance(js, dict) else None
    if not isinstance(schema, dict) or not isinstance(js.get("name", ""), str) or not (
            isinstance(js.get("strict", False), bool) or js.get("strict") is None):
        raise BadRequest("response_format", "'response_format.json_schema' must be an object "
                         "{\"name\": str, \"schema\": object, \"strict\": bool}")
    try:
        return json_schema_grammar(schema)
    except (ValueError, TypeError) as exc:
        raise BadRequest("response_format", f"'response_format.json_schema.schema' is not a "
                         f"valid JSON schema: {exc}") from exc


def _grammar(body: dict[str, Any], chat: bool, tools: list[dict[str, Any]] | None,
             engine: Engine) -> str | None:
    """The grammar the reply must follow (:mod:`.grammar`): ``response_format`` ``json_object``
    / ``json_schema``, or (chat) one tool call for ``tool_choice`` ``required`` / a named
    function; ``None`` for free text (``tool_choice`` ``auto`` stays unconstrained). Refused
    (400) when malformed, invalid (a schema llguidance does not accept), both at once, or
    asked of an engine without grammars (``unsupported_parameter``)."""
    grammar, param = _response_format(body.get("response_format")), "response_format"
    kind, name = _tool_choice(body) if chat else ("auto", None)
    if kind in ("required", "function") and tools:
        if grammar is not None:
            raise BadRequest("response_format", "'response_format' and tool_choice "
                             f"{body['tool_choice']!r} ask for two different replies; send one")
        try:
            tok = getattr(engine.model, "tokenizer", None)
            grammar = tool_call_grammar(tools, name, tag_tokens=tags_are_tokens(tok))
            param = "tool_choice"
        except ValueError as exc:
            raise BadRequest("tool_choice", str(exc)) from exc
    if grammar is None:
        return None
    if "grammar" not in frozenset(getattr(engine, "sampling_features", ())):
        raise BadRequest(param, f"'{param}' needs grammar-constrained decoding, which this "
                         "server's model engine does not do; leave it out (the request was not "
                         "run)", code="unsupported_parameter")
    try:
        check_grammar(grammar)
    except ValueError as exc:
        where = "tools" if param == "tool_choice" else param
        raise BadRequest(where, f"'{where}': {exc}") from exc
    return grammar


def _prompt_ids(body: dict[str, Any], chat: bool, model: Any, limits: Limits) -> list[int]:
    """Token ids of the prompt; text a client sends is tokenised with special tokens read as
    plain text (only the chat template emits control tokens; a completions prompt that needs
    them is sent as token ids)."""
    if chat:
        msgs = body.get("messages")
        if msgs is None:
            raise BadRequest("messages", "'messages' is required")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("messages", "'messages' must be a non-empty list of messages")
        if len(msgs) > limits.max_messages:
            raise BadRequest("messages", f"{len(msgs)} messages; this server accepts at most "
                             f"{limits.max_messages} (serve --max-messages)")
        clean = [_message(m, i) for i, m in enumerate(msgs)]
        chars = sum(len(m["content"]) for m in clean)
        if chars > limits.max_prompt_chars:
            raise BadRequest("messages", f"{chars} characters of content; this server accepts "
                             f"at most {limits.max_prompt_chars} (serve --max-prompt-chars)")
        tools = _tools(body)
        extra = {} if tools is None else {"tools": tools}
        try:
            if hasattr(model, "encode_chat"):
                return list(model.encode_chat(clean, **extra))
            return list(model.encode(model.apply_chat_template(clean)))
        except ValueError as exc:  # no template, or the template refused the conversation
            raise BadRequest("messages", str(exc)) from exc
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest("prompt", "'prompt' is required")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt", "'prompt' is empty")
        if len(prompt) > limits.max_prompt_chars:
            raise BadRequest("prompt", f"{len(prompt)} characters; this server accepts at most "
                             f"{limits.max_prompt_chars} (serve --max-prompt-chars)")
        encode = getattr(model, "encode_untrusted", model.encode)
        return list(encode(prompt))
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return [int(t) for t in prompt]
    raise BadRequest("prompt", "'prompt' must be a non-empty string or list of token ids "
                               "(one prompt per request)")


def _refuse_unsupported(body: dict[str, Any], chat: bool) -> None:
    """400 for every field this server would otherwise have to ignore."""
    unknown = sorted(k for k in body if k not in _KNOWN)
    if unknown:
        raise BadRequest(unknown[0], f"unrecognized request argument(s): {', '.join(unknown)}")
    if body.get("echo") is not None and not isinstance(body["echo"], bool):
        raise BadRequest("echo", "'echo' must be a boolean")
    for key in ("presence_penalty", "frequency_penalty"):
        v = body.get(key)
        if v is not None and (not _is_num(v) or not -2.0 <= float(v) <= 2.0):
            raise BadRequest(key, f"'{key}' must be a number in [-2, 2], got {v!r}")
    echo = body.get("echo") not in (None, False)
    if echo and chat:
        raise BadRequest("echo", "'echo' is a /v1/completions parameter; chat completions "
                         "have no echo (the request was not run)",
                         code="unsupported_parameter")
    if echo and body.get("logprobs") is not None:
        # the prompt's own log-probabilities need a prefill read-back this server does not do
        raise BadRequest("echo", "'echo' together with 'logprobs' is not supported: it would "
                         "need the prompt's own log-probabilities; send 'echo' without "
                         "'logprobs', or 'logprobs' without 'echo' (the request was not run)",
                         code="unsupported_parameter")
    best_of = body.get("best_of")
    asked = {
        "best_of": best_of is not None and not (_is_int(best_of) and best_of == 1),
        "suffix": body.get("suffix") not in (None, ""),
    }
    for key, bad in asked.items():
        if bad:
            raise BadRequest(key, f"'{key}' is not supported by this server yet; leave it "
                             "out (the request was not run)", code="unsupported_parameter")


#: OpenAI's bounds on ``metadata``: keys, key length, value length.
METADATA_MAX_KEYS, METADATA_MAX_KEY_CHARS, METADATA_MAX_VALUE_CHARS = 16, 64, 512


def _store_and_metadata(body: dict[str, Any]) -> None:
    """``store`` (a boolean) and ``metadata`` (up to 16 string keys of at most 64 characters
    mapping to strings of at most 512), checked as OpenAI checks them and then unused: this
    server keeps no completions."""
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise BadRequest("store", f"'store' must be a boolean, got {store!r}")
    meta = body.get("metadata")
    if meta is None:
        return
    if not isinstance(meta, dict):
        raise BadRequest("metadata", "'metadata' must be an object of up to "
                         f"{METADATA_MAX_KEYS} string keys mapping to string values")
    if len(meta) > METADATA_MAX_KEYS:
        raise BadRequest("metadata", f"'metadata' has {len(meta)} keys; at most "
                         f"{METADATA_MAX_KEYS} are allowed")
    for k, v in meta.items():
        if len(k) > METADATA_MAX_KEY_CHARS:
            raise BadRequest("metadata", f"'metadata' key {k[:16]!r}... is {len(k)} characters "
                             f"long; keys are at most {METADATA_MAX_KEY_CHARS}")
        if not isinstance(v, str):
            raise BadRequest("metadata", f"'metadata' value of key {k!r} must be a string, got "
                             f"{type(v).__name__}")
        if len(v) > METADATA_MAX_VALUE_CHARS:
            raise BadRequest("metadata", f"'metadata' value of key {k!r} is {len(v)} characters "
                             f"long; values are at most {METADATA_MAX_VALUE_CHARS}")


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """The top log-probabilities asked for per token (``None``: no ``logprobs``)."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if not chat:
        if top is not None:
            raise BadRequest("top_logprobs", "'top_logprobs' is a chat parameter; completions "
                             "take 'logprobs': N (0 .. 20)")
        if lp is not None and (not _is_int(lp) or not 0 <= lp <= 20):
            raise BadRequest("logprobs", f"'logprobs' must be an integer in [0, 20], got {lp!r}")
        return lp
    if lp is not None and not isinstance(lp, bool):
        raise BadRequest("logprobs", f"'logprobs' must be a boolean, got {lp!r}")
    if top is not None:
        if not _is_int(top) or not 0 <= top <= 20:
            raise BadRequest("top_logprobs", f"'top_logprobs' must be an integer in [0, 20], "
                             f"got {top!r}")
        if not lp:
            raise BadRequest("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    return (top or 0) if lp else None


def _logit_bias(body: dict[str, Any], vocab: int) -> dict[int, float] | None:
    """``logit_bias`` as ``{token id: bias}`` (JSON keys are strings of ids)."""
    raw = body.get("logit_bias")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise BadRequest("logit_bias", "'logit_bias' must be an object mapping token ids to "
                         "biases in [-100, 100]")
    out: dict[int, float] = {}
    for k, v in raw.items():
        try:
            t = int(k)
        except ValueError:
            t = -1
        if not 0 <= t < vocab or str(t) != str(k).strip():
            raise BadRequest("logit_bias", f"'logit_bias' key {k!r} is not a token id in "
                             f"[0, {vocab})")
        if not _is_num(v) or not -100.0 <= float(v) <= 100.0:
            raise BadRequest("logit_bias", f"'logit_bias' value {v!r} for token {t} must be a "
                             "number in [-100, 100]")
        out[t] = float(v)
    return out or None


def _features(body: dict[str, Any], chat: bool, engine: Engine) -> dict[str, Any]:
    """Penalties, ``logit_bias`` and ``logprobs``, checked, refused with
    ``unsupported_parameter`` when asked of an engine whose model does not honour them."""
    vocab = engine.steps.vocab_size
    got = {"presence_penalty": float(body.get("presence_penalty") or 0.0),
           "frequency_penalty": float(body.get("frequency_penalty") or 0.0),
           "logit_bias": _logit_bias(body, vocab), "logprobs": _logprobs(body, chat)}
    have: frozenset[str] = frozenset(getattr(engine, "sampling_features", ()))
    for key, v in got.items():
        if (v is not None if key == "logprobs" else bool(v)) and key not in have:
            param = "top_logprobs" if key == "logprobs" and "logprobs" not in body else key
            raise BadRequest(param, f"'{key}' is not supported by this server's model engine; "
                             "leave it out (the request was not run)",
                             code="unsupported_parameter")
    return got


def parse_request(body: Any, chat: bool, model_name: str, engine: Engine,
                  limits: Limits | None = None) -> Job:
    """The :class:`Job` of a request body, or :class:`BadRequest` naming the field.

    Tokenises the prompt: call it off the event loop (:mod:`.http` runs it in a worker
    thread).
    """
    if not isinstance(body, dict):
        raise BadRequest(None, "the request body must be a JSON object")
    name = body.get("model")
    if name is not None and name != model_name:
        raise BadRequest("model", f"The model {name!r} does not exist; this server serves "
                         f"{model_name!r} (GET /v1/models)", status=404, code="model_not_found")
    _refuse_unsupported(body, chat)
    _store_and_metadata(body)
    n = body.get("n")
    if n is not None and (not _is_int(n) or n < 1):
        raise BadRequest("n", f"'n' must be an integer >= 1, got {n!r}")
    if n is not None and n > MAX_N:
        raise BadRequest("n", f"'n'={n}: this server generates at most {MAX_N} choices per "
                         f"request; ask for n <= {MAX_N} (the request was not run)",
                         code="integer_above_max_value")
    queue = getattr(engine, "max_queue", None)
    if n is not None and n > 1 and isinstance(queue, int) and n > queue:
        raise BadRequest("n", f"'n'={n}: the engine queues at most {queue} requests at once and "
                         f"each choice is one; ask for n <= {queue} (serve --max-queue)",
                         code="integer_above_max_value")
    ptc = body.get("parallel_tool_calls")
    if ptc is not None and not isinstance(ptc, bool):
        raise BadRequest("parallel_tool_calls", "'parallel_tool_calls' must be a boolean")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest("user", "'user' must be a string")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream", "'stream' must be a boolean")
    temperature = body.get("temperature", 1.0)
    if temperature is None:
        temperature = 1.0
    if not _is_num(temperature) or not 0.0 <= float(temperature) <= 2.0:
        raise BadRequest("temperature", f"'temperature' must be a number in [0, 2], got "
                                        f"{temperature!r}")
    top_p = body.get("top_p")
    if top_p is not None and (not _is_num(top_p) or not 0.0 < float(top_p) <= 1.0):
        raise BadRequest("top_p", f"'top_p' must be a number in (0, 1], got {top_p!r}")
    top_k = body.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k < 0):
        raise BadRequest("top_k", f"'top_k' must be an integer >= 0, got {top_k!r}")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**63):
        raise BadRequest("seed", f"'seed' must be an integer in [0, 2**63), got {seed!r}")
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop] if stop else []
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop):
        stops = list(stop)
    else:
        raise BadRequest("stop", "'stop' must be a string or a list of up to 4 non-empty strings")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest("ignore_eos", "'ignore_eos' must be a boolean")
    opts = body.get("stream_options")
    if opts is not None and not (isinstance(opts, dict)
                                 and isinstance(opts.get("include_usage", False), bool)):
        raise BadRequest("stream_options", "'stream_options' must be an object like "
                                           '{"include_usage": true}')
    include_usage = bool(opts and opts.get("include_usage"))
    ids = _prompt_ids(body, chat, engine.model, limits or Limits())
    what = "messages" if chat else "prompt"
    vocab = engine.steps.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise BadRequest(what, f"token ids must be in [0, {vocab})")
    if not ids:
        raise BadRequest(what, f"'{what}' encodes to no tokens")
    room = engine.max_seq - len(ids)
    if room < 1:
        raise BadRequest(what, f"the prompt has {len(ids)} tokens; the context is "
                               f"{engine.max_seq} tokens (shorten it)")
    key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    max_tokens = body.get(key)
    if max_tokens is None:
        max_tokens = min(room, 512 if chat else 16)
    if not _is_int(max_tokens) or max_tokens < 1:
        raise BadRequest(key, f"'{key}' must be an integer >= 1, got {max_tokens!r}")
    if max_tokens > room:
        raise BadRequest(key, f"'{key}'={max_tokens} plus the prompt's {len(ids)} tokens exceeds "
                              f"the context of {engine.max_seq} tokens (at most {room})")
    feats = _features(body, chat, engine)
    echo = None
    if not chat and body.get("echo"):
        p = body["prompt"]
        p = p[0] if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)) else p
        echo = p if isinstance(p, str) else engine.model.decode(ids)
    tools = _tools(body) if chat else None
    names = tuple(t["function"]["name"] for t in tools) if tools else ()
    grammar = _grammar(body, chat, tools, engine)
    return Job(ids, int(max_tokens), stream, float(temperature),
               None if top_p is None else float(top_p), top_k, seed, stops, ignore_eos,
               include_usage, echo=echo, tool_names=names, n=1 if n is None else int(n),
               grammar=grammar, **feats)


def choice_seed(seed: int | None, i: int) -> int | None:
    """The seed of choice ``i``: ``seed + i`` (modulo 2**63) when the request gave one, else
    ``None`` (a fresh random seed per choice)."""
    return None if seed is None else (seed + i) % 2**63


def finish_reason(s: RequestStream, stopped: bool) -> str:
    """The OpenAI ``finish_reason``: ``"stop"`` at a stop string, else the stream's."""
    if stopped:
        return "stop"
    return s.finish_reason or "cancelled"


def usage(streams: Sequence[RequestStream], job: Job) -> dict[str, int]:
    """The ``usage`` object: the prompt's tokens (once), every choice's completion tokens
    summed, and their total."""
    n = sum(len(s.tokens) for s in streams)
    return {"prompt_tokens": len(job.ids), "completion_tokens": n,
            "total_tokens": len(job.ids) + n}



def sse_event(payload: Any) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def choice_body(index: int, chat: bool, text: str | None, reason: str,
                logprobs: dict[str, Any] | None = None,
                tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One choice of a whole (non-streamed) response (``logprobs``: the choice's object,
    :mod:`.logprobs`; ``tool_calls``: the chat message's calls, :mod:`.tool_calls`)."""
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"index": index, "message": message, "logprobs": logprobs,
                "finish_reason": reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


def completion_body(rid: str, chat: bool, model_name: str, choices: list[dict[str, Any]],
                    use: dict[str, int]) -> dict[str, Any]:
    """A whole (non-streamed) ``text_completion`` / ``chat.completion`` response with its
    choices (:func:`choice_body`, index 0 .. n-1)."""
    obj = "chat.completion" if chat else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
            "choices": choices, "usage": use}


class PieceChunks:
    """:func:`stream_chunk`'s bytes for a plain text piece (no finish reason, log-probabilities
    or tool calls) of one streamed choice, from a template rendered once: the chunk's JSON
    around the piece is the same for every token of a response, so only the piece is
    encoded per token (the bytes are exactly :func:`stream_chunk`'s)."""

    _MARK = "\x00piece\x00"

    def __init__(self, rid: str, chat: bool, model_name: str, created: int, index: int = 0) -> None:
        whole = stream_chunk(rid, chat, model_name, created, self._MARK, None, index=index)
        mark = json.dumps(self._MARK).encode()
        self._head, self._tail = whole.rsplit(mark, 1)  # the piece comes after id and model

    def __call__(self, piece: str) -> bytes:
        return self._head + json.dumps(piece).encode() + self._tail


def stream_chunk(rid: str, chat: bool, model_name: str, created: int, piece: str | None,
                 reason: str | None, first: bool = False,
                 logprobs: dict[str, Any] | None = None,
                 tool_calls: list[dict[str, Any]] | None = None, index: int = 0) -> bytes:
    """One streamed chunk (``chat.completion.chunk`` / ``text_completion``) of choice
    ``index`` as an SSE event; ``first``: the chat stream's opening delta with the assistant
    role; ``logprobs``: the chunk's tokens' object (:mod:`.logprobs`); ``tool_calls``: the
    delta's calls, each with its ``index`` in the reply (:mod:`.tool_calls`)."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    if chat:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if piece:
            delta["content"] = piece
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs,
                                  "finish_reason": reason}
    else:
        choice = {"index": index, "text": piece or "", "logprobs": logprobs,
                  "finish_reason": reason}
    return sse_event({"id": rid, "object": obj, "created": created, "model": model_name,
                      "choices": [choice]})
