"""Adapts a ``CausalLM`` to the engine's :class:`~.requests.StepModel` protocol.

The model's step API (documented in :mod:`deviceops.nn.runner.runner`) enqueues on ``model.device_stream``
and returns token views without waiting; this adapter awaits the host copy of the
sampled tokens as a :class:`~deviceops.DeviceFuture` scheduled on that same stream, so
the event loop runs while the step is on the device (or on the cpu backend's worker
thread). Prefill chunks that sample nothing are enqueued and not awaited: the next op on
the stream is ordered after them.

OpenAI's penalties, ``logit_bias``, ``logprobs`` and a grammar go to the row's device state
with its sampling parameters (``set_sampling``; a grammar's bitmasks follow per draw:
``submit_decode``'s ``masks``, computed while the forward pass runs, and
``submit_prefill``'s ``mask`` for the first token); for a step with rows that asked for
log-probabilities, the host copy of the runner's log-probability rows is scheduled right
after the tokens' (same stream, so it holds this step's values) and each such row's token
comes back as a :class:`~.requests.Sampled` carrying its :class:`~.requests.TokenLogprob`.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from deviceops.scheduling import SingleStream

from ..runner.packed_prefill import worth_packing
from ..runner.prefix_cache import block_hashes
from .requests import FEATURES, Sampled, SamplingParams, TokenLogprob

__all__ = ["CausalLMSteps", "step_model"]


class CausalLMSteps:
    """:class:`~.requests.StepModel` over a ``CausalLM``'s cache rows (slots).

    Args:
        model: the ``CausalLM`` (its step API: ``set_sampling``, ``prefill``, ``decode``,
            ``release``, ``read``, ``device_stream``).
    """

    def __init__(self, model: Any) -> None:
        missing = [n for n in ("set_sampling", "prefill", "release", "read",
                               "device_stream", "max_batch", "max_seq", "config", "encode")
                   if not hasattr(model, n)]
        if missing:
            raise TypeError(
                f"Engine: {type(model).__name__} lacks the step API ({', '.join(missing)}); "
                "pass a deviceops.nn CausalLM or a StepModel"
            )
        self.model = model
        self._lp: dict[int, int] = {}  # slot -> top log-probabilities its request asked for
        self._first: dict[int, int] = {}  # slot -> position of its first prefill chunk
        self._decode = _step_decode(model)
        self._policy = SingleStream(model.device_stream)
        self._eos = frozenset(int(t) for t in model.config.stop_ids)

    @property
    def device_fed(self) -> bool:
        """``submit_decode`` takes ``tokens=None`` (each row feeds its token on the device):
        ``CausalLM.decode_step``'s ``tokens=None``."""
        return True

    @property
    def sampling_features(self) -> frozenset[str]:
        """Every optional feature where the model has the runner's feature path
        (``read_logprobs``; ``grammar`` also needs ``set_mask`` and a ``tokenizer``), else
        none."""
        if not hasattr(self.model, "read_logprobs"):
            return frozenset()
        grammar = (hasattr(self.model, "set_mask")
                   and getattr(self.model, "tokenizer", None) is not None)
        return frozenset(f for f in FEATURES if grammar or f != "grammar")

    @property
    def max_batch(self) -> int:
        return int(self.model.max_batch)

    @property
    def max_seq(self) -> int:
        return int(self.model.max_seq)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._eos

    def encode(self, text: str) -> list[int]:
        return list(self.model.encode(text))

    async def prefill(self, slot: int, ids: Sequence[int], start: int, params: SamplingParams,
                      *, last: bool) -> int | None:
        return await self.submit_prefill(slot, ids, start, params, last=last)()

    async def decode_step(self, slots: Sequence[int], tokens: Sequence[int],
                          positions: Sequence[int]) -> list[int]:
        return await self.submit_decode(slots, tokens, positions)()

    # -- pipelined steps (optional StepModel extension the engine uses when present) --------
    def submit_prefill(self, slot: int, ids: Sequence[int], start: int, params: SamplingParams,
                       *, last: bool, mask: Any = None) -> Callable[[], Awaitable[int | None]]:
        """Enqueue a prefill chunk now; the returned callable awaits its token (``last``).
        ``mask``: the grammar's bitmask (one row) for that token."""
        m = self.model
        if start == self._first.get(slot, 0):  # the request's first chunk
            extra: dict[str, Any] = {}
            if params.features():
                extra = {"presence_penalty": params.presence_penalty,
                         "frequency_penalty": params.frequency_penalty,
                         "logit_bias": dict(params.logit_bias),
                         "logprobs": params.logprobs is not None}
                if params.grammar is not None:
                    extra["grammar"] = True
            m.set_sampling(slot, temperature=params.temperature, top_k=params.top_k,
                           top_p=params.top_p, seed=params.seed, **extra)
            if params.logprobs is not None:
                self._lp[slot] = params.logprobs
            else:
                self._lp.pop(slot, None)
        if mask is not None:
            m.set_mask([slot], mask.reshape(1, -1))
        view = m.prefill(slot, list(ids), start, sample=last)
        if not last:
            return _none
        fut = m.read(view).schedule(self._policy)
        lp = self._read_logprobs([slot])
        top = self._lp.get(slot, 0)  # as asked now: the slot may be released before the await

        async def token() -> int | None:
            host = await fut
            tok = int(host[0])
            if lp is None:
                return tok
            vals, ids = await lp
            return _sampled(tok, vals, ids, slot, top)

        return token

    def submit_prefills(self, chunks: Sequence[tuple[int, Sequence[int], int, SamplingParams,
                                                     bool]]) -> list[Callable[[], Awaitable[int | None]]]:
        """Enqueue several rows' prompt chunks ``(slot, ids, start, params, last)`` now, in
        order: each run of two or more chunks worth packing (``worth_packing``: short) of rows
        without features as one packed prefill (``prefill_many``), the others one by one; one
        awaitable per chunk."""
        m = self.model
        if not hasattr(m, "prefill_many"):
            return [self.submit_prefill(sl, ids, st, p, last=last) for sl, ids, st, p, last in chunks]
        out: list[Callable[[], Awaitable[int | None]]] = []
        run: list[tuple[int, Sequence[int], int, SamplingParams, bool]] = []

        def flush() -> None:
            if len(run) == 1:
                sl, ids, st, p, last = run[0]
                out.append(self.submit_prefill(sl, ids, st, p, last=last))
            elif run:
                out.extend(self._packed(run))
            run.clear()

        for ch in chunks:
            if worth_packing(ch[2], len(ch[1])) and not ch[3].features():
                run.append(ch)
            else:
                flush()
                out.append(self.submit_prefill(ch[0], ch[1], ch[2], ch[3], last=ch[4]))
        flush()
        return out

    def _packed(self, run: list[tuple[int, Sequence[int], int, SamplingParams, bool]]
                ) -> list[Callable[[], Awaitable[int | None]]]:
        """One packed prefill of ``run``; the chunks' awaitables share one read."""
        m = self.model
        for slot, _ids, start, params, _last in run:
            if start == self._first.get(slot, 0):  # the request's first chunk
                m.set_sampling(slot, temperature=params.temperature, top_k=params.top_k,
                               top_p=params.top_p, seed=params.seed)
                self._lp.pop(slot, None)
        view = m.prefill_many([(sl, list(ids), st, last) for sl, ids, st, _p, last in run])
        fut = m.read(view).schedule(self._policy) if any(c[4] for c in run) else None

        def token(slot: int) -> Callable[[], Awaitable[int | None]]:
            async def get() -> int | None:
                assert fut is not None
                host = await fut
                return int(host[slot])
            return get

        return [token(sl) if last else _none for sl, _ids, _st, _p, last in run]

    def submit_decode(self, slots: Sequence[int], tokens: Sequence[int] | None,
                      positions: Sequence[int], *, masks: Any = None
                      ) -> Callable[[], Awaitable[list[int]]]:
        """Enqueue a decode step now; the returned callable awaits the rows' tokens.
        ``tokens=None``: each row feeds the token on the device (:attr:`device_fed`).
        ``masks``: the grammar rows' bitmasks, a callable asked once the forward pass is
        enqueued (``CausalLM.decode_step``'s)."""
        rows = list(slots)
        kw = {} if masks is None else {"masks": masks}
        view = self._decode(rows, None if tokens is None else list(tokens), list(positions),
                            **kw)
        return self._tokens(view, rows)

    def _tokens(self, view: Any, rows: list[int]) -> Callable[[], Awaitable[list[int]]]:
        """Schedule the host copies of a decode step's tokens (and log-probabilities); the
        returned callable awaits them."""
        fut = self.model.read(view).schedule(self._policy)
        lp = self._read_logprobs(rows)
        tops = {s: self._lp[s] for s in rows if s in self._lp} if lp is not None else {}

        async def result() -> list[int]:
            host = await fut
            toks = [int(host[s]) for s in rows]
            if lp is None:
                return toks
            vals, ids = await lp
            return [_sampled(t, vals, ids, s, tops[s]) if s in tops else t
                    for t, s in zip(toks, rows, strict=True)]

        return result

    # -- grammars (optional StepModel extension the engine uses when present) --------------
    def begin_decode(self, slots: Sequence[int], positions: Sequence[int], masks: Any
                     ) -> Callable[[], Callable[[], Awaitable[list[int]]]]:
        """:meth:`submit_decode` (rows feeding their device-held tokens) in two: the forward
        pass is enqueued now; the returned ``finish()`` asks ``masks`` for the grammar rows'
        bitmasks, enqueues them and the sampling, and returns the callable awaiting the
        tokens. Nothing else may be enqueued in between (``CausalLM.decode_begin``); the
        host may read the previous step's tokens, from which the masks follow."""
        rows = list(slots)
        view, end = self.model.decode_begin(rows, None, list(positions), masks)

        def finish() -> Callable[[], Awaitable[list[int]]]:
            end()
            return self._tokens(view, rows)

        return finish

    def grammar_tokenizer(self) -> str:
        """The model's tokenizer as JSON, what :class:`~.grammar.GrammarCompiler` builds on."""
        return str(self.model.tokenizer.to_str())

    def _read_logprobs(self, slots: list[int]) -> Any:
        """The scheduled host copy of the log-probability rows when a slot asked, else None."""
        if not any(s in self._lp for s in slots):
            return None
        return self.model.read_logprobs(max(slots) + 1).schedule(self._policy)

    def release(self, slot: int) -> None:
        self._lp.pop(slot, None)
        self._first.pop(slot, None)
        self.model.release(slot)

    def warmup(self) -> None:
        """Capture the model's decode and prefill graphs (no-op where it uses none), with
        its named progress bars on a terminal's stderr (``serve``'s start-up)."""
        cap = getattr(self.model, "capture_graphs", None)
        if cap is None:
            return
        if "progress" in inspect.signature(cap).parameters:
            cap(progress=sys.stderr.isatty())
        else:
            cap()

    # -- paged KV (optional StepModel extension the engine uses when present) ---------------
    def reserve(self, slot: int, n_tokens: int) -> bool:
        """Give ``slot`` KV blocks for ``n_tokens`` positions; False when too few are free."""
        return bool(self.model.reserve(slot, n_tokens))

    @property
    def kv_blocks_in_use(self) -> int:
        """KV blocks held by the model's rows."""
        return int(self.model.blocks.in_use)

    @property
    def kv_blocks_total(self) -> int:
        """KV blocks the pool can hand out."""
        return int(self.model.blocks.capacity)

    @property
    def kv_block_size(self) -> int:
        """Positions per KV block."""
        return int(self.model.block_size)

    # -- prefix caching (optional StepModel extension the engine uses when present) ---------
    def prefix_hashes(self, ids: Sequence[int], known: Sequence[bytes] = ()) -> list[bytes]:
        """The hash chain of ``ids``' full KV blocks (``known``: a prefix's chain, reused)."""
        return block_hashes(ids, int(self.model.block_size), known)

    def share_prefix(self, slot: int, hashes: Sequence[bytes], start: int) -> int:
        """Point ``slot`` at the cached blocks of ``hashes`` from ``start`` on; the positions
        it now shares: its first prefill chunk starts there (and sets its sampling state)."""
        n = int(self.model.share_prefix(slot, hashes, start))
        self._first[slot] = n
        return n

    def cache_prefix(self, slot: int, hashes: Sequence[bytes]) -> int:
        """Cache ``slot``'s written full blocks under ``hashes``; the blocks newly cached."""
        return int(self.model.cache_prefix(slot, hashes))

    def clear_prefix_cache(self) -> int:
        """Drop every cached block no row references (back to the free list); the count."""
        return int(self.model.blocks.clear_cache())

    @property
    def kv_blocks_cached(self) -> int:
        """KV blocks in the prefix cache (referenced by rows or idle)."""
        return int(self.model.blocks.cached)


