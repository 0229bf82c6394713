"""Static batches on one :class:`~deviceops.nn.CausalLM`: ``generate`` (blocking) and
``stream`` (async), what ``CausalLM.generate`` / ``CausalLM.stream`` run.

A static batch is fixed when it starts (the serving engine, :mod:`deviceops.nn.serving`,
batches continuously instead). Both run the model's step API (see
:mod:`deviceops.nn.runner.runner`): every prompt of a batch is prefilled
into its own cache row (slot ``i`` for prompt ``i``), then all unfinished rows decode
together, one token per step, through the decode graph of the smallest batch-size bucket
that holds them. A row stops at EOS or a ``stop`` id (included in its result), after
``max_new_tokens``, or when its cache row is full (``max_seq`` positions). Rows do not
influence each other, so a batch returns, row for row, what each prompt returns alone
(sampling too: every row uses ``seed`` and its own counter).

The only host synchronization of a step is reading the chosen tokens (``generate``
blocks on it; ``stream`` awaits it, so the event loop — asyncio or trio — keeps running),
and the device does not wait for it: step ``k + 1`` is enqueued (its rows feed the tokens
step ``k`` sampled, still on the device: ``decode_step`` with ``tokens=None``) before step
``k``'s tokens are read, so the GPU always has the next step queued while the host reads
and checks the last one. A row that turns out to have stopped at step ``k`` computed one
token more in step ``k + 1``, which is dropped (no row ever feeds a position at or past
``max_seq``, or more tokens than ``max_new_tokens``). On the ``cpu`` backend the host and the
"device" share the same cores and queuing ahead measured slower (three alternating runs
on 2 cores, SmolLM2 at batch 1: 11.7-14.1 tokens/s against 16.6-19.3): there each step's
tokens are read before the next step is enqueued (:data:`AHEAD_ON_CPU`).
Both run every op on the model's own stream (``model.device_stream``; ``stream`` schedules
its reads with ``model.policy``), never on the default policy's, so a model on one device
generates while the default device is another, and models on several devices generate
concurrently (one ``stream`` each, in one event loop).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ._args import check_sampling, check_stop

if TYPE_CHECKING:
    from deviceops import Tensor

    from .model import CausalLM

__all__ = ["AHEAD_ON_CPU", "generate", "stream"]

#: Queue the next step ahead on the ``cpu`` backend too (off: module docstring; the tests
#: turn it on to run that path without a GPU).
AHEAD_ON_CPU = False


def _one_prompt(model: CausalLM, p: Any, what: str) -> list[int]:
    if isinstance(p, str):
        ids = model.encode(p)
    elif isinstance(p, list | tuple | np.ndarray):
        ids = list(p)
    else:
        raise TypeError(f"{what}: a prompt must be a str or a list of token ids, got {type(p).__name__}")
    if not ids:
        raise ValueError(f"{what}: a prompt encodes to no tokens; give at least one")
    ids = model.runner.check_ids(ids, what)
    if len(ids) > model.max_seq:
        raise ValueError(f"{what}: a prompt of {len(ids)} tokens exceeds the model's max_seq="
                         f"{model.max_seq} (load it with a larger max_seq)")
    return ids


def prompts_of(model: CausalLM, prompt: Any, what: str) -> tuple[list[list[int]], bool]:
    """``(prompts as id lists, is_batch)``: a str or an id list is one prompt; a list of
    those is a batch."""
    if isinstance(prompt, str):
        return [_one_prompt(model, prompt, what)], False
    if isinstance(prompt, list | tuple) and prompt and all(
            isinstance(x, int | np.integer) and not isinstance(x, bool) for x in prompt):
        return [_one_prompt(model, list(prompt), what)], False
    if isinstance(prompt, list | tuple) and prompt:
        return [_one_prompt(model, p, what) for p in prompt], True
    raise TypeError(f"{what}: prompt must be a str, a list of token ids, or a non-empty list of "
                    f"those, got {type(prompt).__name__} {prompt!r:.60}")


class _Rows:
    """The host side of one batch: per-row outputs, positions and stop rules."""

    def __init__(self, model: CausalLM, prompts: list[list[int]], max_new: int, stop: set[int],
                 sampling: tuple[float, int, float, int], graph: bool | None) -> None:
        self.m = model
        self.prompts = prompts
        self.max_new = max_new
        self.stop = stop
        self.sampling = sampling
        self.graph = graph
        self.out: list[list[int]] = [[] for _ in prompts]
        self.done = [max_new == 0] * len(prompts)
        self.fed = [0] * len(prompts)  # tokens produced or in flight, per row

    def start(self) -> Tensor:
        """Prefill every row (slot i) and sample its first token; returns the token view."""
        t, k, p, sd = self.sampling
        for i, ids in enumerate(self.prompts):
            self.m.set_sampling(i, temperature=t, top_k=k, top_p=p, seed=sd)
            self.m.prefill(i, ids, 0, sample=True, graph=self.graph)
            self.fed[i] = 1
        return self.m.runner.rows.tokens[: len(self.prompts)]

    def accept(self, host: np.ndarray, rows: Sequence[int]) -> list[tuple[int, int]]:
        """Record the tokens of ``rows`` read from the device (a row already stopped: its
        token, computed ahead, is dropped); returns ``(row, token)`` pairs."""
        new = []
        for i in rows:
            if self.done[i]:
                continue
            tok = int(host[i])
            self.out[i].append(tok)
            new.append((i, tok))
            pos = len(self.prompts[i]) + len(self.out[i]) - 1  # where this token would be fed
            if tok in self.stop or len(self.out[i]) >= self.max_new or pos >= self.m.max_seq:
                self.done[i] = True
                self.m.release(i)
        return new

    def active(self) -> list[int]:
        return [i for i, d in enumerate(self.done) if not d]

    def close(self) -> None:
        """Release the rows still running (an error or an early stop): their KV blocks go back."""
        for i in self.active():
            self.done[i] = True
            self.m.release(i)

    def feedable(self, rows: Sequence[int]) -> list[int]:
        """The rows of ``rows`` that may take one more step: not stopped as far as the host
        knows, under ``max_new`` counting the tokens in flight, and a next position inside
        ``max_seq``."""
        return [i for i in rows if not self.done[i] and self.fed[i] < self.max_new
                and len(self.prompts[i]) + self.fed[i] - 1 < self.m.max_seq]

    def step_now(self, rows: list[int]) -> Tensor:
        """Enqueue one decode step of ``rows`` whose last tokens the host has read; returns
        the token view (the ``cpu`` backend's loop)."""
        pos = [len(self.prompts[i]) + len(self.out[i]) - 1 for i in rows]
        return self.m.decode_step(rows, [self.out[i][-1] for i in rows], pos, graph=self.graph)

    def step(self, rows: list[int], *, known: bool) -> Any:
        """Enqueue one decode step of ``rows`` and the read of its tokens; returns the read's
        future. ``known``: the rows' input tokens are on the host (the first step after
        prefill); else every row feeds what the previous step sampled (``tokens=None``)."""
        pos = [len(self.prompts[i]) + self.fed[i] - 1 for i in rows]
        if max(pos) >= self.m.max_seq:  # (feedable's rule; tokens=None skips decode_step's checks)
            raise RuntimeError(f"static batch: a step at position {max(pos)} >= max_seq="
                               f"{self.m.max_seq} was about to be queued")
        if known:
            view = self.m.decode_step(rows, [self.out[i][-1] for i in rows], pos, graph=self.graph)
        else:
            view = self.m.runner.decoder.step(rows, None, pos, self.graph)
        for i in rows:
            self.fed[i] += 1
        return self.m.read(view).schedule(self.m.policy)


def _setup(model: CausalLM, max_new_tokens: Any, temperature: Any, top_k: Any, top_p: Any,
           stop: Any, seed: Any, what: str) -> tuple[int, set[int], tuple[float, int, float, int]]:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer) or (
            max_new_tokens < 0):
        raise ValueError(f"{what}: max_new_tokens={max_new_tokens!r} must be an int >= 0")
    sampling = check_sampling(temperature, top_k, top_p, seed, what)
    if seed is None:
        sampling = (*sampling[:3], secrets.randbits(62))
    stops = set(model.config.stop_ids) | check_stop(stop, what)
    return int(max_new_tokens), stops, sampling


