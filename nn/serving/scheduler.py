"""The engine's scheduler: the admission queue, the running batch and one step of it.

:class:`Scheduler` is owned by an :class:`~.engine.Engine` (whose docstring describes a
step). It holds the queued and running requests, the batch rows (:class:`~.slots.SlotPool`)
and the step model, and runs a step: admit queued requests into free slots (paged: with
the KV blocks of their whole budget), enqueue the batched decode and this step's prompt
chunks, then wait for the decode tokens and the prompts' first tokens and deliver them. It
tells the engine, through the callbacks it is built with, when a request has news for its
consumer, when the queue has room, and when a fail-stop step failed.

**Lookahead** (a step model with ``device_fed``, ``lookahead`` on): step k+1's decode and
prompt chunks are enqueued *before* the host reads step k's tokens; each decode row feeds
the token still on the device (the one its previous decode step or its prompt's last chunk
sampled), and the step then delivers step k's tokens while the device runs step k+1, so the
device never waits for the host's admit, enqueue and delivery. A row is fed ahead unless the
tokens already delivered or in flight reach its ``max_new_tokens`` or the context; a row
that ends at a stop token or EOS costs one extra row-step whose token is dropped (and whose
KV write lands in its own, by then released, blocks, before any later write to them in
stream order). A request finished between a step's enqueue and its delivery (cancelled, a
stop) has its in-flight token dropped.

**Prompt chunks** are planned each step in admission order under the ``prefill_chunk``
token budget and enqueued together when the step model packs them (``submit_prefills``: the
short ones of rows without features in one forward pass); a refused packed call is retried
chunk by chunk, so only a bad chunk's request fails; a constrained request's last chunk
(it draws under its grammar's first mask) makes the step's chunks go one by one.

**Prefix caching** (a step model with ``prefix_hashes``/``share_prefix``/``cache_prefix``,
``prefix_cache`` on): at admission a request's row points at the cached blocks of its
prompt's longest cached full-block prefix (never the block holding its last prompt token,
so its first token is sampled from logits computed now) and reserves only the rest of its
budget. Each prompt chunk's full blocks are cached as soon as the chunk is enqueued (the
stream orders any later read after the write), and the chunk budget goes to the requests
in admission order, so when a request's first chunk comes every earlier request has
enqueued its whole prompt: the request looks the cache up again then and shares what they
cached (its unwritten reserved blocks there go back); planned chunks filling blocks it could
share are enqueued (and cached) before it looks. ``n`` choices of one prompt, or many
clients with one system prompt admitted together, prefill the shared blocks once. A
finished request's written full blocks (prompt and generated tokens) stay cached; a failed
prefill or step empties the cache.

**Grammars** (requests with ``params.grammar``, :mod:`.grammar`): a constrained row's mask
for its next draw needs the token it drew last on the host, but its forward pass does not.
With lookahead, a step that feeds constrained rows is enqueued in two (the step model's
``begin_decode``): its forward pass first (every row feeding its device-held token, as
above), then, while the device runs it, the previous step's tokens are delivered (each
constrained row's matcher advances), the constrained rows' bitmasks are filled together
(:class:`~.grammar.MaskBatch`) and uploaded, and the sampling and the step's prompt chunks
are enqueued after them. A row that ended at delivery (a completed grammar, a stop) is
sampled once more and its token dropped, as any row fed ahead. Without lookahead (or a step
model without ``begin_decode``), while any running request has a grammar steps run in turn
(the step in flight, if any, delivered first), the masks asked for once each step's forward
pass is enqueued (``submit_decode``'s ``masks``), so they are filled while the device runs
it. A constrained request's last prompt chunk carries the grammar's first mask. Every delivered token
advances the request's matcher, and a completed grammar ends the request (``"stop"``).
Unconstrained rows draw exactly the tokens they would have drawn without the constrained
ones (rows are independent; only the order of enqueues and reads changes).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from deviceops import DriverError, LaunchError

from .grammar import MaskBatch
from .requests import _DECODE, _DONE, _PREFILL, StepModel, _Request
from .slots import SlotPool

__all__ = ["PHASES", "Scheduler"]

#: The phases of a step, in order, as :attr:`Scheduler.phase_s` names them.
PHASES = ("admit", "enqueue", "wait", "deliver")

Submit = Callable[..., Callable[[], Awaitable[Any]]]


def _lazy(fn: Callable[..., Awaitable[Any]]) -> Submit:
    """A ``submit_*`` over a plain async step method: it runs when its result is awaited."""

    def submit(*args: Any, **kw: Any) -> Callable[[], Awaitable[Any]]:
        return lambda: fn(*args, **kw)

    return submit


class _Inflight:
    """A lookahead step's enqueued work: the decode rows and their tokens' awaitable, and the
    prompt chunks (request, tokens, last chunk, awaitable of its first token)."""

    __slots__ = ("chunks", "decode", "rows")

    def __init__(self, rows: list[_Request], decode: Callable[[], Awaitable[Any]] | None,
                 chunks: list[tuple[_Request, int, bool, Callable[[], Awaitable[Any]]]]) -> None:
        self.rows = rows
        self.decode = decode
        self.chunks = chunks


class Scheduler:
    """Queue, running batch and step of one engine (module docstring).

    Args:
        steps: the step model.
        max_batch, max_seq, prefill_chunk, fail_stop, prefix_cache: the engine's.
        lookahead: enqueue each step before delivering the previous one (module docstring);
            ``None``: where the step model has ``device_fed``.
        notify: called with a request that has new tokens or finished.
        space_freed: called when a request left the queue (room for a waiting submitter).
        fail: called with the error of a failed step of a ``fail_stop`` engine.

    Attributes:
        queue: requests waiting for a slot, in order.
        active: requests holding a slot (prefill or decode), in admission order.
        pool: the batch rows.
        stepping: a step is running.
        lookahead: steps are enqueued one ahead of their delivery (module docstring).
        submit_decode, submit_prefill: the step model's pipelined step calls (or lazy ones
            over its plain async methods).
        reserve: the step model's ``reserve`` (paged KV), or ``None``.
        steps_run, decode_rows, prefill_tokens, generated, finished, cancelled: counters.
        prefix: prefix caching is on; prefix_hits, prefix_misses: prompt tokens taken from
            the cache / prefilled by the requests that looked it up.
        phase_s: host seconds spent so far in each phase of the steps, by name
            (:data:`PHASES`: ``admit``, ``enqueue`` (building and launching the decode and
            prompt chunks), ``wait`` (awaiting the device's results), ``deliver`` (handing
            tokens to requests)); what ``serve``'s per-step profile reports.
    """

    def __init__(self, steps: StepModel, *, max_batch: int, max_seq: int, prefill_chunk: int,
                 fail_stop: bool, notify: Callable[[_Request], None],
                 space_freed: Callable[[], None], fail: Callable[[BaseException], None],
                 prefix_cache: bool = False, lookahead: bool | None = None) -> None:
        self.steps = steps
        self.max_seq = max_seq
        self.prefill_chunk = prefill_chunk
        self.fail_stop = fail_stop
        self._notify = notify
        self._space_freed = space_freed
        self._fail = fail
        self.reserve = getattr(steps, "reserve", None)  # paged KV: blocks at admission
        self.submit_decode: Submit = getattr(steps, "submit_decode", None) or _lazy(steps.decode_step)
        self.submit_prefill: Submit = getattr(steps, "submit_prefill", None) or _lazy(steps.prefill)
        block = int(getattr(steps, "kv_block_size", 16))
        self.block = block
        self.pool = SlotPool(max_batch, max_seq, block_size=block)
        #: prefix caching is on (module docstring); the caller checked the step model has it
        self.prefix = bool(prefix_cache)
        self.prefix_hits = self.prefix_misses = 0  # prompt tokens: from the cache / prefilled
        self.queue: deque[_Request] = deque()
        self.active: list[_Request] = []
        self.stepping = False
        self.steps_run = self.decode_rows = self.prefill_tokens = 0
        self.generated = self.finished = self.cancelled = 0
        self.phase_s = dict.fromkeys(PHASES, 0.0)
        can = bool(getattr(steps, "device_fed", False))
        if lookahead and not can:
            raise ValueError(f"Engine: lookahead needs a step model that feeds device-held "
                             f"tokens (device_fed); {type(steps).__name__} does not")
        #: lookahead steps (module docstring): on by default where the step model can
        self.lookahead = can if lookahead is None else bool(lookahead)
        #: lookahead: the last step's enqueued work, delivered by the next step
        self._inflight: _Inflight | None = None
        #: grammars (module docstring): the step's bitmasks (made on the first constrained
        #: step), and the host seconds / row masks spent filling them
        self._masks: MaskBatch | None = None
        self.grammar_s = 0.0
        self.grammar_masks = 0
        #: called once a step's device work is enqueued, before the host waits for it: an
        #: owner's host work that can overlap the device (an engine core sends the previous
        #: step's tokens here)
        self.on_enqueued: Callable[[], None] | None = None

    def budget(self, req: _Request) -> int:
        """Positions ``req`` may fill: its prompt plus ``max_new_tokens``, within ``max_seq``."""
        return min(len(req.prompt) + req.max_new, self.max_seq)

    def finish(self, req: _Request, reason: str, error: BaseException | None = None) -> None:
        """End ``req`` (its slot and KV blocks freed) and tell its consumer."""
        if req.state == _DONE:
            return
        if req.slot >= 0:
            if self.prefix and reason != "error":
                self._cache_written(req)
            self.steps.release(req.slot)
            self.pool.release(req.slot)
            req.slot = -1
            self.active.remove(req)
        req.state = _DONE
        req.finish_reason = reason
        req.error = error
        if reason == "cancelled":
            self.cancelled += 1
        else:
            self.finished += 1
        self._notify(req)

    async def step(self) -> None:
        """Admit, decode one token for the running batch, prefill one chunk budget."""
        self.stepping = True
        try:
            t0 = time.perf_counter()
            for req in [r for r in self.active if r.cancelled]:
                self.finish(req, "cancelled")
            self._admit()
            self.phase_s["admit"] += time.perf_counter() - t0
            if not self.active:
                self._inflight = None  # every request in flight has ended: tokens dropped
                return
            self.steps_run += 1
            try:
                if self.lookahead and not self._constrained():
                    await self._step_ahead()
                elif self.lookahead and getattr(self.steps, "begin_decode", None) is not None:
                    await self._step_ahead_masked()
                else:
                    if self._inflight is not None:  # a grammar joined: deliver, then in turn
                        prev, self._inflight = self._inflight, None
                        await self._deliver_step(prev)
                    await self._decode_and_prefill()
            except Exception as exc:  # a failed step fails every request it touched
                self._inflight = None
                self._forget_prefixes()  # ... and what it cached may be wrong
                if self.fail_stop:  # ... and takes a fail-stop engine out of service
                    self._fail(exc)
                else:
                    for req in list(self.active):
                        self.finish(req, "error", exc)
        finally:
            self.stepping = False
        for req in [r for r in self.active if r.cancelled]:
            self.finish(req, "cancelled")

    def _admit(self) -> None:
        """Queued requests, in order, take a slot and (paged) their KV blocks."""
        while self.queue and self.pool.free:
            req = self.queue[0]
            if req.cancelled:
                self.queue.popleft()
                self._space_freed()
                self.finish(req, "cancelled")
                continue
            slot = self.pool.acquire()
            assert slot is not None
            shared = 0
            if self.prefix:
                if not req.hashes:
                    req.hashes = self.steps.prefix_hashes(req.prompt)  # type: ignore[attr-defined]
                shared = self.steps.share_prefix(slot, self._shareable(req), 0)  # type: ignore[attr-defined]
            if self.reserve is not None and not self.reserve(slot, self.budget(req)):
                if self.prefix:
                    self.steps.release(slot)  # the cached blocks it pointed at
                self.pool.release(slot)
                if not self.active:  # nothing will give blocks back: it can never fit
                    self.queue.popleft()
                    self._space_freed()
                    self.finish(req, "error", RuntimeError(
                        f"Engine: request {req.id} needs KV blocks for {self.budget(req)} "
                        f"positions and no running request will free any ("
                        f"{getattr(self.steps, 'kv_blocks_in_use', '?')} blocks held outside "
                        "the engine?); release them or build the model with more kv_blocks"))
                    continue
                return  # wait for blocks (first come, first served)
            self.queue.popleft()
            self._space_freed()
            req.slot, req.state, req.prefilled = slot, _PREFILL, shared
            self.active.append(req)

    async def _decode_and_prefill(self) -> None:
        """Enqueue the decode step, then the prompt chunks of this step's budget, then wait:
        the device runs them back to back while the host waits once for the decode tokens
        (read before the prefill work in stream order) and then for the prompts' first
        tokens. A step model without ``submit_*`` runs them one after another."""
        phase = self.phase_s
        t0 = time.perf_counter()
        rows = [r for r in self.active if r.state == _DECODE]
        dec = None
        if rows:
            kw = self._mask_source(rows)
            dec = self.submit_decode(
                [r.slot for r in rows], [r.last for r in rows], [r.pos for r in rows], **kw
            )
        chunks = self._submit_prefills()
        t1 = time.perf_counter()
        phase["enqueue"] += t1 - t0
        if self.on_enqueued is not None:
            self.on_enqueued()
            t1 = time.perf_counter()
        if dec is not None:
            toks = await dec()
            t2 = time.perf_counter()
            phase["wait"] += t2 - t1
            self.decode_rows += len(rows)
            eos, now = self.steps.eos_ids, time.perf_counter()
            for req, tok in zip(rows, toks, strict=True):
                req.pos += 1
                self._deliver(req, tok, eos, now)
            t1 = time.perf_counter()
            phase["deliver"] += t1 - t2
        for req, n, last, wait in chunks:
            try:
                tok = await wait()
            except Exception as exc:  # this request's prefill failed: only it ends
                if self._device_failed(exc):
                    raise  # ... unless the device did: the whole step fails
                self._forget_prefixes()  # its blocks were cached when enqueued
                self.finish(req, "error", exc)
                continue
            self.prefill_tokens += n
            if req.slot >= 0:
                self.pool.set_length(req.slot, req.prefilled)
            if last:
                if tok is None:
                    raise RuntimeError("StepModel.prefill(last=True) returned no token")
                req.state, req.pos = _DECODE, len(req.prompt)
                self._deliver(req, tok, self.steps.eos_ids, time.perf_counter())
        if chunks:
            phase["wait"] += time.perf_counter() - t1

    async def _step_ahead(self) -> None:
        """Lookahead (module docstring): enqueue this step's decode (device-fed tokens) and
        prompt chunks, then deliver the previous step's tokens while the device runs it."""
        phase = self.phase_s
        t0 = time.perf_counter()
        rows, pos = self._ahead_rows()
        dec = None
        if rows:
            dec = self.submit_decode([r.slot for r in rows], None, pos)
            for r in rows:
                r.fed += 1
        chunks = self._submit_prefills()
        for req, _n, last, _wait in chunks:
            if last:
                req.primed = True
        prev, self._inflight = self._inflight, _Inflight(rows, dec, chunks)
        t1 = time.perf_counter()
        phase["enqueue"] += t1 - t0
        if prev is None:
            if dec is None and not chunks:
                raise RuntimeError(
                    "Scheduler: a lookahead step found nothing to enqueue or deliver with "
                    f"{len(self.active)} requests active (states "
                    f"{sorted({r.state for r in self.active})}); this is a bug")
            return
        if self.on_enqueued is not None:
            self.on_enqueued()
        await self._deliver_step(prev)

    def _ahead_rows(self) -> tuple[list[_Request], list[int]]:
        """The rows a lookahead step feeds (their device-held tokens) and their positions."""
        rows: list[_Request] = []
        pos: list[int] = []
        for r in self.active:
            if r.cancelled:
                continue
            if r.state == _DECODE:
                p, n = r.pos + r.fed, len(r.out) + r.fed
            elif r.primed:  # its first token is on the device, to be fed after the prompt
                p, n = len(r.prompt), 1
            else:
                continue
            if n < r.max_new and p < self.max_seq:  # else it ends by length: no step ahead
                rows.append(r)
                pos.append(p)
        return rows, pos

    async def _step_ahead_masked(self) -> None:
        """Lookahead with grammars (module docstring): enqueue this step's forward pass
        (device-fed tokens), deliver the previous step's tokens (advancing the matchers)
        while the device runs it, then fill and upload the constrained rows' masks and
        enqueue the sampling and this step's prompt chunks."""
        rows, pos = self._ahead_rows()
        reqs = [r for r in rows if r.grammar is not None]
        if not reqs:  # no constrained row is fed in this step: a plain lookahead step
            await self._step_ahead()
            return
        phase = self.phase_s
        t0 = time.perf_counter()
        held = [r.slot for r in reqs]  # (a request ended at delivery has let its slot go)
        finish = self.steps.begin_decode(  # type: ignore[attr-defined]
            [r.slot for r in rows], pos, lambda: (held, self._fill(reqs)))
        for r in rows:
            r.fed += 1
        prev, self._inflight = self._inflight, None
        phase["enqueue"] += time.perf_counter() - t0
        try:
            if prev is not None:
                await self._deliver_step(prev)  # the tokens the masks follow from
        finally:
            t0 = time.perf_counter()
            dec = finish()  # masks filled and uploaded, the sampling enqueued
            chunks = self._submit_prefills()
            for req, _n, last, _wait in chunks:
                if last:
                    req.primed = True
            self._inflight = _Inflight(rows, dec, chunks)
            phase["enqueue"] += time.perf_counter() - t0
        if self.on_enqueued is not None:
            self.on_enqueued()

    async def _deliver_step(self, prev: _Inflight) -> None:
        """Wait for an enqueued step's decode tokens and first tokens and hand them over
        (requests that ended meanwhile drop theirs)."""
        phase = self.phase_s
        t1 = time.perf_counter()
        if prev.decode is not None:
            toks = await prev.decode()
            t2 = time.perf_counter()
            phase["wait"] += t2 - t1
            self.decode_rows += len(prev.rows)
            eos, now = self.steps.eos_ids, time.perf_counter()
            for req, tok in zip(prev.rows, toks, strict=True):
                req.fed -= 1
                if req.state == _DONE:
                    continue
                req.pos += 1
                self._deliver(req, tok, eos, now)
            t1 = time.perf_counter()
            phase["deliver"] += t1 - t2
        for req, n, last, wait in prev.chunks:
            try:
                tok = await wait()
            except Exception as exc:  # this request's prefill failed: only it ends
                if self._device_failed(exc):
                    raise  # ... unless the device did: the whole step fails
                self._forget_prefixes()
                self.finish(req, "error", exc)
                continue
            if req.state == _DONE:
                continue
            self.prefill_tokens += n
            self.pool.set_length(req.slot, req.prefilled)
            if last:
                if tok is None:
                    raise RuntimeError("StepModel.prefill(last=True) returned no token")
                req.state, req.pos, req.primed = _DECODE, len(req.prompt), False
                self._deliver(req, tok, self.steps.eos_ids, time.perf_counter())
        if prev.chunks:
            phase["wait"] += time.perf_counter() - t1

    def _submit_prefills(self) -> list[tuple[_Request, int, bool, Callable[[], Awaitable[Any]]]]:
        """Enqueue up to ``prefill_chunk`` prompt tokens of the requests being prefilled, in
        admission order: together when the step model packs chunks (``submit_prefills``),
        else one chunk at a time. With prefix caching, a chunk's full blocks are cached once
        it is enqueued, and a request about to look the cache up first has the planned chunks
        that fill blocks it could share enqueued, so it shares them (module docstring)."""
        budget = self.prefill_chunk
        out: list[tuple[_Request, int, bool, Callable[[], Awaitable[Any]]]] = []
        plan: list[tuple[_Request, int, int, bool]] = []  # request, start, tokens, last
        fills: set[bytes] = set()  # block hashes the planned chunks will cache
        for req in [r for r in self.active if r.state == _PREFILL]:
            if budget <= 0:
                break
            if req.cancelled or req.primed:  # (primed: its whole prompt is enqueued)
                continue
            if self.prefix and not req.started:
                if fills and not fills.isdisjoint(self._shareable(req)):
                    out += self._enqueue_plan(plan)
                    plan, fills = [], set()
                self._share_first(req)
            req.started = True
            n = min(len(req.prompt) - req.prefilled, budget)
            start = req.prefilled
            plan.append((req, start, n, start + n == len(req.prompt)))
            budget -= n
            req.prefilled = start + n  # the next chunk starts after it
            if self.prefix:
                fills.update(req.hashes[start // self.block:(start + n) // self.block])
        return out + self._enqueue_plan(plan)

    def _enqueue_plan(self, plan: list[tuple[_Request, int, int, bool]]
                      ) -> list[tuple[_Request, int, bool, Callable[[], Awaitable[Any]]]]:
        """Enqueue the planned chunks; cache the full blocks each enqueued one filled; a chunk
        refused before anything was enqueued ends its request."""
        out: list[tuple[_Request, int, bool, Callable[[], Awaitable[Any]]]] = []
        bs = self.block
        for (req, start, n, last), wait in zip(plan, self._enqueue_chunks(plan), strict=True):
            if isinstance(wait, BaseException):
                self.finish(req, "error", wait)
                continue
            out.append((req, n, last, wait))
            if self.prefix and (start + n) // bs > start // bs:  # blocks it filled: cached now
                self.steps.cache_prefix(req.slot, req.hashes[:(start + n) // bs])  # type: ignore[attr-defined]
        return out

    def _enqueue_chunks(self, plan: list[tuple[_Request, int, int, bool]]
                        ) -> list[Callable[[], Awaitable[Any]] | BaseException]:
        """Each planned chunk's awaitable of its token, or the error that refused it; a
        refused packed call is retried chunk by chunk so only the bad chunk fails."""
        many = getattr(self.steps, "submit_prefills", None)
        items = [(r.slot, r.prompt[st:st + n], st, r.params, last) for r, st, n, last in plan]
        # (a constrained request's last chunk draws under its grammar's mask: one by one)
        masked = any(last and r.grammar is not None for r, _st, _n, last in plan)
        if many is not None and len(items) > 1 and not masked:
            try:
                return list(many(items))
            except Exception as exc:
                if self._device_failed(exc):
                    raise
        out: list[Callable[[], Awaitable[Any]] | BaseException] = []
        for (req, *_), (slot, ids, st, params, last) in zip(plan, items, strict=True):
            try:
                kw = {"mask": self._mask_of(req)} if last and req.grammar is not None else {}
                out.append(self.submit_prefill(slot, ids, st, params, last=last, **kw))
            except Exception as exc:
                if self._device_failed(exc):
                    raise
                out.append(exc)
        return out

    # -- grammars (module docstring) --------------------------------------------------------
    def _constrained(self) -> bool:
        """Some running request has a grammar (steps then run in turn)."""
        return any(r.grammar is not None for r in self.active)

    def _fill(self, reqs: list[_Request]) -> Any:
        """The bitmasks of ``reqs``' next draws, filled together (host time counted)."""
        t0 = time.perf_counter()
        if self._masks is None:
            self._masks = MaskBatch(self.pool.n_slots, self.steps.vocab_size)
        out = self._masks.fill([r.grammar for r in reqs])
        self.grammar_s += time.perf_counter() - t0
        self.grammar_masks += len(reqs)
        return out

    def _mask_of(self, req: _Request) -> Any:
        """The bitmask of a constrained request's first token (a copy: one row)."""
        return self._fill([req])[0].copy()

    def _mask_source(self, rows: list[_Request]) -> dict[str, Any]:
        """``submit_decode``'s ``masks`` for a step with constrained rows (none without): the
        step model asks for them once the forward pass is enqueued, so they are filled
        while the device runs it."""
        reqs = [r for r in rows if r.grammar is not None]
        if not reqs:
            return {}
        return {"masks": lambda: ([r.slot for r in reqs], self._fill(reqs))}

    # -- prefix caching (module docstring) ------------------------------------------------
    def _shareable(self, req: _Request) -> list[bytes]:
        """The prompt's block hashes a request may share: every full block but one holding
        its last prompt token (that token's logits are computed, not cached)."""
        return req.hashes[:(len(req.prompt) - 1) // self.block]

    def _share_first(self, req: _Request) -> None:
        """Before ``req``'s first chunk: share what is cached now. The chunk budget goes to
        the requests in admission order, so every earlier request has enqueued its whole
        prompt by now and its full blocks are cached: a request admitted together with
        others of the same prompt start shares their blocks instead of prefilling them."""
        req.prefilled = self.steps.share_prefix(req.slot, self._shareable(req), req.prefilled)  # type: ignore[attr-defined]
        self.pool.set_length(req.slot, req.prefilled)
        self.prefix_hits += req.prefilled
        self.prefix_misses += len(req.prompt) - req.prefilled

    def _cache_written(self, req: _Request) -> None:
        """Cache the full blocks ``req``'s row has written (prompt and generated tokens)."""
        n = req.pos if req.state == _DECODE else req.prefilled
        toks = (req.prompt + req.out)[:n]
        self.steps.cache_prefix(req.slot, self.steps.prefix_hashes(toks, req.hashes))  # type: ignore[attr-defined]

    def _forget_prefixes(self) -> None:
        """Empty the prefix cache (after a failure its blocks may hold wrong keys)."""
        if self.prefix:
            self.steps.clear_prefix_cache()  # type: ignore[attr-defined]

    def _device_failed(self, exc: BaseException) -> bool:
        """A fail-stop engine treats a launch or driver error of one request as the device's."""
        return self.fail_stop and isinstance(exc, (LaunchError, DriverError))

    def _deliver(self, req: _Request, sampled: Any, eos: frozenset[int], now: float) -> None:
        """Hand ``sampled`` (an int, or a :class:`~.requests.Sampled` with its log-probabilities)
        to ``req``'s consumer and end the request at EOS, a stop id or its length."""
        if req.cancelled:
            return
        tok = int(sampled)
        if req.t_first is None:
            req.t_first = now
        if req.params.logprobs is not None:
            req.logprobs.append(getattr(sampled, "logprobs", None))
        req.out.append(tok)
        req.buf.append(tok)
        req.last = tok
        self.generated += 1
        self.pool.set_length(req.slot, req.pos)  # positions 0 .. pos-1 hold KV
        ended = None if req.grammar is None else req.grammar.advance(tok)
        if ended == "error":
            self.finish(req, "error", RuntimeError(
                f"Engine: request {req.id}'s grammar failed at token {tok}: "
                f"{req.grammar.error or 'the token is not allowed'}"))
        elif ended == "stop" or (tok in eos and not req.ignore_eos) or tok in req.stop:
            self.finish(req, "stop")
        elif len(req.out) >= req.max_new or req.pos >= self.max_seq:  # no room to feed it
            self.finish(req, "length")
        else:
            self._notify(req)