async def _none() -> None:
    return None


def _sampled(tok: int, vals: Any, ids: Any, slot: int, n: int) -> Sampled:
    """``tok`` with row ``slot``'s log-probability and its top ``n`` alternatives (those that
    could be drawn: a grammar's masked tokens have ``-inf``, and JSON has no infinity)."""
    top = tuple((int(ids[slot, j]), float(vals[slot, 1 + j])) for j in range(n)
                if int(ids[slot, j]) >= 0 and math.isfinite(float(vals[slot, 1 + j])))
    return Sampled(tok, TokenLogprob(tok, float(vals[slot, 0]), top))


def _step_decode(model: Any) -> Any:
    """The model's batched decode step: ``decode_step``, or ``decode(slots, tokens, positions)``
    (the step API's name in :mod:`deviceops.nn.model`; the text ``decode(ids)`` takes one argument)."""
    for name in ("decode_step", "decode"):
        fn = getattr(model, name, None)
        if fn is None:
            continue
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            continue
        if "slots" in params and "positions" in params:
            return fn
    raise TypeError(
        f"Engine: {type(model).__name__} has no batched decode step (decode_step or "
        "decode(slots, tokens, positions)); pass a deviceops.nn CausalLM or a StepModel"
    )


def step_model(model: Any, *, max_batch: int, max_seq: int) -> CausalLMSteps:
    """A :class:`~.requests.StepModel` over ``model``'s KV cache slots.

    ``max_batch``/``max_seq`` are the engine's wishes; the engine lowers them to the
    model's cache (``model.max_batch`` rows of ``model.max_seq`` positions).
    """
    del max_batch, max_seq
    return CausalLMSteps(model)