class _Busy:
    def __init__(self, model: CausalLM, what: str) -> None:
        self.m, self.what = model, what

    def __enter__(self) -> None:
        if self.m.runner.busy:
            raise RuntimeError(f"{self.what}: this model is already generating (one generate/stream "
                               "at a time per CausalLM; use deviceops.nn.Engine for concurrent requests)")
        self.m.runner.busy = True

    def __exit__(self, *exc: object) -> None:
        self.m.runner.busy = False


def generate(model: CausalLM, prompt: Any, max_new_tokens: int = 32, *, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, stop: Sequence[int] | None = None,
             seed: int | None = None, graph: bool | None = None) -> Any:
    """Generate new tokens for one prompt or a batch (blocking).

    Args:
        model: the model.
        prompt: a ``str``, a list of token ids, or a list of those (a batch).
        max_new_tokens: at most this many new tokens per prompt.
        temperature: 0 is greedy (argmax); otherwise softmax(logits / temperature).
        top_k: keep the k most likely tokens (``None``/0: off).
        top_p: keep the smallest set of most likely tokens whose mass reaches p (``None``/1: off).
        stop: ids that end a row (besides EOS); the stop id is included.
        seed: the random seed (``None``: a fresh one); a row's draws depend only on it.
        graph: replay CUDA graphs for prefill chunks and decode steps (default: on CUDA)
            or run eagerly.

    Returns:
        The new token ids (a list), or a list of such lists for a batch.
    """
    what = "generate"
    prompts, batch = prompts_of(model, prompt, what)
    max_new, stops, sampling = _setup(model, max_new_tokens, temperature, top_k, top_p, stop, seed, what)
    results: list[list[int]] = []
    s = model.device_stream
    with _Busy(model, what):
        for g in range(0, len(prompts), model.max_batch):
            rows = _Rows(model, prompts[g:g + model.max_batch], max_new, stops, sampling, graph)
            if max_new > 0:
                try:
                    view = rows.start()
                    rows.accept(model.read(view).sync_on(s), range(len(rows.prompts)))
                    ahead = AHEAD_ON_CPU or not model.device.is_cpu
                    if not ahead:  # (module docstring: no step queued ahead)
                        while act := rows.active():
                            view = rows.step_now(act)
                            rows.accept(model.read(view).sync_on(s), act)
                    cur = rows.feedable(rows.active()) if ahead else []
                    fut = rows.step(cur, known=True) if cur else None
                    while fut is not None:
                        nxt = rows.feedable(cur)  # (enqueued before this step's tokens are read)
                        fut_next = rows.step(nxt, known=False) if nxt else None
                        rows.accept(fut.result(), cur)
                        fut, cur = fut_next, nxt
                finally:
                    rows.close()
            results += rows.out
    return results if batch else results[0]


