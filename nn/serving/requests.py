"""The request side of the serving :class:`~deviceops.nn.Engine`: what a request is, its
sampling parameters, the per-request async token stream, the errors and the model protocol.

The engine (:mod:`.engine`, its :mod:`.scheduler`) schedules :class:`_Request` records;
:class:`RequestStream` is what a caller iterates (:class:`TokenStream` is the iteration it
shares with an engine core's :class:`~.core_client.CoreStream`); :class:`StepModel` is what
the engine needs from a model (:func:`~.step_model.step_model` adapts a ``CausalLM``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Self, runtime_checkable

import anyio

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["FEATURES", "STAT_FIELDS", "EngineClosed", "EngineFailed", "EngineOverloaded", "EngineStats",
           "RequestStream", "Sampled", "SamplingParams", "StepModel", "TokenLogprob",
           "TokenStream", "check_kv_budget", "prompt_ids"]

#: The optional sampling features a step model may declare in ``sampling_features``.
FEATURES = ("presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "grammar")


class EngineOverloaded(RuntimeError):
    """The admission queue is full (``max_queue`` requests waiting); retry later."""


class EngineClosed(RuntimeError):
    """The engine was closed; it accepts no new requests."""


class EngineFailed(EngineClosed):
    """A step of a fail-stop engine raised (a device error): the engine is out of service.

    Raised to every request it held, queued or running (``__cause__`` is the step's
    error), and by :meth:`~deviceops.nn.Engine.stream` afterwards. Only engines built with
    ``fail_stop=True`` (one per device behind :class:`~deviceops.nn.serving.router.Router`) fail
    this way; a default engine ends the step's requests with the error and goes on.
    """


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling: ``temperature=0`` is greedy; ``top_k=0`` / ``top_p=1`` are off.

    OpenAI's features (0 / empty / ``None``: off): ``presence_penalty`` and
    ``frequency_penalty`` in [-2, 2], ``logit_bias`` as ``((token id, bias), ...)`` sorted by
    id, ``logprobs`` the number of top log-probabilities returned with each token (0: only
    the token's own), ``grammar`` a grammar the reply must follow (llguidance's formats:
    :mod:`.grammar`; each draw is masked to the tokens it allows).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    grammar: str | None = None

    def features(self) -> frozenset[str]:
        """The optional features (:data:`FEATURES`) these parameters ask for."""
        asked = {"presence_penalty": bool(self.presence_penalty),
                 "frequency_penalty": bool(self.frequency_penalty),
                 "logit_bias": bool(self.logit_bias), "logprobs": self.logprobs is not None,
                 "grammar": self.grammar is not None}
        return frozenset(k for k, v in asked.items() if v)


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the top alternatives, best first, as
    ``(token id, logprob)`` pairs (as many as the request's ``logprobs`` asked)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Sampled(int):
    """A token id a step model returns with its :class:`TokenLogprob` (``logprobs``) when the
    request asked for log-probabilities; it is the plain ``int`` everywhere else."""

    logprobs: TokenLogprob | None

    def __new__(cls, token: int, logprobs: TokenLogprob | None = None) -> Sampled:
        obj = super().__new__(cls, token)
        obj.logprobs = logprobs
        return obj


@runtime_checkable
class StepModel(Protocol):
    """What the engine needs from a model (cache slots are rows ``0 .. max_batch-1``).

    ``prefill`` writes the KV of ``ids`` at positions ``start ..`` of ``slot`` and, when
    ``last``, returns the token sampled from the last position's logits with ``params``
    (the first call for a slot has ``start == 0`` and sets the slot's sampling state,
    seed and counter, as ``CausalLM.generate`` would). ``decode_step`` feeds ``tokens[i]`` at
    position ``positions[i]`` of ``slots[i]`` and returns one sampled token per row.
    ``release`` forgets a slot. Both step methods await their device work.

    Optional: ``device_fed`` (true: ``submit_decode`` takes ``tokens=None`` and each row then
    feeds the token still on the device, the one its last decode step or its prompt's last
    chunk sampled: the engine enqueues step k+1 before reading step k's tokens,
    :mod:`.scheduler`). ``sampling_features``, the :data:`FEATURES` the model honours (the engine
    refuses a request asking for another one). A model that honours ``logprobs`` returns
    each token of such a request as a :class:`Sampled` carrying its :class:`TokenLogprob`.
    A model that honours ``grammar`` has ``grammar_tokenizer()`` (its tokenizer's JSON),
    takes ``masks=`` in ``submit_decode`` (a callable it asks, once the step's forward pass is
    enqueued, for ``(slots, bitmask)``: the constrained rows' allowed-token bitmasks) and
    ``mask=`` (one row) in ``submit_prefill`` for a constrained request's first token.
    """

    @property
    def max_batch(self) -> int: ...

    @property
    def max_seq(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_ids(self) -> frozenset[int]: ...

    def encode(self, text: str) -> list[int]: ...

    async def prefill(
        self, slot: int, ids: Sequence[int], start: int, params: SamplingParams, *, last: bool
    ) -> int | None: ...

    async def decode_step(
        self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]
    ) -> list[int]: ...

    def release(self, slot: int) -> None: ...


def prompt_ids(prompt: Any, encode: Any, vocab: int, max_seq: int) -> list[int]:
    """``prompt`` (a ``str``, through ``encode``, or token ids) as checked token ids.

    Raises:
        TypeError: neither a ``str`` nor a list of ints.
        ValueError: empty, an id outside ``[0, vocab)``, or longer than ``max_seq``.
    """
    if isinstance(prompt, str):
        ids = list(encode(prompt))
    elif isinstance(prompt, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = [int(t) for t in prompt]
    else:
        raise TypeError(
            f"Engine: prompt must be a str or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("Engine: prompt is empty (it must have at least one token)")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"Engine: prompt token ids {bad[:4]} outside [0, {vocab})")
    if len(ids) > max_seq:
        raise ValueError(f"Engine: prompt has {len(ids)} tokens, more than max_seq={max_seq} "
                         "(shorten the prompt)")
    return ids


def check_kv_budget(prompt_len: int, max_new: int, max_seq: int, blocks_total: int,
                    block_size: int) -> None:
    """Refuse a request whose positions (prompt plus ``max_new``, within ``max_seq``) need
    more KV blocks than the whole pool has (``blocks_total`` 0: not a paged pool).

    Raises:
        ValueError: it could never be admitted.
    """
    need = min(prompt_len + max_new, max_seq)
    if blocks_total and -(-need // block_size) > blocks_total:
        raise ValueError(
            f"Engine: prompt ({prompt_len} tokens) plus max_new_tokens ({max_new}) needs more "
            f"KV blocks than the pool's {blocks_total} of {block_size} positions; lower "
            "max_new_tokens or build the model with more kv_blocks")


_QUEUED, _PREFILL, _DECODE, _DONE = range(4)


@dataclass(eq=False)
class _Request:
    id: int
    prompt: list[int]
    max_new: int
    params: SamplingParams
    stop: frozenset[int]
    ignore_eos: bool = False
    state: int = _QUEUED
    slot: int = -1
    prefilled: int = 0
    pos: int = 0  # position the next decode input token is written at
    last: int = -1  # the token to feed at the next decode step
    out: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)  # with params.logprobs
    buf: deque[int] = field(default_factory=deque)
    finish_reason: str | None = None
    error: BaseException | None = None
    cancelled: bool = False
    event: anyio.Event | None = None
    t_submit: float = 0.0
    t_first: float | None = None
    hashes: list[bytes] = field(default_factory=list)  # prefix caching: full prompt blocks'
    started: bool = False  # its first prompt chunk was enqueued
    fed: int = 0  # lookahead: decode steps enqueued for it whose token is not delivered yet
    primed: bool = False  # lookahead: its last prompt chunk is enqueued, its token not delivered
    grammar: Any = None  # params.grammar compiled: its .grammar.Matcher, advanced per token

    @property
    def finished(self) -> bool:
        return self.state == _DONE


@dataclass(frozen=True)
class EngineStats:
    """A snapshot: queue, running batch, KV slots and cumulative counters.

    ``kv_blocks_in_use`` counts the blocks running requests reference (a block shared by
    several counts once); ``kv_blocks_cached`` the prefix cache's, some of them also in use.

    ``pending_tokens`` is the work the engine still holds, in tokens
    (:attr:`~deviceops.nn.Engine.pending_tokens`): what the data-parallel router compares.
    """

    queued: int
    running: int
    slots_in_use: int
    kv_tokens_in_use: int
    kv_blocks_in_use: int
    max_batch: int
    steps: int
    decode_rows: int
    prefill_tokens: int
    generated_tokens: int
    finished: int
    cancelled: int
    kv_blocks_total: int = 0
    pending_tokens: int = 0
    #: KV blocks in the prefix cache (referenced by running requests or idle, reclaimable)
    kv_blocks_cached: int = 0
    #: prompt tokens whose KV came from the prefix cache / that were prefilled, over the
    #: requests that looked the cache up (both 0 with prefix caching off)
    prefix_cache_hit_tokens: int = 0
    prefix_cache_miss_tokens: int = 0
    #: cumulative host seconds of the steps by phase (``(name, seconds)`` pairs: the
    #: scheduler's admit / enqueue / wait / deliver, and an engine core's recv / send)
    host_phases: tuple[tuple[str, float], ...] = ()


#: The numeric fields of :class:`EngineStats`, in order (what an engine core sends).
STAT_FIELDS = tuple(f for f in EngineStats.__dataclass_fields__ if f != "host_phases")


class TokenStream:
    """The async iteration of one request's new token ids, over a request record with
    ``buf`` (tokens not yet taken), ``out``, ``finished`` and ``error``, and an owner with
    ``_cancel(req)``. Iterating ends after the last token (or raises the request's error);
    ``aclose()``, ``cancel()``, leaving ``async with``, or an error in the consuming task
    cancels the request. Subclasses say how to wait for news (:meth:`_wait`)."""

    def __init__(self, owner: Any, req: Any) -> None:
        self._engine = owner
        self._req = req

    @property
    def tokens(self) -> list[int]:
        """Tokens generated so far."""
        return list(self._req.out)

    @property
    def logprobs(self) -> list[TokenLogprob | None]:
        """With ``logprobs``: one :class:`TokenLogprob` per token of :attr:`tokens` (so far),
        else empty (the request record's ``logprobs``)."""
        return list(self._req.logprobs)

    def logprob(self, i: int) -> TokenLogprob | None:
        """The :class:`TokenLogprob` of token ``i`` (with ``logprobs``; else ``None``)."""
        lps = self._req.logprobs
        return lps[i] if 0 <= i < len(lps) else None

    def take_ready(self) -> list[int]:
        """Every token already received and not yet iterated (possibly none), without
        waiting: a consumer that fell behind takes them in one go."""
        buf = self._req.buf
        out = [int(t) for t in buf]
        buf.clear()
        return out

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> int:
        req = self._req
        try:
            while True:
                if req.buf:
                    return int(req.buf.popleft())
                if req.finished:
                    if req.error is not None:
                        raise req.error
                    raise StopAsyncIteration
                await self._wait()
        except (StopAsyncIteration, GeneratorExit):
            raise
        except BaseException:
            self._engine._cancel(req)
            raise

    async def _wait(self) -> None:
        """Return once the request may have news (a token or its end)."""
        raise NotImplementedError

    def cancel(self) -> None:
        """Cancel the request (no-op once finished); its slot is freed."""
        self._engine._cancel(self._req)

    async def aclose(self) -> None:
        """Same as :meth:`cancel`."""
        self._engine._cancel(self._req)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._engine._cancel(self._req)


class RequestStream(TokenStream):
    """Async iterator of one request's new token ids (from :meth:`Engine.stream`).

    The request is queued when the stream is created. Iterating drives the engine; it
    ends after EOS, a stop id (both included), ``max_new_tokens`` or the end of the
    context. ``aclose()`` (or ``async with``, or cancelling the consuming task) cancels
    the request and frees its KV slot. After the end, ``finish_reason`` is ``"stop"``,
    ``"length"`` or ``"cancelled"``; ``tokens`` holds everything generated.
    """

    _req: _Request

    def __init__(self, engine: Engine, req: _Request) -> None:
        super().__init__(engine, req)

    @property
    def id(self) -> int:
        """The engine-wide request id."""
        return self._req.id

    @property
    def prompt_tokens(self) -> int:
        """Number of prompt tokens."""
        return len(self._req.prompt)

    @property
    def finish_reason(self) -> str | None:
        """``"stop"``, ``"length"``, ``"cancelled"`` or ``"error"`` once finished, else None."""
        req = self._req
        if req.finish_reason is None and req.cancelled:
            return "cancelled"  # its slot is freed at the end of the step in flight
        return req.finish_reason

    async def _wait(self) -> None:
        await self._engine._progress(self._req)

    def __del__(self) -> None:
        req = self._req
        if req.state != _DONE:
            req.cancelled = True  # reaped by the next step (a GC thread must not touch state)
