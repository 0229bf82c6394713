"""``POST /v1/embeddings`` (OpenAI's shape) over an :class:`~deviceops.nn.Encoder`.

Request: ``input`` (a string, a list of strings, a list of token ids, or a list of lists of
token ids: at most :data:`MAX_INPUTS` inputs, none empty), ``model`` (the served embedding
model's name; another is a 404 ``model_not_found``), ``encoding_format`` (``"float"``, the
default, or ``"base64"``: the little-endian float32 bytes, base64-encoded), ``dimensions``
(accepted only equal to the model's width: no truncated embeddings), ``user`` (accepted,
no effect). Any other field is a 400 naming it. Token ids are the model's input as they
are: include the special tokens (for a BERT, [CLS] = 101 first and [SEP] = 102 last, as
the tokenizer adds them to a string). An input longer than the encoder's ``max_length``
(512 tokens for all-MiniLM-L6-v2, special tokens included) is refused with a 400 naming
the limit (``code`` ``context_length_exceeded``); nothing is truncated.

Response: ``{"object": "list", "data": [{"object": "embedding", "index", "embedding"}],
"model", "usage": {"prompt_tokens", "total_tokens"}}``, the embeddings unit-length
float32 (mean-pooled, L2-normalised, as sentence-transformers gives them).

Where it runs: in the front process (the model is small), loaded in a worker thread at
start-up (:meth:`EmbeddingService.load`); parsing and tokenising a body over
:data:`~.http.INLINE_BODY_BYTES`, and every forward, run in worker threads, so the event
loop is never blocked by them. Forwards run one at a time (the encoder owns one activation
arena); the requests that arrive while one runs are embedded together by the next, up to
:data:`MAX_INPUTS` inputs (:meth:`EmbeddingService.embed`; the encoder batches by length
under the padding mask, so a text's embedding does not depend on its company).
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

from ..encoder import Encoder
from .openai import BadRequest, Limits

__all__ = ["MAX_INPUTS", "EmbeddingJob", "EmbeddingService", "embeddings_body",
           "parse_embedding_request"]

log = logging.getLogger("deviceops.nn.serve")

#: The most inputs one request may hold (OpenAI's limit).
MAX_INPUTS = 2048

_KNOWN = frozenset({"input", "model", "encoding_format", "dimensions", "user"})


@dataclass
class EmbeddingJob:
    """A validated embeddings request: each input's token ids, and the encoding asked for."""

    ids: list[list[int]]
    base64: bool

    @property
    def tokens(self) -> int:
        """Tokens over every input (``usage``)."""
        return sum(len(s) for s in self.ids)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _inputs(value: Any) -> tuple[list[str] | None, list[list[int]] | None]:
    """``input`` as strings or as token-id lists (the other ``None``), or BadRequest."""
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(_is_int(t) for t in value):
        value = [value]  # one list of token ids: one input
    if not isinstance(value, list) or not value:
        raise BadRequest("input", "'input' must be a non-empty string, a list of strings, a list "
                         "of token ids, or a list of lists of token ids")
    if len(value) > MAX_INPUTS:
        raise BadRequest("input", f"'input' has {len(value)} inputs; this server embeds at most "
                         f"{MAX_INPUTS} per request (split it)")
    if all(isinstance(v, str) for v in value):
        for i, v in enumerate(value):
            if not v:
                raise BadRequest("input", f"input {i} is an empty string; each input must hold "
                                 "some text")
        return value, None
    if all(isinstance(v, list) for v in value):
        for i, v in enumerate(value):
            if not v or not all(_is_int(t) for t in v):
                raise BadRequest("input", f"input {i} must be a non-empty list of integer token ids")
        return None, value
    raise BadRequest("input", "'input' mixes kinds; give strings only or token-id lists only")


