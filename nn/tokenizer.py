"""Tokenizers (the ``tokenizers`` library) and chat templates (jinja2) of a checkpoint.

:func:`tokenizer_from_gguf` builds a byte-level BPE :class:`tokenizers.Tokenizer` from a
GGUF file's ``tokenizer.ggml.*`` metadata (vocabulary, merges, token types, the
pre-tokenizer name): control tokens become special added tokens, matched whole in the
text (``<|im_start|>``) and kept by ``decode``. No hand-written BPE: the ``tokenizers``
library does the merging. Pre-tokenizers: ``smollm`` (digits one by one, then GPT-2's
byte-level split, as SmolLM2's own ``tokenizer.json``), ``gpt2`` / ``default``,
``llama-bpe`` (Llama 3's split) and ``qwen2`` (Llama 3's split with digits one at a time,
after NFC normalisation, as Qwen2's ``tokenizer.json``). A Gemma SentencePiece vocabulary
(:func:`sentencepiece_from_gguf`) is built once and then kept on disk beside the converted
weights (``DEVICEOPS_WEIGHT_CACHE``'s folder, ``tokenizers/``): its merges take seconds to
derive, loading the saved tokenizer does not.

:class:`ChatTemplate` renders a Hugging Face chat template with jinja2 the way
``transformers`` does (sandboxed, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``,
``tojson``), with ``add_generation_prompt=True`` by default.

:class:`TextCodec` is the text side of a checkpoint (``encode``, ``decode``,
``apply_chat_template`` over its tokenizer, config and template), shared by
:class:`~deviceops.nn.CausalLM` and the serving front's tokenizer-only model of a Ray
replica.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from . import weight_cache

__all__ = ["GENERIC_TOOLS_PROMPT", "SENTENCEPIECE_BUILDER_VERSION", "ChatTemplate", "TextCodec",
           "sentencepiece_cache_file", "sentencepiece_from_gguf", "sentencepiece_merges",
           "tokenizer_from_file", "tokenizer_from_gguf"]

log = logging.getLogger("deviceops.nn")

_CONTROL, _USER_DEFINED = 3, 4
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
                 r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
#: Qwen2's split: Llama 3's, but numbers are split into single digits.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def tokenizer_from_gguf(meta: Mapping[str, Any], *, progress: bool | None = None) -> Any:
    """A ``tokenizers.Tokenizer`` from GGUF ``tokenizer.*`` metadata.

    Args:
        meta: the metadata (``tokenizer.ggml.model``, ``.tokens``, ``.merges``,
            ``.token_type``, ``.pre``; for a SentencePiece vocabulary ``general.architecture``
            too, see :func:`sentencepiece_from_gguf`).
        progress: for a SentencePiece vocabulary, show the build (or the load of the cached
            build) as a named tqdm bar on stderr; ``None``: for vocabularies of 32k tokens
            or more.

    Raises:
        ValueError: a tokenizer model other than byte-level BPE (``gpt2``) or a Gemma
            SentencePiece vocabulary (``llama`` in a ``gemma*`` file), or missing data.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
    )

    kind = str(meta.get("tokenizer.ggml.model", ""))
    if kind == "llama":
        return sentencepiece_from_gguf(meta, progress=progress)
    if kind != "gpt2":
        raise ValueError(f"tokenizer: GGUF tokenizer model {kind!r} is not supported: deviceops.nn "
                         "builds byte-level BPE ('gpt2') and Gemma SentencePiece ('llama') "
                         "tokenizers from GGUF metadata; for other models use load_safetensors "
                         "with the model's tokenizer.json")
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise ValueError("tokenizer: the GGUF metadata lacks tokenizer.ggml.tokens or .merges")
    vocab = {str(t): i for i, t in enumerate(tokens)}
    pairs: list[tuple[str, str]] = []
    for m in merges:
        a, _, b = str(m).partition(" ")
        pairs.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("llama-bpe", "llama3", "qwen2"):
        split = _QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        if pre == "qwen2":
            tok.normalizer = normalizers.NFC()
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or []
    specials = [AddedToken(str(tokens[i]), special=True, normalized=False)
                for i, t in enumerate(types) if int(t) == _CONTROL]
    user = [AddedToken(str(tokens[i]), special=False, normalized=False)
            for i, t in enumerate(types) if int(t) == _USER_DEFINED]
    if specials:
        tok.add_special_tokens(specials)
    if user:
        tok.add_tokens(user)
    return tok


