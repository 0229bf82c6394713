"""Continuous batching: :class:`Engine` serves many generation requests on one model.

Requests join and leave the running batch at every decode step. One engine *step* does:

1. **admit**: queued requests, in order, take a free batch row (*slot*,
   :class:`~.slots.SlotPool`; at most ``max_batch`` running at once) and, with a paged
   model (a step model with ``reserve``), the KV blocks of their whole budget,
   ``min(len(prompt) + max_new_tokens, max_seq)`` positions, **at admission**; a request
   whose blocks are not free waits at the head of the queue until finished requests give
   theirs back (so a running request never runs out of KV memory and nothing is
   preempted). Blocks go back when the request finishes or is cancelled;
2. **decode**: one token for every running request that has finished its prompt, as one
   batched model step (the model replays a captured decode graph per batch-size bucket),
   every step while any stream is running;
3. **prefill**: up to ``prefill_chunk`` prompt tokens of newly admitted requests, a long
   prompt in several chunks over several steps, so running streams keep a bounded
   inter-token latency; the last chunk of a prompt samples its first new token.

Steps 2 and 3 are *pipelined* when the step model has ``submit_decode``/``submit_prefill``
(``CausalLM`` does): the decode and the prompt chunks are all enqueued before the host
waits, once for the decode tokens (read ahead of the prefill work in stream order) and
then for the prompts' first tokens, so the device runs them back to back. With
**lookahead** (``lookahead=None``, the default, turns it on where the step model feeds
device-held tokens, as ``CausalLM`` does) a step is enqueued before the previous step's
tokens are read: each step enqueues its work, then delivers the previous one's tokens while
the device runs it (:mod:`.scheduler`). The model's
graphs (decode buckets, padded prefill lengths) are captured when the engine is built
(the step model's ``warmup``), never inside a request's step.

The queue, the running batch and the step itself (admit, decode, prefill, deliver) are the
engine's :class:`~.scheduler.Scheduler` (:attr:`Engine.scheduler`); the engine makes
requests, decides who drives the next step, and wakes the consumers.

There is no background task: whichever consumer is waiting for a token while no step is
running *drives* the next step (and hands the role to another waiting consumer when it has
its token), so the engine works under asyncio and trio alike without a task group, and
steps run exactly while someone is waiting for output. A step is shielded from
cancellation (its KV writes and sampled tokens must be accounted for); the GPU work is
awaited, so the event loop keeps running while a step is on the device, and the cpu
backend executes it on its stream worker threads.

**Failure.** By default a step that raises ends the requests it touched with that error
(``finish_reason == "error"``) and the engine goes on. With ``fail_stop=True`` (each
per-device engine of ``serve --devices``) a step that raises, or a prompt chunk that fails
with a device error (:class:`~deviceops.LaunchError` / :class:`~deviceops.DriverError`),
takes the engine out of service: every queued and running request ends with
:class:`EngineFailed` (its ``__cause__`` the step's error), :attr:`Engine.failure` holds it
and new requests are refused with it, so a router sends them to another device.

**Prefix caching** (on by default with a paged ``CausalLM``; ``prefix_cache=False`` turns it
off): full KV blocks are cached under the hash of their token prefix and a later request
whose prompt starts with the same full blocks shares them (reference-counted, read-only)
instead of prefilling them again; its prefill starts at the first uncached position, and
the block holding its last prompt token is always computed, so greedy outputs are the same
with and without the cache. Requests with one prompt start admitted together prefill the
shared blocks once (:mod:`.scheduler`). Cached blocks no request references are evicted,
least recently used first, when admission needs blocks; ``kv_blocks_in_use`` counts the
blocks requests reference, ``kv_blocks_cached`` the cache's, and the hit and miss counters
are prompt tokens (:class:`~.requests.EngineStats`). :meth:`Engine.clear_prefix_cache`
drops the idle ones.

The model side is the :class:`~.requests.StepModel` protocol (prefill a prompt chunk into a
slot, decode a set of slots, release a slot); :func:`~.step_model.step_model` adapts a
``CausalLM`` to it. Cancellation (``aclose()``, a cancelled consumer task, a dropped
stream) frees the request's slot at once, or at the end of the step in flight.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import anyio
import anyio.lowlevel

from .._args import check_adjustments, check_sampling, check_stop
from .grammar import GrammarCompiler
from .requests import (
    _DONE,
    _QUEUED,
    EngineClosed,
    EngineFailed,
    EngineOverloaded,
    EngineStats,
    RequestStream,
    SamplingParams,
    StepModel,
    _Request,
    check_kv_budget,
    prompt_ids,
)
from .scheduler import Scheduler

__all__ = [
    "Engine",
    "EngineClosed",
    "EngineFailed",
    "EngineOverloaded",
    "RequestStream",
    "SamplingParams",
    "StepModel",
]

log = logging.getLogger("deviceops.nn.engine")


def _is_batch(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and not isinstance(
        prompt[0], int
    )


class Engine:
    """Continuous-batching generation over one model's KV cache (module docstring).

    Args:
        model: a ``CausalLM`` (adapted with :func:`~.step_model.step_model`) or any
            :class:`StepModel`.
        max_batch: running requests at most (KV slots); lowered to the model's cache rows.
        max_seq: context per request (prompt plus new tokens); lowered to the model's.
        max_queue: requests waiting for a slot at most; beyond it :meth:`stream` raises
            :class:`EngineOverloaded` (or waits, with :meth:`submit` ``wait=True``).
            Default ``4 * max_batch``.
        prefill_chunk: prompt tokens prefilled per step (long prompts take several steps).
        fail_stop: a step that raises (a device error) takes the engine out of service
            instead of failing only that step's requests (module docstring, *Failure*);
            for engines behind a router that can send new requests elsewhere.
        prefix_cache: reuse the KV blocks of prompt prefixes computed before (module
            docstring, *Prefix caching*). ``None`` (default): on when the step model can
            (a paged ``CausalLM``); ``True``: on, ``ValueError`` when the step model cannot;
            ``False``: off (``serve --no-prefix-cache``).
        lookahead: enqueue each step before the previous one's tokens are read (module
            docstring). ``None`` (default): on when the step model feeds device-held tokens
            (a ``CausalLM``); ``True``: on, ``ValueError`` when it cannot; ``False``: off.

    Attributes:
        model, steps (the step model), scheduler (:class:`~.scheduler.Scheduler`: queue,
        running batch, slots, step), pool (its :class:`~.slots.SlotPool`), max_batch,
        max_seq, max_queue, prefill_chunk, fail_stop, prefix_cache (whether it is on).

    Example:
        >>> engine = Engine(deviceops.nn.smollm2(), max_batch=8)
        >>> ids = await engine.generate("The capital of France is", 8)
        >>> async for tok in engine.stream("Hello", 16, temperature=0.7, seed=1): ...
    """

    def __init__(
        self,
        model: Any,
        *,
        max_batch: int = 32,
        max_seq: int = 2048,
        max_queue: int | None = None,
        prefill_chunk: int = 512,
        fail_stop: bool = False,
        prefix_cache: bool | None = None,
        lookahead: bool | None = None,
    ) -> None:
        if isinstance(model, StepModel):
            steps: StepModel = model
        else:
            from .step_model import step_model

            steps = step_model(model, max_batch=max_batch, max_seq=max_seq)
        if max_batch <= 0 or max_seq <= 1 or prefill_chunk <= 0:
            raise ValueError(
                f"Engine: max_batch ({max_batch}), prefill_chunk ({prefill_chunk}) must be "
                f"positive and max_seq ({max_seq}) at least 2"
            )
        # the model's KV cache bounds both (a cpu CausalLM has 4 rows of 1024 by default)
        max_batch = min(max_batch, steps.max_batch)
        max_seq = min(max_seq, steps.max_seq)
        self.model = model
        self.steps = steps
        self.max_batch = int(max_batch)
        self.max_seq = int(max_seq)
        self.max_queue = int(max_queue) if max_queue is not None else 4 * self.max_batch
        self.prefill_chunk = int(prefill_chunk)
        self.fail_stop = bool(fail_stop)
        self._failure: EngineFailed | None = None
        can = hasattr(steps, "reserve") and all(
            hasattr(steps, n) for n in ("prefix_hashes", "share_prefix", "cache_prefix",
                                        "clear_prefix_cache"))
        if prefix_cache is True and not can:
            raise ValueError(f"Engine: prefix_cache=True, but {type(steps).__name__} has no "
                             "paged KV with prefix caching (reserve, prefix_hashes, "
                             "share_prefix, cache_prefix, clear_prefix_cache); pass "
                             "prefix_cache=None or False")
        self.prefix_cache = can if prefix_cache is None else bool(prefix_cache)
        self.scheduler = Scheduler(steps, max_batch=self.max_batch, max_seq=self.max_seq,
                                   prefill_chunk=self.prefill_chunk, fail_stop=self.fail_stop,
                                   notify=self._notify, space_freed=self._space_freed,
                                   fail=self._fail, prefix_cache=self.prefix_cache,
                                   lookahead=lookahead)
        self.pool = self.scheduler.pool
        self._queue = self.scheduler.queue
        self._active = self.scheduler.active  # hold slots: prefill or decode, admission order
        warm = getattr(steps, "warmup", None)
        if warm is not None:  # graphs captured here, not inside a request's step
            warm()
        self._grammars: GrammarCompiler | None = None  # built on the first grammar
        self._ids = itertools.count(1)
        self._waiting: set[_Request] = set()  # consumers parked on their event
        self._space: list[anyio.Event] = []  # submitters waiting for queue space
        self._driving = False
        self._closed = False
        #: called with every request that has new tokens or finished (after the engine's
        #: own wake-up): an owner that drives the engine itself (:meth:`run_step`, the
        #: engine core of :mod:`.core`) collects its news here
        self.listener: Callable[[_Request], None] | None = None

    # -- public -------------------------------------------------------------------------
    def stream(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 32,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        stop: Sequence[int] | None = None,
        seed: int | None = None,
        ignore_eos: bool = False,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        logit_bias: Any = None,
        logprobs: int | None = None,
        grammar: str | None = None,
    ) -> RequestStream:
        """Queue one request; return the async iterator of its new token ids.

        Same arguments as ``CausalLM.generate`` (one prompt); ``ignore_eos`` (for load
        tests) generates past EOS up to ``max_new_tokens``. OpenAI's ``presence_penalty`` /
        ``frequency_penalty`` (in [-2, 2], over the tokens generated so far), ``logit_bias``
        (token id -> bias in [-100, 100]) and ``logprobs`` (``None`` or 0..20 top
        alternatives; the stream's :attr:`~.requests.RequestStream.logprobs`) need a step
        model that declares them (``sampling_features``; a ``CausalLM`` does), and so does
        ``grammar`` (llguidance's formats, e.g. :func:`~.grammar.json_schema_grammar`): every
        token is drawn among those the grammar allows, and the request ends (``"stop"``) when
        the grammar is complete (:mod:`.grammar`; steps run in turn while such a request
        runs: :mod:`.scheduler`). Raises before
        queueing: ``ValueError``/``TypeError`` for bad arguments (a prompt longer than
        ``max_seq``, a feature the step model lacks), :class:`EngineOverloaded` when the
        admission queue is full, :class:`EngineClosed` after :meth:`close`.
        """
        req = self._make(prompt, max_new_tokens, temperature, top_k, top_p, stop, seed)
        pres, freq, bias, lp = check_adjustments(presence_penalty, frequency_penalty, logit_bias,
                                                 logprobs, self.steps.vocab_size, "Engine")
        if grammar is not None and not isinstance(grammar, str):
            raise TypeError(f"Engine: grammar must be a str (llguidance's formats: "
                            f"deviceops.nn.serving.grammar), got {type(grammar).__name__}")
        req.params = replace(req.params, presence_penalty=pres, frequency_penalty=freq,
                             logit_bias=bias, logprobs=lp, grammar=grammar)
        lacking = sorted(req.params.features() - self.sampling_features)
        if lacking:
            raise ValueError(f"Engine: {', '.join(lacking)} not supported by this model "
                             f"({type(self.steps).__name__} declares "
                             f"{sorted(self.sampling_features)})")
        if grammar is not None:
            req.grammar = self._grammar_compiler().matcher(grammar)
        req.ignore_eos = bool(ignore_eos)
        total = int(getattr(self.steps, "kv_blocks_total", 0)) if self.scheduler.reserve else 0
        check_kv_budget(len(req.prompt), req.max_new, self.max_seq, total, self.pool.block_size)
        if len(self._queue) >= self.max_queue:
            raise EngineOverloaded(
                f"Engine: admission queue full ({len(self._queue)} waiting, max_queue="
                f"{self.max_queue}, {len(self._active)} running); retry later or raise max_queue"
            )
        self._enqueue(req)
        return RequestStream(self, req)

    async def submit(
        self, prompt: str | Sequence[int], max_new_tokens: int = 32, *, wait: bool = True,
        **sampling: Any,
    ) -> RequestStream:
        """:meth:`stream`, but with ``wait=True`` waits for queue space instead of raising."""
        while True:
            try:
                return self.stream(prompt, max_new_tokens, **sampling)
            except EngineOverloaded:
                if not wait:
                    raise
            await self._wait_space()

    async def generate(
        self,
        prompt: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
        max_new_tokens: int = 32,
        **sampling: Any,
    ) -> Any:
        """Generate to the end; same arguments and result as ``CausalLM.generate``.

        A list of prompts returns a list of results (all queued at once; they share
        the running batch). Waits for queue space when the queue is full.
        """
        if _is_batch(prompt):
            streams = [await self.submit(p, max_new_tokens, **sampling) for p in prompt]  # type: ignore[arg-type]
            try:
                return [[t async for t in s] for s in streams]
            finally:
                for s in streams:
                    s.cancel()
        s = await self.submit(prompt, max_new_tokens, **sampling)  # type: ignore[arg-type]
        try:
            return [t async for t in s]
        finally:
            s.cancel()

    @property
    def sampling_features(self) -> frozenset[str]:
        """The optional sampling features the step model honours (``presence_penalty``,
        ``frequency_penalty``, ``logit_bias``, ``logprobs``, ``grammar``; its
        ``sampling_features``)."""
        return frozenset(getattr(self.steps, "sampling_features", ()))

    def _grammar_compiler(self) -> GrammarCompiler:
        """The model's :class:`~.grammar.GrammarCompiler`, built on the first grammar."""
        if self._grammars is None:
            steps: Any = self.steps
            self._grammars = GrammarCompiler(steps.grammar_tokenizer(), steps.vocab_size,
                                             steps.eos_ids)
        return self._grammars

    def stats(self) -> EngineStats:
        """Queue, batch and KV occupancy now, and counters since construction."""
        u = self.pool.usage()
        sc = self.scheduler
        blocks, total, cached = u.blocks_in_use, 0, 0
        if sc.reserve is not None:  # real block counts of the paged cache
            blocks = int(getattr(self.steps, "kv_blocks_in_use", blocks))
            total = int(getattr(self.steps, "kv_blocks_total", 0))
            cached = int(getattr(self.steps, "kv_blocks_cached", 0))
        return EngineStats(
            queued=len(self._queue),
            running=len(self._active),
            slots_in_use=u.slots_in_use,
            kv_tokens_in_use=u.tokens_in_use,
            kv_blocks_in_use=blocks,
            max_batch=self.max_batch,
            steps=sc.steps_run,
            decode_rows=sc.decode_rows,
            prefill_tokens=sc.prefill_tokens,
            generated_tokens=sc.generated,
            finished=sc.finished,
            cancelled=sc.cancelled,
            kv_blocks_total=total,
            pending_tokens=self.pending_tokens,
            kv_blocks_cached=cached,
            prefix_cache_hit_tokens=sc.prefix_hits,
            prefix_cache_miss_tokens=sc.prefix_misses,
            host_phases=tuple(sc.phase_s.items()),
        )

    def clear_prefix_cache(self) -> int:
        """Drop every cached KV block no running request references (they go back to the
        free list; blocks in use stay until their requests finish and are then cached as
        usual). Returns the blocks freed; 0 with prefix caching off."""
        if not self.prefix_cache:
            return 0
        return int(self.steps.clear_prefix_cache())  # type: ignore[attr-defined]

    @property
    def pending_tokens(self) -> int:
        """Work held, in tokens: for every queued or running request, the prompt tokens not
        yet prefilled plus the new tokens it may still generate (``max_new_tokens`` minus
        those generated; an upper bound, as a request may stop early at EOS or a stop id).

        The data-parallel router sends a request to the engine where this is smallest.
        """
        n = 0
        for req in itertools.chain(self._queue, self._active):
            if not req.cancelled:
                n += len(req.prompt) - req.prefilled + max(0, req.max_new - len(req.out))
        return n

    @property
    def failure(self) -> EngineFailed | None:
        """The error that took a ``fail_stop`` engine out of service, else ``None``."""
        return self._failure

    def close(self) -> None:
        """Refuse new requests and cancel every queued and running one (slots freed)."""
        self._closed = True
        for req in list(self._queue) + list(self._active):
            self._cancel(req)
        for ev in self._space:
            ev.set()

    @property
    def closed(self) -> bool:
        """True after :meth:`close`, or once a ``fail_stop`` engine has failed."""
        return self._closed

    def _fail(self, exc: BaseException) -> None:
        """Take the engine out of service after a failed step (``fail_stop``): every queued
        and running request ends with :class:`EngineFailed`, new ones are refused with it."""
        if self._failure is not None:
            return
        err = EngineFailed(
            f"Engine: a step failed ({type(exc).__name__}: {exc}); the engine is out of "
            "service and ended its queued and running requests (retry them on another device)"
        )
        err.__cause__ = exc
        self._failure = err
        self._closed = True
        log.error("engine on %s failed, out of service: %r",
                  getattr(self.model, "device", "its device"), exc)
        reqs = list(self._active) + list(self._queue)
        self._queue.clear()
        for req in reqs:
            err = EngineFailed(str(self._failure))  # one per request: each is raised once
            err.__cause__ = exc
            try:
                self.scheduler.finish(req, "error", err)
            except Exception:  # releasing the slot failed too: the request still ends
                log.exception("releasing request %d's slot after the engine failed", req.id)
                if req in self._active:
                    self._active.remove(req)
                req.state, req.finish_reason, req.error = _DONE, "error", err
                self.scheduler.finished += 1
                self._notify(req)
        for ev in self._space:
            ev.set()

    # -- requests -----------------------------------------------------------------------
    def _make(
        self, prompt: Any, max_new_tokens: int, temperature: float, top_k: int | None,
        top_p: float | None, stop: Sequence[int] | None, seed: int | None,
    ) -> _Request:
        if self._failure is not None:
            raise EngineFailed(str(self._failure)) from self._failure.__cause__
        if self._closed:
            raise EngineClosed("Engine: closed; it accepts no new requests")
        vocab = self.steps.vocab_size
        ids = prompt_ids(prompt, self.steps.encode, vocab, self.max_seq)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise TypeError(f"Engine: max_new_tokens must be an int, got {max_new_tokens!r}")
        if max_new_tokens < 0:
            raise ValueError(f"Engine: max_new_tokens must be >= 0, got {max_new_tokens}")
        # every sampling argument checked, each error naming it (deviceops.nn._args)
        t, k, p, sd = check_sampling(temperature, top_k, top_p, seed, "Engine")
        if k >= vocab:
            k = 0  # the whole vocabulary: off (and no int32 overflow on the device)
        # seed None: a fresh one, as CausalLM.generate does
        params = SamplingParams(t, k, p, secrets.randbits(62) if seed is None else sd)
        return _Request(
            id=next(self._ids), prompt=ids, max_new=max_new_tokens,
            params=params, stop=check_stop(stop, "Engine"),
            t_submit=time.perf_counter(),
        )

    def _enqueue(self, req: _Request) -> None:
        if req.max_new == 0:  # as CausalLM.generate: nothing to do
            self.scheduler.finish(req, "length")
            return
        self._queue.append(req)
        self._wake_driver()

    def _cancel(self, req: _Request) -> None:
        """Cancel ``req``: out of the queue at once; its slot freed now or after this step."""
        if req.state == _DONE:
            return
        req.cancelled = True
        if req.state == _QUEUED:
            self._queue.remove(req)
            self.scheduler.finish(req, "cancelled")
            self._space_freed()
        elif not self.scheduler.stepping:
            self.scheduler.finish(req, "cancelled")

    async def _wait_space(self) -> None:
        """Wait until the queue may have room; drive a step if nobody else does."""
        if not self._driving:
            try:
                await self.run_step()
            finally:
                self._wake_driver()
            await anyio.lowlevel.checkpoint()
            return
        ev = anyio.Event()
        self._space.append(ev)
        try:
            await ev.wait()
        finally:
            if ev in self._space:
                self._space.remove(ev)
                self._wake_driver()  # pass on a hand-over this waiter did not take

    def _space_freed(self) -> None:
        if self._space:
            self._space.pop(0).set()

    @property
    def has_work(self) -> bool:
        """Requests are queued or running: a step would do something."""
        return bool(self._queue or self._active)

    async def run_step(self) -> None:
        """Run one step now, for an owner that drives the engine itself instead of its
        consumers (the engine core of :mod:`.core`: nobody iterates a stream there, news
        goes to :attr:`listener`). Shielded from cancellation, as every step is.

        Raises:
            RuntimeError: a step is already running (the consumers drive this engine).
        """
        if self._driving:
            raise RuntimeError("Engine.run_step: a step is already running; an engine is "
                               "driven either by its consumers or by one owner, not both")
        self._driving = True
        try:
            with anyio.CancelScope(shield=True):
                await self.scheduler.step()
        finally:
            self._driving = False

    # -- driving ------------------------------------------------------------------------
    def _notify(self, req: _Request) -> None:
        ev = req.event
        if ev is not None:
            req.event = None
            self._waiting.discard(req)
            ev.set()
        if self.listener is not None:
            self.listener(req)

    def _wake_driver(self) -> None:
        """If nobody drives, wake one parked consumer that has no output to drive."""
        if self._driving:
            return
        for req in self._waiting:
            if not req.buf and not req.finished:
                self._notify(req)
                return
        if self._space:  # a submitter waiting for queue space can drive too
            self._space.pop(0).set()

    async def _progress(self, req: _Request) -> None:
        """Return once ``req`` has output or finished, driving steps while nobody else does."""
        if self._driving:
            ev = req.event = anyio.Event()
            self._waiting.add(req)
            try:
                await ev.wait()
            except BaseException:
                self._waiting.discard(req)
                req.event = None
                self._wake_driver()  # a consumer woken to drive but cancelled passes it on
                raise
            return
        self._driving = True
        try:
            while not req.buf and not req.finished:
                with anyio.CancelScope(shield=True):
                    await self.scheduler.step()
                if not self._active and not self._queue:
                    break
                await anyio.lowlevel.checkpoint_if_cancelled()
        finally:
            self._driving = False
            self._wake_driver()