def parse_embedding_request(body: Any, model_name: str, encoder: Encoder,
                            limits: Limits | None = None) -> EmbeddingJob:
    """The :class:`EmbeddingJob` of a ``/v1/embeddings`` body, or :class:`BadRequest` naming
    the field (module docstring). Tokenises the strings: call it off the event loop for
    large bodies.
    """
    if not isinstance(body, dict):
        raise BadRequest(None, "the request body must be a JSON object")
    unknown = sorted(k for k in body if k not in _KNOWN)
    if unknown:
        raise BadRequest(unknown[0], f"unrecognized request argument(s): {', '.join(unknown)}")
    name = body.get("model")
    if name is None:
        raise BadRequest("model", f"'model' is required; this server embeds with {model_name!r}")
    if name != model_name:
        raise BadRequest("model", f"The model {name!r} does not exist; this server embeds with "
                         f"{model_name!r} (GET /v1/models)", status=404, code="model_not_found")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise BadRequest("encoding_format", f"'encoding_format' must be 'float' or 'base64', got "
                         f"{fmt!r}")
    dims = body.get("dimensions")
    if dims is not None and not (_is_int(dims) and dims == encoder.dim):
        raise BadRequest("dimensions", f"'dimensions'={dims!r}: {model_name!r} gives embeddings of "
                         f"{encoder.dim} dimensions only; leave it out",
                         code="unsupported_parameter")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest("user", "'user' must be a string")
    if "input" not in body:
        raise BadRequest("input", "'input' is required")
    texts, ids = _inputs(body["input"])
    lim = limits or Limits()
    if texts is not None:
        chars = sum(len(t) for t in texts)
        if chars > lim.max_prompt_chars:
            raise BadRequest("input", f"'input' has {chars} characters; this server accepts at "
                             f"most {lim.max_prompt_chars} (serve --max-prompt-chars)")
        ids = encoder.encode_batch(texts)
    assert ids is not None
    vocab, most = encoder.config.vocab_size, encoder.max_length
    for i, s in enumerate(ids):
        if len(s) > most:
            raise BadRequest("input", f"input {i} has {len(s)} tokens; {model_name!r} takes at most "
                             f"{most} tokens per input (special tokens included); shorten it",
                             code="context_length_exceeded")
        bad = next((t for t in s if not 0 <= t < vocab), None)
        if bad is not None:
            raise BadRequest("input", f"input {i} has token id {bad}; token ids must be in "
                             f"[0, {vocab})")
    return EmbeddingJob(ids, fmt == "base64")


def embeddings_body(model_name: str, vectors: np.ndarray, job: EmbeddingJob) -> dict[str, Any]:
    """The response body of ``job`` (module docstring)."""
    rows = np.ascontiguousarray(vectors, dtype="<f4")
    if job.base64:
        data: list[Any] = [base64.b64encode(r.tobytes()).decode("ascii") for r in rows]
    else:
        data = rows.tolist()
    return {"object": "list", "model": model_name,
            "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
            "usage": {"prompt_tokens": job.tokens, "total_tokens": job.tokens}}


@dataclass(eq=False)
class _Waiting:
    """A request waiting for its embeddings (:meth:`EmbeddingService.embed`)."""

    job: EmbeddingJob
    done: anyio.Event
    result: np.ndarray | None = None
    error: BaseException | None = None


class EmbeddingService:
    """The served embedding model: its name, its loader, and the encoder once loaded.

    Args:
        name: the id clients pass as ``"model"``.
        load: builds the :class:`~deviceops.nn.Encoder` (run in a worker thread by
            :meth:`load`).

    Attributes:
        forwards: forwards run so far (requests embedded together count once).
    """

    def __init__(self, name: str, load: Callable[[], Encoder]) -> None:
        self.name = name
        self._load = load
        self.encoder: Encoder | None = None
        self.load_error: str | None = None
        self.forwards = 0
        self._waiting: list[_Waiting] = []
        self._running = False

    @property
    def status(self) -> str:
        """``"ok"``, ``"loading"`` or ``"failed"``."""
        return "ok" if self.encoder is not None else ("failed" if self.load_error else "loading")

    async def load(self) -> None:
        """Load the encoder in a worker thread; a failure is kept in :attr:`load_error`
        (and raised)."""
        try:
            self.encoder = await anyio.to_thread.run_sync(self._load, abandon_on_cancel=True)
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            raise
        log.info("ready: embedding model %s loaded (%s)", self.name, self.encoder)

    async def embed(self, job: EmbeddingJob) -> np.ndarray:
        """The embeddings of ``job``'s inputs, computed in a worker thread.

        One forward runs at a time. A request that finds none running runs them (shielded
        from its own cancellation, so the others it carries are never left waiting): it
        takes the requests waiting, up to :data:`MAX_INPUTS` inputs together (at least one
        request), embeds them in one forward, hands each its rows, and goes on until none
        waits.
        """
        me = _Waiting(job, anyio.Event())
        self._waiting.append(me)
        if not self._running:
            self._running = True
            try:
                with anyio.CancelScope(shield=True):
                    while self._waiting:
                        await self._forward()
            finally:
                self._running = False
        await me.done.wait()
        if me.error is not None:
            raise me.error
        assert me.result is not None
        return me.result

    async def _forward(self) -> None:
        """One forward over the first waiting requests (module docstring)."""
        enc = self.encoder
        assert enc is not None
        take: list[_Waiting] = []
        n = 0
        while self._waiting and (not take or n + len(self._waiting[0].job.ids) <= MAX_INPUTS):
            w = self._waiting.pop(0)
            take.append(w)
            n += len(w.job.ids)
        ids = [s for w in take for s in w.job.ids]
        self.forwards += 1
        try:
            out = await anyio.to_thread.run_sync(enc.embed_ids, ids)
        except Exception as exc:  # each request of the forward gets the error
            for w in take:
                w.error = exc
        else:
            r = 0
            for w in take:
                w.result = out[r:r + len(w.job.ids)]
                r += len(w.job.ids)
        for w in take:
            w.done.set()