def sentencepiece_merges(tokens: Sequence[str], *,
                         progress: Callable[[int], object] | None = None) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary whose merge order is its token
    order (Gemma's: earlier tokens merge first; the file's scores do not follow that order).

    Every split of a token into two tokens of the vocabulary is a merge, ranked by the
    merged token's position, then by the longer left piece (the order transformers'
    ``generate_merges`` gives, so the ids equal its Gemma GGUF tokenizer's). Built in that
    order, so no sort is needed. ``progress(n)`` is called after each chunk of ``n`` tokens
    (a progress bar).
    """
    vocab = set(tokens)
    merges: list[tuple[str, str]] = []
    add = merges.append
    unique = list(dict.fromkeys(tokens))
    step = 16384
    for start in range(0, len(unique), step):
        chunk = unique[start:start + step]
        for merged in chunk:
            for cut in range(len(merged) - 1, 0, -1):
                left = merged[:cut]
                if left in vocab:
                    right = merged[cut:]
                    if right in vocab:
                        add((left, right))
        if progress is not None:
            progress(len(chunk))
    return merges


#: the version of :func:`sentencepiece_from_gguf`'s builder: bump it with any change to what
#: it builds (merges, normalizer, added tokens ...), so tokenizers cached by an older builder
#: are rebuilt
SENTENCEPIECE_BUILDER_VERSION = 1
#: vocabularies of at least this many tokens show their build as a progress bar by default
_BIG_VOCAB = 32768


def _sentencepiece_tokens(meta: Mapping[str, Any]) -> tuple[str, list[Any]]:
    """(architecture, raw tokens) of a Gemma SentencePiece vocabulary, checked."""
    arch = str(meta.get("general.architecture", ""))
    if not arch.startswith("gemma"):
        raise ValueError(f"tokenizer: a SentencePiece ('llama') GGUF vocabulary is supported for "
                         f"Gemma files only, not general.architecture {arch!r}; load the model "
                         "with load_safetensors and its tokenizer.json")
    raw = meta.get("tokenizer.ggml.tokens")
    if not raw:
        raise ValueError("tokenizer: the GGUF metadata lacks tokenizer.ggml.tokens")
    return arch, list(raw)


def sentencepiece_cache_file(meta: Mapping[str, Any]) -> Path | None:
    """Where :func:`sentencepiece_from_gguf` keeps the tokenizer it builds from ``meta``:
    ``<weight cache>/tokenizers/<architecture>-<vocabulary hash>-b<builder version>-t<tokenizers
    version>.json`` (``None``: ``DEVICEOPS_WEIGHT_CACHE`` is off). The vocabulary hash
    covers everything the builder reads (tokens, token types, unknown-token id), so a file
    of the same name holds the same tokenizer; another builder or ``tokenizers`` version
    names another file.

    Raises:
        ValueError: as :func:`sentencepiece_from_gguf` (not a Gemma vocabulary).
    """
    root = weight_cache.cache_root()
    arch, raw = _sentencepiece_tokens(meta)
    if root is None:
        return None
    import tokenizers

    h = hashlib.sha256()
    h.update(f"{arch}|{meta.get('tokenizer.ggml.unknown_token_id', 3)}|{len(raw)}|".encode())
    h.update("\x00".join(map(str, raw)).encode("utf-8", "surrogatepass"))
    h.update(b"|types|")
    h.update(",".join(str(int(t)) for t in (meta.get("tokenizer.ggml.token_type") or [])).encode())
    name = re.sub(r"[^A-Za-z0-9._]", "_", arch)[:40]
    lib = re.sub(r"[^A-Za-z0-9.]", "_", tokenizers.__version__)
    return (root / "tokenizers"
            / f"{name}-{h.hexdigest()[:24]}-b{SENTENCEPIECE_BUILDER_VERSION}-t{lib}.json")


def _bar(total: int | None, desc: str, show: bool) -> Any:
    """A tqdm bar on stderr named ``desc`` (``total`` ``None``: one blocking step, shown as
    its name only), cleared when done."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="token", disable=not show, leave=False,
                bar_format=None if total is not None else "{desc} ...")


