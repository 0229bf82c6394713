"""Adapts a ``CausalLM`` to the engine's :class:`~._engine.StepModel` protocol."""

from __future__ import annotations

from typing import Any

__all__ = ["step_model"]


def step_model(model: Any, *, max_batch: int, max_seq: int) -> Any:
    """A :class:`~._engine.StepModel` over ``model``'s KV cache slots."""
    raise TypeError(
        f"Engine: {type(model).__name__} has no step API (prefill into a slot, decode a set "
        "of slots, release); pass a deviceops.nn CausalLM or a StepModel"
    )
