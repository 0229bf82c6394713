"""Adapts a ``CausalLM`` to the engine's :class:`~.requests.StepModel` protocol.

The model's step API (documented in :mod:`deviceops.nn.runner.runner`) enqueues on ``model.device_stream``
and returns token views without waiting; this adapter awaits the host copy of the
sampled tokens as a :class:`~deviceops.DeviceFuture` scheduled on that same stream, so
the event loop runs while the step is on the device (or on the cpu backend's worker
thread). Prefill chunks that sample nothing are enqueued and not awaited: the next op on
the stream is ordered after them.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from deviceops.scheduling import SingleStream

from .requests import SamplingParams

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
        self._decode = _step_decode(model)
        self._policy = SingleStream(model.device_stream)
        self._eos = frozenset(int(t) for t in model.config.stop_ids)

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
                       *, last: bool) -> Callable[[], Awaitable[int | None]]:
        """Enqueue a prefill chunk now; the returned callable awaits its token (``last``)."""
        m = self.model
        if start == 0:
            m.set_sampling(slot, temperature=params.temperature, top_k=params.top_k,
                           top_p=params.top_p, seed=params.seed)
        view = m.prefill(slot, list(ids), start, sample=last)
        if not last:
            return _none
        fut = m.read(view).schedule(self._policy)

        async def token() -> int | None:
            host = await fut
            return int(host[0])

        return token

    def submit_decode(self, slots: Sequence[int], tokens: Sequence[int],
                      positions: Sequence[int]) -> Callable[[], Awaitable[list[int]]]:
        """Enqueue a decode step now; the returned callable awaits the rows' tokens."""
        m = self.model
        rows = list(slots)
        view = self._decode(rows, list(tokens), list(positions))
        fut = m.read(view).schedule(self._policy)

        async def result() -> list[int]:
            host = await fut
            return [int(host[s]) for s in rows]

        return result

    def release(self, slot: int) -> None:
        self.model.release(slot)

    def warmup(self) -> None:
        """Capture the model's decode and prefill graphs (no-op where it uses none)."""
        cap = getattr(self.model, "capture_graphs", None)
        if cap is not None:
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


async def _none() -> None:
    return None


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