def _load_cached(path: Path, raw: Sequence[Any], unk_id: int, show: bool) -> Any:
    """The tokenizer saved at ``path``, or ``None`` (no file; a damaged one is logged and
    removed)."""
    from tokenizers import Tokenizer

    if not path.is_file():
        return None
    try:
        with _bar(None, "loading the tokenizer (cached)", show):
            tok = Tokenizer.from_file(str(path))
        n = tok.get_vocab_size(with_added_tokens=False)
        if n != len(raw) or tok.id_to_token(unk_id) != str(raw[unk_id]):
            raise ValueError(f"it holds {n} tokens and unknown token "
                             f"{tok.id_to_token(unk_id)!r}, the file's vocabulary {len(raw)} and "
                             f"{str(raw[unk_id])!r}")
    except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot read
        log.warning("deviceops: the cached tokenizer %s is damaged (%s); building it again",
                    path, exc)
        path.unlink(missing_ok=True)
        return None
    return tok


def _store_cached(path: Path, tok: Any) -> None:
    """Save ``tok`` at ``path`` atomically (a temporary file beside it, then renamed, so
    concurrent writers and readers see a whole file or none) and remove the files of other
    builder or library versions of the same vocabulary. A folder that cannot be written
    is logged: the tokenizer is built on every load then."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(tok.to_str())
            os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        log.warning("deviceops: cannot save the built tokenizer to %s (%s); it is built again "
                    "on the next load", path, exc)
        return
    stem = path.name.rsplit("-b", 1)[0]  # <arch>-<vocabulary hash> (no glob characters)
    for other in path.parent.glob(f"{stem}-b*.json"):
        if other != path:
            other.unlink(missing_ok=True)


def sentencepiece_from_gguf(meta: Mapping[str, Any], *, progress: bool | None = None) -> Any:
    """A ``tokenizers.Tokenizer`` for a Gemma SentencePiece vocabulary in GGUF metadata
    (``tokenizer.ggml.model`` ``llama``; Gemma 2 and 3 files).

    It is the tokenizer of Gemma's ``tokenizer.json`` (and of transformers' Gemma GGUF
    loader): BPE with byte fallback over the vocabulary, merges from the token order
    (:func:`sentencepiece_merges`), spaces normalised to ``▁`` with no prefix space, runs of
    spaces stored as spaces respelled with ``▁``; control tokens are special added tokens
    and user-defined ones (``\n``, ``\n\n`` ...) plain added tokens, both matched whole.

    Deriving the merges of a large vocabulary takes seconds (Gemma 3's 262,144 tokens: 3-6 s
    on two cores), so the built tokenizer is saved as ``tokenizers`` JSON
    (:func:`sentencepiece_cache_file`, under ``DEVICEOPS_WEIGHT_CACHE``'s folder) and the
    next call with the same vocabulary loads it instead (about 2 s for Gemma 3). A file
    that does not load, or holds another vocabulary size, is logged, removed and rebuilt.

    Args:
        meta: the GGUF metadata.
        progress: show the build ("building the tokenizer (first load)") or the load of the
            saved one as a tqdm bar on stderr; ``None``: for vocabularies of 32k tokens or more.

    Raises:
        ValueError: the file is not a Gemma one (another SentencePiece vocabulary's merge
            order is unknown here), or the metadata lacks the tokens.
    """
    _arch, raw = _sentencepiece_tokens(meta)
    show = progress if progress is not None else len(raw) >= _BIG_VOCAB
    path = sentencepiece_cache_file(meta)
    unk_id = int(meta.get("tokenizer.ggml.unknown_token_id", 3))
    if path is not None and 0 <= unk_id < len(raw):
        tok = _load_cached(path, raw, unk_id, show)
        if tok is not None:
            return tok
    tok = _build_sentencepiece(meta, show)
    if path is not None:
        _store_cached(path, tok)
    return tok


def _build_sentencepiece(meta: Mapping[str, Any], show: bool) -> Any:
    """Build :func:`sentencepiece_from_gguf`'s tokenizer (no cache)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    _arch, raw = _sentencepiece_tokens(meta)
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in map(str, raw)]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("tokenizer: the GGUF vocabulary repeats a token; it is not a Gemma "
                         "SentencePiece vocabulary deviceops.nn can rebuild")
    unk_id = int(meta.get("tokenizer.ggml.unknown_token_id", 3))
    with _bar(len(tokens), "building the tokenizer (first load)", show) as bar:
        merges = sentencepiece_merges(tokens, progress=bar.update)
        bar.set_postfix_str("the BPE model")
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True,
                                   unk_token=tokens[unk_id], byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous",
                                             invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    types = meta.get("tokenizer.ggml.token_type") or []
    specials = [AddedToken(str(raw[i]), special=True, normalized=False)
                for i, t in enumerate(types) if int(t) == _CONTROL]
    user = [AddedToken(str(raw[i]), special=False, normalized=False)
            for i, t in enumerate(types) if int(t) == _USER_DEFINED and str(raw[i]) in vocab]
    if specials:
        tok.add_special_tokens(specials)
    if user:
        tok.add_tokens(user)
    return tok


