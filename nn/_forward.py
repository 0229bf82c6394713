"""The forward pass as lazy thunks: the activation arena, the decoder-layer chain and
the head (final norm and LM head), shared by the eager step, the decode graphs and the
prefill paths of :class:`~.model.CausalLM`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import deviceops
from deviceops import DeviceOp, Tensor, api

from .config import LlamaConfig
from .kv_cache import KVCache
from .layers import AttentionBuffers, Linear, RMSNorm, RotaryAttention, SwiGLU

__all__ = ["Arena", "Layer", "buckets", "chain", "head", "layers_chain"]

Thunk = Callable[[], DeviceOp[Any]]


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


@dataclass
class Layer:
    """One decoder layer's modules."""

    norm1: RMSNorm
    attn: RotaryAttention
    norm2: RMSNorm
    mlp: SwiGLU


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



def _norm_thunk(norm: RMSNorm, x: Tensor | None, resid: Tensor, out: Tensor) -> Thunk:
    if x is None:
        return lambda: norm(resid, out)
    return lambda: norm.add_norm(x, resid, out)


def layers_chain(layers: Sequence[Layer], cache: KVCache, vw: dict[str, Any], table: Tensor,
                 start: Tensor, kv_len: Tensor, first: bool = False) -> list[Thunk]:
    """Thunks of every decoder layer over the views ``vw`` (input in ``vw['resid']``);
    ``table``: the rows' block-table rows ``(B, max_blocks)``; ``first``: a prompt chunk
    at position 0 (attention over its own contiguous keys, see ``RotaryAttention.ops``)."""
    resid, normed, o, down = vw["resid"], vw["normed"], vw["o"], vw["down"]
    th: list[Thunk] = []
    for i, ly in enumerate(layers):
        if i == 0:
            th.append(_norm_thunk(ly.norm1, None, resid, normed))
        else:
            th.append(_norm_thunk(ly.norm1, down, resid, normed))
        kc, vc = cache.layer(i)
        th += ly.attn.ops(normed, kc, vc, start, kv_len, vw["attn"], o, block_table=table,
                          fresh_kv=vw["fresh"] if first else None)
        th.append(_norm_thunk(ly.norm2, o, resid, normed))
        th += ly.mlp.ops(normed, vw["gu"], vw["act"], down)
    return th


def head(norm: RMSNorm, lm_head: Linear, down: Tensor, resid: Tensor, normed: Tensor,
         logits: Tensor) -> list[Thunk]:
    """The final residual add + norm and the LM head into ``logits``."""
    return [lambda: norm.add_norm(down, resid, normed),
            lambda: lm_head(normed, logits)]
