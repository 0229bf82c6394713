"""One step of :class:`~._engine.Engine`: admit, decode, prefill (see ``_engine``'s docstring).

:class:`_Stepping` holds the step methods; ``Engine`` inherits them. A step admits
queued requests into free slots (paged: with the KV blocks of their whole budget),
enqueues the batched decode and this step's prompt chunks, then waits for the decode
tokens and the prompts' first tokens and delivers them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from deviceops import DriverError, LaunchError

from ._kvpool import SlotPool
from ._requests import _DECODE, _PREFILL, StepModel, _Request

__all__: list[str] = []


class _Stepping:
    """The engine's step (a base of ``Engine``, which sets these attributes in ``__init__``)."""

    steps: StepModel
    fail_stop: bool
    max_seq: int
    prefill_chunk: int
    pool: SlotPool
    _reserve: Any
    _submit_decode: Callable[..., Callable[[], Awaitable[Any]]]
    _submit_prefill: Callable[..., Callable[[], Awaitable[Any]]]
    _queue: deque[_Request]
    _active: list[_Request]
    _stepping: bool
    _steps: int
    _decode_rows: int
    _prefill_tokens: int
    _generated: int

    if TYPE_CHECKING:  # Engine's
        def _finish(self, req: _Request, reason: str, error: BaseException | None = None) -> None: ...
        def _space_freed(self) -> None: ...
        def _notify(self, req: _Request) -> None: ...
        def _fail(self, exc: BaseException) -> None: ...

    async def _step(self) -> None:
        """Admit, decode one token for the running batch, prefill one chunk budget."""
        self._stepping = True
        try:
            for req in [r for r in self._active if r.cancelled]:
                self._finish(req, "cancelled")
            self._admit()
            if not self._active:
                return
            self._steps += 1
            try:
                await self._decode_and_prefill()
            except Exception as exc:  # a failed step fails every request it touched
                if self.fail_stop:  # ... and takes a fail-stop engine out of service
                    self._fail(exc)
                else:
                    for req in list(self._active):
                        self._finish(req, "error", exc)
        finally:
            self._stepping = False
        for req in [r for r in self._active if r.cancelled]:
            self._finish(req, "cancelled")

    def _admit(self) -> None:
        """Queued requests, in order, take a slot and (paged) their KV blocks."""
        while self._queue and self.pool.free:
            req = self._queue[0]
            if req.cancelled:
                self._queue.popleft()
                self._space_freed()
                self._finish(req, "cancelled")
                continue
            slot = self.pool.acquire()
            assert slot is not None
            if self._reserve is not None and not self._reserve(slot, self._budget(req)):
                self.pool.release(slot)
                if not self._active:  # nothing will give blocks back: it can never fit
                    self._queue.popleft()
                    self._space_freed()
                    self._finish(req, "error", RuntimeError(
                        f"Engine: request {req.id} needs KV blocks for {self._budget(req)} "
                        f"positions and no running request will free any ("
                        f"{getattr(self.steps, 'kv_blocks_in_use', '?')} blocks held outside "
                        "the engine?); release them or build the model with more kv_blocks"))
                    continue
                return  # wait for blocks (first come, first served)
            self._queue.popleft()
            self._space_freed()
            req.slot, req.state = slot, _PREFILL
            self._active.append(req)

    def _budget(self, req: _Request) -> int:
        return min(len(req.prompt) + req.max_new, self.max_seq)

    async def _decode_and_prefill(self) -> None:
        """Enqueue the decode step, then the prompt chunks of this step's budget, then wait:
        the device runs them back to back while the host waits once for the decode tokens
        (read before the prefill work in stream order) and then for the prompts' first
        tokens. A step model without ``submit_*`` runs them one after another."""
        rows = [r for r in self._active if r.state == _DECODE]
        dec = None
        if rows:
            dec = self._submit_decode(
                [r.slot for r in rows], [r.last for r in rows], [r.pos for r in rows]
            )
        chunks = self._submit_prefills()
        if dec is not None:
            toks = await dec()
            self._decode_rows += len(rows)
            for req, tok in zip(rows, toks, strict=True):
                req.pos += 1
                self._deliver(req, int(tok))
        for req, n, last, wait in chunks:
            try:
                tok = await wait()
            except Exception as exc:  # this request's prefill failed: only it ends
                if self._device_failed(exc):
                    raise  # ... unless the device did: the whole step fails
                self._finish(req, "error", exc)
                continue
            req.prefilled += n
            self._prefill_tokens += n
            if req.slot >= 0:
                self.pool.set_length(req.slot, req.prefilled)
            if last:
                if tok is None:
                    raise RuntimeError("StepModel.prefill(last=True) returned no token")
                req.state, req.pos = _DECODE, len(req.prompt)
                self._deliver(req, int(tok))

    def _submit_prefills(self) -> list[tuple[_Request, int, bool, Callable[[], Awaitable[Any]]]]:
        """Enqueue up to ``prefill_chunk`` prompt tokens of the requests being prefilled."""
        budget = self.prefill_chunk
        out: list[tuple[_Request, int, bool, Callable[[], Awaitable[Any]]]] = []
        for req in [r for r in self._active if r.state == _PREFILL]:
            if budget <= 0:
                break
            if req.cancelled:
                continue
            n = min(len(req.prompt) - req.prefilled, budget)
            start = req.prefilled
            last = start + n == len(req.prompt)
            try:
                wait = self._submit_prefill(
                    req.slot, req.prompt[start : start + n], start, req.params, last=last
                )
            except Exception as exc:  # refused before anything was enqueued: only it ends
                if self._device_failed(exc):
                    raise
                self._finish(req, "error", exc)
                continue
            budget -= n
            out.append((req, n, last, wait))
        return out

    def _device_failed(self, exc: BaseException) -> bool:
        """A fail-stop engine treats a launch or driver error of one request as the device's."""
        return self.fail_stop and isinstance(exc, (LaunchError, DriverError))

    def _deliver(self, req: _Request, tok: int) -> None:
        if req.cancelled:
            return
        now = time.perf_counter()
        if req.t_first is None:
            req.t_first = now
        req.out.append(tok)
        req.buf.append(tok)
        req.last = tok
        self._generated += 1
        self.pool.set_length(req.slot, req.pos)  # positions 0 .. pos-1 hold KV
        if (tok in self.steps.eos_ids and not req.ignore_eos) or tok in req.stop:
            self._finish(req, "stop")
        elif len(req.out) >= req.max_new or req.pos >= self.max_seq:  # no room to feed it
            self._finish(req, "length")
        else:
            self._notify(req)