def tokenizer_from_file(path: str | Path) -> Any:
    """A ``tokenizers.Tokenizer`` from a Hugging Face ``tokenizer.json``."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def _tool_call(call: Any) -> Any:
    """``call`` with a JSON-object ``function.arguments`` string parsed (else as given)."""
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("arguments"), str):
        return call
    args: str = fn["arguments"]
    try:
        parsed = json.loads(args)
    except ValueError:
        return call
    if not isinstance(parsed, dict):
        return call
    return {**call, "function": {**fn, "arguments": parsed}}


#: The system text that describes ``tools`` to a model whose chat template has no tools
#: section (SmolLM2's): the Hermes convention Qwen2.5's own template uses, so one parser
#: reads the calls of both (``deviceops.nn.serving.tool_calls``). ``{tools}`` is one JSON
#: object per line.
GENERIC_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def _generic_tools(messages: list[dict[str, Any]], tools: Sequence[Any] | None,
                   calls: bool) -> list[dict[str, Any]]:
    """``messages`` for a template without tool support: the tools described in the system
    message (:data:`GENERIC_TOOLS_PROMPT`, after the user's own system text), and, with
    ``calls``, an assistant's ``tool_calls`` written into its content as ``<tool_call>``
    blocks and ``tool`` messages as user turns holding a ``<tool_response>``."""
    out = list(messages)
    if calls:
        conv = []
        for m in out:
            if m.get("role") == "assistant" and m.get("tool_calls"):
                blocks = [
                    "<tool_call>\n" + json.dumps(
                        {"name": c["function"]["name"],
                         "arguments": c["function"].get("arguments", {})},
                        ensure_ascii=False) + "\n</tool_call>"
                    for c in m["tool_calls"] if isinstance(c.get("function"), Mapping)]
                text = (m.get("content") or "")
                m = {"role": "assistant", "content": "\n".join(([text] if text else []) + blocks)}
            elif m.get("role") == "tool":
                m = {"role": "user",
                     "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
            conv.append(m)
        out = conv
    if tools:
        desc = GENERIC_TOOLS_PROMPT.format(tools="\n".join(
            json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0].get("role") == "system":
            first = out[0]
            out[0] = {**first, "content": f"{first.get('content') or ''}\n\n{desc}".strip()}
        else:
            out.insert(0, {"role": "system", "content": desc})
    return out


def _raise(message: str) -> None:
    raise ValueError(f"chat template: {message}")


class ChatTemplate:
    """A Hugging Face chat template rendered with jinja2.

    Args:
        source: the jinja2 template text.
        bos_token, eos_token: the strings the template may use as ``bos_token`` /
            ``eos_token``.

    Example:
        >>> ChatTemplate(src).render([{"role": "user", "content": "Hi"}])
        '<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n'
    """

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        self.source = source
        #: the template renders ``tools`` itself (else :meth:`render` describes them in the
        #: system message, :data:`GENERIC_TOOLS_PROMPT`) / an assistant's ``tool_calls``
        #: (else they are written into its content, and ``tool`` messages become user turns)
        self.renders_tools = "tools" in source
        self.renders_tool_calls = "tool_calls" in source
        self._template = env.from_string(source)
        self._bos, self._eos = bos_token, eos_token

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               **extra: Any) -> str:
        """Render ``messages`` (dicts with ``role`` and ``content``; an assistant message with
        ``tool_calls`` may omit ``content``) to the prompt text.

        ``extra`` goes to the template as variables (``tools=[...]`` in OpenAI's format).
        A template without a tools section gets the tools in the system message instead
        (:data:`GENERIC_TOOLS_PROMPT`, the Hermes convention), and one that does not render
        ``tool_calls`` gets them written into the assistant's content: tools are never
        ignored.
        An assistant message's ``tool_calls`` whose ``function.arguments`` is a JSON string
        (OpenAI's form) reach the template with the arguments as the object it holds (as
        ``transformers``' templates expect, and vLLM does), so ``arguments | tojson`` writes
        the object once, not a quoted string; the messages given are not modified.

        Raises:
            ValueError: a message lacks ``role``/``content``, or the template raises.
        """
        msgs = []
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m or (
                    "content" not in m and not m.get("tool_calls")):
                raise ValueError(f"apply_chat_template: message {i} ({m!r}) needs 'role' and "
                                 "'content' (or, for an assistant's, 'tool_calls')")
            msg = dict(m)
            if isinstance(msg.get("tool_calls"), list):
                msg["tool_calls"] = [_tool_call(c) for c in msg["tool_calls"]]
            msgs.append(msg)
        tools = extra.get("tools")
        if (tools and not self.renders_tools) or not self.renders_tool_calls:
            msgs = _generic_tools(msgs, None if self.renders_tools else tools,
                                  not self.renders_tool_calls)
            if not self.renders_tools:
                extra = {k: v for k, v in extra.items() if k != "tools"}
        return str(self._template.render(messages=msgs, add_generation_prompt=add_generation_prompt,
                                         bos_token=self._bos, eos_token=self._eos, **extra))


class TextCodec:
    """Text to token ids and back, as the checkpoint's own tokenizer does.

    A base of classes that have ``config`` (``bos_token_id``, ``eos_token_id``,
    ``add_bos_token``) and ``tokenizer`` (a ``tokenizers.Tokenizer``); they call
    :meth:`_init_chat_template` once both are set.

    Attributes:
        chat_template: the checkpoint's :class:`ChatTemplate`, or ``None``.
    """

    config: Any
    tokenizer: Any
    chat_template: ChatTemplate | None = None

    def _init_chat_template(self, source: str | None) -> None:
        self.chat_template = None
        if source:
            self.chat_template = ChatTemplate(
                source, bos_token=self._token_text(self.config.bos_token_id),
                eos_token=self._token_text(self.config.eos_token_id))

    def _token_text(self, tid: int | None) -> str:
        if tid is None:
            return ""
        t = self.tokenizer.id_to_token(int(tid))
        return "" if t is None else str(t)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens such as ``<|im_start|>`` matched; no BOS for
        models whose tokenizer adds none, like SmolLM2)."""
        if not isinstance(text, str):
            raise TypeError(f"encode: text must be a str, got {type(text).__name__}")
        ids = [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False).ids]
        if self.config.add_bos_token and self.config.bos_token_id is not None:
            ids = [self.config.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``: special tokens kept, as the model's own tokenizer decodes, or with
        ``skip_special_tokens=True`` left out (``<|im_end|>``, EOS: the text a user reads)."""
        return str(self.tokenizer.decode([int(i) for i in ids],
                                         skip_special_tokens=bool(skip_special_tokens)))

    def encode_untrusted(self, text: str) -> list[int]:
        """Token ids of ``text`` with special-token strings read as plain text: what a user
        types (``<|im_start|>`` inside a message) cannot become a control token. (BOS as
        :meth:`encode`.)"""
        if not isinstance(text, str):
            raise TypeError(f"encode_untrusted: text must be a str, got {type(text).__name__}")
        ids = [int(i) for i in self._plain().encode(text, add_special_tokens=False).ids]
        if self.config.add_bos_token and self.config.bos_token_id is not None:
            ids = [self.config.bos_token_id, *ids]
        return ids

    def encode_chat(self, messages: Sequence[dict[str, Any]], **extra: Any) -> list[int]:
        """Token ids of a conversation through the chat template, where only the template
        emits control tokens: a message whose content holds a special token's text has that
        content tokenised as plain text. Conversations without such text get exactly
        ``encode(apply_chat_template(messages, **extra))``.

        Args:
            messages: as :meth:`apply_chat_template` (``tool_calls``, ``tool`` messages).
            **extra: template variables, e.g. ``tools=[...]`` (OpenAI's format).

        Raises:
            ValueError: as :meth:`apply_chat_template`.
        """
        if self.chat_template is None:
            raise ValueError("apply_chat_template: this checkpoint has no chat template")
        specials = self._special_texts()
        if not any(isinstance(m.get("content"), str) and any(t in m["content"] for t in specials)
                   for m in messages):
            return self.encode(self.chat_template.render(messages, **extra))
        # render with a marker in place of each content, then tokenise the template's text
        # (control tokens matched) and the contents (plain text) piece by piece
        marks = [f"\x00deviceops-content-{i}\x00" for i in range(len(messages))]
        text = self.chat_template.render(
            [{**m, "content": marks[i]} if isinstance(m.get("content"), str) and m["content"]
             else m for i, m in enumerate(messages)], **extra)
        ids = self.encode("") if self.config.add_bos_token else []
        for i, m in enumerate(messages):
            if not isinstance(m.get("content"), str) or marks[i] not in text:
                continue
            head, _, text = text.partition(marks[i])
            ids += self.tokenizer.encode(head, add_special_tokens=False).ids
            ids += self._plain().encode(m["content"], add_special_tokens=False).ids
        ids += self.tokenizer.encode(text, add_special_tokens=False).ids
        return [int(i) for i in ids]

    def _special_texts(self) -> list[str]:
        got = getattr(self, "_specials", None)
        if got is None:
            got = [str(t.content) for t in self.tokenizer.get_added_tokens_decoder().values()
                   if t.special]
            self._specials: list[str] = got
        return got

    def _plain(self) -> Any:
        """A copy of the tokenizer that reads special-token strings as text (built once)."""
        got = getattr(self, "_plain_tok", None)
        if got is None:
            from tokenizers import Tokenizer

            got = Tokenizer.from_str(self.tokenizer.to_str())
            got.encode_special_tokens = True
            self._plain_tok: Any = got
        return got

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], *,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text of a conversation (the model's template, ``add_generation_prompt=True``).

        Args:
            messages: dicts with ``role`` and ``content`` (assistant messages may carry
                ``tool_calls``; ``tool`` messages answer them).
            tools: function tools in OpenAI's format (``{"type": "function", "function":
                {...}}``), rendered as the template does; ``None``: no tools.

        Raises:
            ValueError: the checkpoint has no chat template, or a message is malformed.
        """
        if self.chat_template is None:
            raise ValueError("apply_chat_template: this checkpoint has no chat template")
        extra = {} if tools is None else {"tools": list(tools)}
        return self.chat_template.render(messages, add_generation_prompt=True, **extra)
