"""Structured output: grammars compiled by llguidance, one matcher per constrained request.

**Grammars.** A grammar travels with a request as a string in llguidance's own formats (its
JSON ``TopLevelGrammar`` or Lark text): :func:`json_object_grammar`,
:func:`json_schema_grammar` and :func:`tool_call_grammar` build the ones the OpenAI API asks
for, and :func:`check_grammar` refuses a bad one (a schema llguidance does not accept)
without a tokenizer, so a front can answer 400 before the request reaches an engine.

* ``response_format`` ``{"type": "json_object"}``: the schema ``{"type": "object"}``;
  ``json_schema``: its ``schema`` (``strict`` or not, it is enforced). JSON is compact
  (no whitespace between tokens): a sampled model cannot wander in whitespace.
* ``tool_choice`` ``"required"`` or a named function: exactly one call in the Hermes syntax
  every served model is asked for (:mod:`.tool_calls`: Qwen2.5's template, and the generic
  tools prompt of a template without a tools section): ``<tool_call>\\n{"name": ...,
  "arguments": {...}}\\n</tool_call>``, the name one of the tools (the named one), the
  arguments valid under that tool's ``parameters`` schema. Where the tokenizer has the
  tags as tokens of their own (Qwen2.5) the grammar names those tokens
  (:func:`tags_are_tokens`); elsewhere (SmolLM2) the tags are text.

**Matching.** The engine (in an engine core process: the core) compiles a request's grammar
into a :class:`Matcher` against the model's tokenizer (:class:`GrammarCompiler`, built once
per engine on the first constrained request: about 0.5 s for SmolLM2's 49k vocabulary, 2 s
for Qwen2.5's 152k). Before each draw of a constrained row the host fills the row's
allowed-token bitmask (int32, ``ceil(vocab / 32)`` words, token ``t`` allowed when bit
``t % 32`` of word ``t // 32`` is set; :class:`MaskBatch` fills a step's rows together on
llguidance's thread pool, while the device runs the step's forward pass:
:mod:`.scheduler`) and the device sets the other tokens' logits to ``-inf`` before sampling
(:func:`deviceops.kernels.mask_logits`). Each delivered token advances the matcher; once the
grammar is complete (only EOS could follow) the request ends with ``finish_reason``
``"stop"`` without drawing that EOS.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .tool_calls import CLOSE, OPEN

__all__ = ["GrammarCompiler", "MaskBatch", "Matcher", "check_grammar", "json_object_grammar",
           "json_schema_grammar", "tags_are_tokens", "tool_call_grammar"]

#: JSON as the grammars write it: no whitespace between tokens.
_COMPACT = {"whitespace_flexible": False}


def _llg() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # a declared dependency; a broken install says so
        raise ImportError("structured output needs llguidance (pip install llguidance)") from exc
    return llguidance


def json_schema_grammar(schema: Mapping[str, Any]) -> str:
    """The grammar of JSON values valid under ``schema`` (compact JSON)."""
    return str(_llg().LLMatcher.grammar_from_json_schema(dict(schema), defaults=_COMPACT))


def json_object_grammar() -> str:
    """The grammar of any JSON object (``response_format`` ``json_object``)."""
    return json_schema_grammar({"type": "object"})


def _call_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    fn = tool["function"]
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": fn["name"]},
                                             "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def tags_are_tokens(tokenizer: Any) -> bool:
    """Whether ``<tool_call>`` and ``</tool_call>`` are tokens of their own in ``tokenizer``
    (a ``tokenizers.Tokenizer``, or ``None``): Qwen2.5's added tokens, which a grammar must
    name as tokens (:func:`tool_call_grammar`'s ``tag_tokens``)."""
    find = getattr(tokenizer, "token_to_id", None)
    return find is not None and find(OPEN) is not None and find(CLOSE) is not None


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], name: str | None = None, *,
                      tag_tokens: bool = False) -> str:
    """The grammar of one Hermes-style call (module docstring) of one of ``tools`` (OpenAI's
    ``{"type": "function", "function": {"name", "parameters"}}``), or of the tool ``name``.

    ``tag_tokens``: the tags are the tokenizer's own tokens (:func:`tags_are_tokens`; the
    model writes them as one token each, which llguidance matches only as tokens), else
    text.

    Raises:
        ValueError: ``name`` is not one of the tools.
    """
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise ValueError(f"tool_choice names the function {name!r}, which is not in tools "
                         f"({[t['function']['name'] for t in tools]})")
    schemas = [_call_schema(t) for t in chosen]
    schema: dict[str, Any] = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = {**schema, "x-guidance": _COMPACT}  # (what grammar_from_json_schema's defaults set)
    tags = (OPEN, CLOSE) if tag_tokens else (json.dumps(OPEN), json.dumps(CLOSE))
    return (f'start: {tags[0]} "\\n" call "\\n" {tags[1]}\n'
            f"call: %json {json.dumps(schema)}\n")


