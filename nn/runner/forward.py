"""The runner's side of the forward pass: the activation arena, thunk chains, decode
buckets and :func:`decoder_ops`, which lays an architecture's layer ops
(:mod:`deviceops.nn.models`) over the arena and the KV cache. Shared by the eager steps, the
decode graphs and the prefill paths of :class:`~.runner.Runner`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import deviceops
from deviceops import DeviceOp, Tensor, api

from ..layers import AttentionBuffers
from ..models import Architecture, LayerIO, LlamaConfig, Weights
from ..models.base import Thunk
from .paged_kv import KVCache

__all__ = ["Arena", "Thunk", "buckets", "chain", "decoder_ops"]


def chain(thunks: Sequence[Callable[[], DeviceOp[Any]]]) -> DeviceOp[Any]:
    """One lazy op running the ops the thunks build, in order, on one stream."""
    op = thunks[0]()
    for th in thunks[1:]:
        op = op.then(_after(th))
    return op


def _after(th: Callable[[], DeviceOp[Any]]) -> Callable[[Any], DeviceOp[Any]]:
    return lambda _: th()


def buckets(max_batch: int) -> list[int]:
    """Decode batch-size buckets: powers of two below ``max_batch``, then ``max_batch``."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return [*out, max_batch]


class Arena:
    """Flat activation buffers for ``rows`` token rows, viewed per call shape."""

    def __init__(self, stream: deviceops.Stream, cfg: LlamaConfig, rows: int, dtype: str) -> None:
        h, f = cfg.hidden_size, cfg.intermediate_size

        def buf(n: int) -> Tensor:
            return api.zeros((n,), dtype).sync_on(stream)

        self.rows = rows
        self.cfg = cfg
        self._memo: dict[tuple[int, int], dict[str, Any]] = {}
        self.resid = buf(rows * h)
        self.normed = buf(rows * h)
        self.qkv = buf(rows * cfg.qkv_size)
        self.q = buf(rows * cfg.q_size)
        self.att = buf(rows * cfg.q_size)
        self.merged = buf(rows * cfg.q_size)
        self.o = buf(rows * h)
        self.gu = buf(rows * 2 * f)
        self.act = buf(rows * f)
        self.down = buf(rows * h)
        self.k_fresh = buf(rows * cfg.kv_size)  # a prefill chunk's own keys and values
        self.v_fresh = buf(rows * cfg.kv_size)

    @staticmethod
    def view(t: Tensor, *shape: int) -> Tensor:
        """The first ``prod(shape)`` elements of ``t`` viewed as ``shape``."""
        return t[: math.prod(shape)].reshape(shape)

    def views(self, b: int, length: int) -> dict[str, Any]:
        """Views for ``b`` rows of ``length`` tokens (``b * length <= rows``), memoized."""
        key = (b, length)
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = self._views(b, length)
        return got

    def _views(self, b: int, length: int) -> dict[str, Any]:
        c, n = self.cfg, b * length
        v = self.view
        att = v(self.att, b, c.num_heads, length, c.head_dim)
        merged2 = att.reshape(n, c.q_size) if length == 1 else v(self.merged, n, c.q_size)
        return {
            "resid": v(self.resid, n, c.hidden_size),
            "normed": v(self.normed, n, c.hidden_size),
            "o": v(self.o, n, c.hidden_size),
            "gu": v(self.gu, n, 2 * c.intermediate_size),
            "act": v(self.act, n, c.intermediate_size),
            "down": v(self.down, n, c.hidden_size),
            "fresh": (v(self.k_fresh, b, c.num_kv_heads, length, c.head_dim),
                      v(self.v_fresh, b, c.num_kv_heads, length, c.head_dim)),
            "attn": AttentionBuffers(
                qkv2=v(self.qkv, n, c.qkv_size), qkv3=v(self.qkv, b, length, c.qkv_size),
                q=v(self.q, b, c.num_heads, length, c.head_dim), att=att,
                merged3=v(self.merged, b, length, c.q_size), merged2=merged2),
        }



def decoder_ops(arch: Architecture, w: Weights, cache: KVCache, vw: dict[str, Any], table: Tensor,
                start: Tensor, kv_len: Tensor, first: bool = False) -> list[Thunk]:
    """Thunks of every decoder layer over the views ``vw`` (input: the embedded tokens in
    ``vw['resid']``); ``table``: the rows' block-table rows ``(B, max_blocks)``; ``first``:
    a prompt chunk at position 0 (attention over its own contiguous keys,
    ``vw['fresh']``). The final norm is :meth:`~deviceops.nn.models.Architecture.final_norm_ops`."""
    th: list[Thunk] = []
    for i, layer in enumerate(w.layers):
        kc, vc = cache.layer(i)
        io = LayerIO(i, vw, kc, vc, table, start, kv_len, vw["fresh"] if first else None)
        th += arch.layer_ops(layer, io)
    return th