async def stream(model: CausalLM, prompt: Any, max_new_tokens: int = 32, *, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, stop: Sequence[int] | None = None,
                 seed: int | None = None, graph: bool | None = None) -> AsyncIterator[int]:
    """Async iterator of the new token ids of one prompt (asyncio or trio).

    Arguments as :func:`generate` (one prompt only). Each step's device work is awaited,
    so other tasks run while the GPU works.
    """
    what = "stream"
    prompts, batch = prompts_of(model, prompt, what)
    if batch:
        raise TypeError("stream: give one prompt (a str or a list of ids); for a batch use "
                        "generate, or one stream per prompt through deviceops.nn.Engine")
    max_new, stops, sampling = _setup(model, max_new_tokens, temperature, top_k, top_p, stop, seed, what)
    if max_new == 0:
        return
    # the token copies run on the model's own stream (where the tokens are produced), not on
    # a stream of the default policy, which may live on another device
    on_model = model.policy
    with _Busy(model, what):
        if not model.device.is_cpu and graph is not False and not model.runner.decoder.graphs:
            # the first capture compiles every kernel of a step (NVRTC, seconds on a fresh
            # machine): in a worker thread, so the event loop keeps running meanwhile
            import anyio.to_thread

            await anyio.to_thread.run_sync(model.capture_graphs)
        rows = _Rows(model, prompts, max_new, stops, sampling, graph)
        try:
            view = rows.start()
            for _, tok in rows.accept(await model.read(view).schedule(on_model), [0]):
                yield tok
            if not (AHEAD_ON_CPU or not model.device.is_cpu):  # (module docstring)
                while act := rows.active():
                    view = rows.step_now(act)
                    for _, tok in rows.accept(await model.read(view).schedule(on_model), act):
                        yield tok
                return
            cur = rows.feedable(rows.active())
            fut = rows.step(cur, known=True) if cur else None
            while fut is not None:
                nxt = rows.feedable(cur)  # (enqueued before this step's tokens are read)
                fut_next = rows.step(nxt, known=False) if nxt else None
                for _, tok in rows.accept(await fut, cur):
                    yield tok
                fut, cur = fut_next, nxt
        finally:
            rows.close()