def check_grammar(grammar: str) -> None:
    """Refuse a grammar llguidance would not compile (no tokenizer needed).

    Raises:
        ValueError: the grammar (a schema, a tool's parameters) is invalid; the message is
            llguidance's.
    """
    err = _llg().LLMatcher.validate_grammar(grammar, None)
    if err:
        raise ValueError(f"the grammar is not valid: {err}")


class Matcher:
    """One request's grammar state (an ``llguidance.LLMatcher``) on the host.

    Attributes:
        matcher: the llguidance matcher (its bitmask is filled by :class:`MaskBatch`).
    """

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def advance(self, token: int) -> str | None:
        """Consume the sampled ``token``; ``None`` while the grammar goes on, ``"stop"`` once
        it is complete (or the token ended it), ``"error"`` when the matcher failed (a
        parser limit reached: :attr:`error` says which) or the token was not allowed."""
        m = self.matcher
        if not m.consume_token(int(token)):
            return "error"
        return "stop" if m.is_stopped() else None

    @property
    def error(self) -> str:
        """Why the matcher failed (empty while it has not)."""
        return str(self.matcher.get_error())


class GrammarCompiler:
    """Compiles grammars against one model's tokenizer (module docstring).

    Args:
        tokenizer_json: the model's ``tokenizers.Tokenizer`` as JSON (``Tokenizer.to_str()``).
        vocab: the model's vocabulary (its logits' width; the bitmasks' bits).
        eos: the ids that end a reply (the model's stop ids).
    """

    def __init__(self, tokenizer_json: str, vocab: int, eos: Sequence[int]) -> None:
        llg = _llg()
        self.vocab = int(vocab)
        self.tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=self.vocab,
                                         eos_token=sorted(int(t) for t in eos))

    def matcher(self, grammar: str) -> Matcher:
        """A fresh :class:`Matcher` of ``grammar``.

        Raises:
            ValueError: llguidance refuses the grammar (its message).
        """
        m = _llg().LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"Engine: the grammar does not compile: {m.get_error()}")
        return Matcher(m)


class MaskBatch:
    """The allowed-token bitmasks of a step's constrained rows, filled together.

    Args:
        rows: the most rows of one step (the engine's ``max_batch``).
        vocab: the vocabulary size.
        threads: llguidance's pool (default: half the cores, at most 8, as vLLM sizes it).
    """

    def __init__(self, rows: int, vocab: int, threads: int | None = None) -> None:
        llg = _llg()
        self.words = -(-int(vocab) // 32)
        self.bitmask = np.full((max(int(rows), 1), self.words), -1, np.int32)
        n = threads or max(1, min(8, (os.cpu_count() or 2) // 2))
        self._executor = llg.LLExecutor(n)

    def fill(self, matchers: Sequence[Matcher]) -> np.ndarray:
        """The bitmasks of ``matchers``' next tokens, row ``i`` for ``matchers[i]`` (a view of
        the batch's buffer, valid until the next :meth:`fill`)."""
        n = len(matchers)
        if n > self.bitmask.shape[0]:
            self.bitmask = np.full((n, self.words), -1, np.int32)
        out = self.bitmask[:n]
        if n == 1:
            m = matchers[0].matcher
            m.unsafe_compute_mask_ptr(out.ctypes.data, out.shape[1] * 4)
        elif n:
            self._executor.unsafe_compute_mask_ptr(
                [(m.matcher, i) for i, m in enumerate(matchers)], out.ctypes.data,
                out.shape[1] * 4, n)
        return out
