"""Validation of the generation arguments shared by ``CausalLM.generate``/``stream`` and
``Engine.generate``/``stream``/``submit``: every argument is checked before anything is
queued, and a bad one raises an error naming it, its value and what is accepted.

| argument | accepted | stored as |
|---|---|---|
| ``max_new_tokens`` | an int >= 0 (not a bool) | int |
| ``temperature`` | ``None`` or a finite real number >= 0 (0 = greedy) | float |
| ``top_k`` | ``None`` or an int >= 0 (0 = off; beyond any vocabulary, e.g. ``10**30``: off) | int32 range |
| ``top_p`` | ``None`` or a real number in (0, 1] (1 = off) | float |
| ``seed`` | ``None`` or an int in [0, 2**63) (not a str: ``"5"`` is refused) | int64 |
| ``stop`` | ``None`` or a list/tuple/set of token ids (ints) | frozenset |
| ``presence_penalty``, ``frequency_penalty`` | ``None`` or a real number in [-2, 2] (0 = off) | float |
| ``logit_bias`` | ``None`` or a mapping token id (int in [0, vocab)) -> real number in [-100, 100] | sorted tuple of pairs |
| ``logprobs`` | ``None`` (off) or an int in [0, 20]: the top log-probabilities per token | int or None |

NumPy integers and floats count as ints and reals; bools never do.
"""

from __future__ import annotations

import math
from collections.abc import Set
from typing import Any

import numpy as np

__all__ = ["check_adjustments", "check_max_new_tokens", "check_sampling", "check_stop"]

_INT32_MAX = 2**31 - 1


def _pre(what: str) -> str:
    return f"{what}: " if what else ""


def _is_int(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)


def _is_real(x: Any) -> bool:
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool | np.bool_)


def _kind(x: Any) -> str:
    return f"{x!r:.60} ({type(x).__name__})"


def check_max_new_tokens(n: Any, what: str = "") -> int:
    """``n`` as an int >= 0.

    Raises:
        TypeError: not an int (a float, a str, a bool).
        ValueError: negative.
    """
    if not _is_int(n):
        raise TypeError(f"{_pre(what)}max_new_tokens must be an int >= 0, got {_kind(n)}")
    if n < 0:
        raise ValueError(f"{_pre(what)}max_new_tokens must be an int >= 0, got {n}")
    return int(n)


def check_sampling(temperature: Any, top_k: Any, top_p: Any, seed: Any, what: str = ""
                   ) -> tuple[float, int, float, int]:
    """Validate sampling arguments; ``None`` means off (top_k 0, top_p 1.0, seed 0).

    Returns:
        ``(temperature, top_k, top_p, seed)`` as float, int (within int32: a top_k beyond
        any vocabulary is off, 0), float, int.

    Raises:
        ValueError: an argument of the wrong type or out of range; the message names it.
    """
    pre = _pre(what)
    t = 0.0 if temperature is None else temperature
    if not _is_real(t) or not math.isfinite(float(t)) or t < 0:
        raise ValueError(f"{pre}temperature={_kind(temperature)} must be a finite number >= 0 "
                         "(0 = greedy)")
    k = 0 if top_k is None else top_k
    if not _is_int(k) or k < 0:
        raise ValueError(f"{pre}top_k={_kind(top_k)} must be None or an int >= 0 (0 = off)")
    k = int(k)
    if k > _INT32_MAX:  # more than any vocabulary: every token is kept, i.e. off
        k = 0
    p = 1.0 if top_p is None else top_p
    if not _is_real(p) or not 0 < float(p) <= 1:
        raise ValueError(f"{pre}top_p={_kind(top_p)} must be None or a number in (0, 1] "
                         "(1 = off)")
    sd = 0 if seed is None else seed
    if not _is_int(sd) or not 0 <= sd < 2**63:
        raise ValueError(f"{pre}seed={_kind(seed)} must be None or an int in [0, 2**63)"
                         + ("; convert it with int() first" if isinstance(seed, str) else ""))
    return float(t), k, float(p), int(sd)


def check_stop(stop: Any, what: str = "") -> frozenset[int]:
    """``stop`` (``None`` or a collection of token ids) as a frozenset of ints.

    Raises:
        ValueError: ``stop`` is a str or a single int, or holds something else than ints.
    """
    pre = _pre(what)
    if stop is None:
        return frozenset()
    if not isinstance(stop, list | tuple | Set | np.ndarray):
        raise ValueError(f"{pre}stop={_kind(stop)} must be None or a list of token ids "
                         "(ints), e.g. stop=[2]")
    bad = [s for s in stop if not _is_int(s)]
    if bad:
        raise ValueError(f"{pre}stop ids must be ints, got {_kind(bad[0])}")
    return frozenset(int(s) for s in stop)


def check_adjustments(presence_penalty: Any, frequency_penalty: Any, logit_bias: Any,
                      logprobs: Any, vocab: int, what: str = ""
                      ) -> tuple[float, float, tuple[tuple[int, float], ...], int | None]:
    """Validate OpenAI's logits adjustments and ``logprobs`` (module table).

    Returns:
        ``(presence, frequency, bias, logprobs)``: floats, the bias as ``((id, value), ...)``
        sorted by id without zero values, ``None`` or the int.

    Raises:
        ValueError: an argument of the wrong type or out of range; the message names it.
    """
    pre = _pre(what)
    out: list[float] = []
    for name, v in (("presence_penalty", presence_penalty),
                    ("frequency_penalty", frequency_penalty)):
        x = 0.0 if v is None else v
        if not _is_real(x) or not -2.0 <= float(x) <= 2.0:
            raise ValueError(f"{pre}{name}={_kind(v)} must be None or a number in [-2, 2]")
        out.append(float(x))
    bias: list[tuple[int, float]] = []
    if logit_bias is not None:
        if not hasattr(logit_bias, "items"):
            raise ValueError(f"{pre}logit_bias={_kind(logit_bias)} must be None or a mapping "
                             "token id -> bias")
        for k, v in logit_bias.items():
            if not _is_int(k) or not 0 <= int(k) < vocab:
                raise ValueError(f"{pre}logit_bias: token id {_kind(k)} is not an int in "
                                 f"[0, {vocab})")
            if not _is_real(v) or not -100.0 <= float(v) <= 100.0:
                raise ValueError(f"{pre}logit_bias[{int(k)}]={_kind(v)} must be a number in "
                                 "[-100, 100]")
            if float(v) != 0.0:
                bias.append((int(k), float(v)))
    n = logprobs
    if n is not None and (not _is_int(n) or not 0 <= n <= 20):
        raise ValueError(f"{pre}logprobs={_kind(logprobs)} must be None or an int in [0, 20]")
    return out[0], out[1], tuple(sorted(bias)), None if n is None else int(n)
