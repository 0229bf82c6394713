"""Packed prefill: the prompt chunks of several rows in one forward pass (:class:`Packer`, a
part of :class:`~.runner.Runner`, whose :meth:`~.runner.Runner.prefill_many` documents the
behaviour).

Each prompt token runs as one row of a decode-shaped step: its own position (``start``),
key count (``position + 1``) and block-table row (its cache row's), so the layers write every
token's key and value into its row's blocks and then each token attends over its row's keys
up to itself, all rows at once. The chunks' tokens are concatenated and padded to a power of
two (:meth:`Packer.pad_len`; padding tokens sit at the idle position, past every table,
and write nothing). The last token of each chunk is gathered, the LM head runs on those rows
only, and one ``sample`` draws each chunk's next token with its row's parameters and counter
(the draw depends on ``(seed, counter)`` only, so it is the token a chunk prefilled alone
draws); a device-to-device copy puts each sampled token in its row's token buffer, where a
decode step (or ``decode_step(tokens=None)``) reads it.

This trades the flash-attention prefill of one chunk for one pass over the weights for
many: per token the attention reads its row's keys (no reuse across the chunk's queries), so
it is for short chunks (:data:`MAX_CHUNK` tokens at most, :func:`worth_packing`): the many
short prompts (or short suffixes of a cached prefix) that arrive together at a server. On CUDA each padded length replays one CUDA graph (device
inputs: one int32 upload of ids, positions, key counts, gather indices, ``top_k`` and the
block-table rows, one float32 and one int64 upload of the sampling parameters); elsewhere,
and with ``graph=False``, the same ops run eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

import deviceops
import deviceops.kernels as kernels
from deviceops import DeviceOp, api

from .forward import chain, decoder_ops
from .prefill import graph_refused

if TYPE_CHECKING:
    from .runner import Runner

__all__ = ["MAX_CHUNK", "Packer", "worth_packing"]

#: The longest chunk a packed prefill takes (its attention reads each token's keys alone).
MAX_CHUNK = 128


def worth_packing(start: int, n: int) -> bool:
    """Whether an ``n``-token chunk at ``start`` goes into a packed prefill: at most
    :data:`MAX_CHUNK` tokens, wherever it starts. (Measured on an H200 with 64 clients whose
    prompts share a cached 1,000-token prefix: their ~72-token suffixes packed gave a TTFT
    p50 of 46 ms and 23.9k tokens/s, each through its own prefill 91 ms and 19.5k.)"""
    del start  # a long context read per token still costs less than a pass per chunk
    return n <= MAX_CHUNK


class Packer:
    """The packed prefill of a runner: its device inputs and graphs (module docstring).

    Reads the runner's public parts (``stream``, ``rows``, ``kv``, ``cache``, ``arena``,
    ``logits``, ``arch``, ``weights``, ``prefill_chunk``, ``max_batch``, ``graph_on``).

    Attributes:
        tokens: the most tokens one packed prefill takes (the runner's ``prefill_chunk``).
        chunks: the most chunks (``min(tokens, max_batch)``).
        graphs: padded length -> its graph (``None``: capture refused; those run eagerly).
    """

    def __init__(self, runner: Runner) -> None:
        r = self.r = runner
        s, c, mb = r.stream, r.prefill_chunk, r.kv.max_blocks
        self.tokens = c
        self.chunks = min(c, r.max_batch)
        n = self.chunks
        # i32: ids | start | kv_len (c each) | gather index | top_k (n each) | table (c, mb)
        self._head = 3 * c + 2 * n
        self.i32 = api.zeros((self._head + c * mb,), "int32").sync_on(s)
        self.f32 = api.zeros((2 * n,), "float32").sync_on(s)  # temperature | top_p
        self.i64 = api.zeros((2 * n,), "int64").sync_on(s)  # seed | counter
        self.out = api.zeros((n,), "int32").sync_on(s)
        self.last_rows = api.zeros((n, r.config.hidden_size), r.dtype).sync_on(s)
        self.graphs: dict[int, Any] = {}

    def pad_len(self, t: int) -> int:
        """The graph length of ``t`` packed tokens: a power of two >= 16, at most ``tokens``."""
        p = 16
        while p < t:
            p *= 2
        return min(p, self.tokens)

    def lengths(self) -> list[int]:
        """Every padded length, shortest first."""
        out, p = [], 16
        while True:
            out.append(min(p, self.tokens))
            if p >= self.tokens:
                return out
            p *= 2

    def run(self, chunks: Sequence[tuple[int, list[int], int, bool]], use_graph: bool) -> None:
        """Enqueue checked ``(slot, ids, start, sample)`` chunks as one packed prefill (its
        length's graph when ``use_graph``: captured at its first use after an eager run)."""
        r, rows = self.r, self.r.rows
        c, n, mb = self.tokens, self.chunks, r.kv.max_blocks
        t = sum(len(ids) for _, ids, _, _ in chunks)
        tp = self.pad_len(t)
        head = np.zeros(self._head, np.int32)
        table = np.zeros((tp, mb), np.int32)
        f32 = np.zeros(2 * n, np.float32)
        f32[n:] = 1.0
        i64 = np.zeros(2 * n, np.int64)
        at = 0
        for j, (slot, ids, start, sample) in enumerate(chunks):
            k = len(ids)
            r.kv.grow(slot, start + k, "prefill_many")
            head[at:at + k] = ids
            head[c + at:c + at + k] = np.arange(start, start + k)
            head[2 * c + at:2 * c + at + k] = np.arange(start + 1, start + k + 1)
            head[3 * c + j] = at + k - 1
            temp, top_k, top_p, seed = rows.h_sampling[slot]
            head[3 * c + n + j] = top_k
            f32[j], f32[n + j] = temp, top_p
            i64[j], i64[n + j] = seed, rows.h_counter[slot]
            table[at:at + k] = r.kv.row(slot)
            at += k
            rows.cont[slot] = False
            rows.primed[slot] = start + k if sample else -1
            if sample:
                rows.h_counter[slot] += 1
                rows.h_state[3, slot] = -1  # the device holds a token the host has not seen
        head[c + at:c + tp] = rows.idle  # padding tokens: past every table, nothing written
        head[2 * c + at:2 * c + tp] = 1
        s = r.stream
        api.memcpy(self.i32[:self._head], api.from_host(head)).async_on(s)
        api.memcpy(self.i32[self._head:self._head + tp * mb], api.from_host(table.reshape(-1))
                   ).async_on(s)
        api.memcpy(self.f32, api.from_host(f32)).async_on(s)
        api.memcpy(self.i64, api.from_host(i64)).async_on(s)
        g = self.graphs.get(tp, False) if use_graph else None
        if g is False:  # first use of this length: run it eagerly, then capture it
            self.op(tp).sync_on(s)
            self.capture(tp)
        elif g is None:
            self.op(tp).async_on(s)
        else:
            g.launch()
        for j, (slot, _ids, _start, sample) in enumerate(chunks):
            if sample:
                api.memcpy(rows.tokens[slot:slot + 1], self.out[j:j + 1]).async_on(s)

    def warm_up(self, tp: int) -> None:
        """Run length ``tp``'s op eagerly over padding only (nothing written)."""
        c, r = self.tokens, self.r
        head = np.zeros(self._head, np.int32)
        head[c:c + tp] = r.rows.idle
        head[2 * c:2 * c + tp] = 1
        api.memcpy(self.i32[:self._head], api.from_host(head)).async_on(r.stream)
        api.memcpy(self.i32[self._head:], api.from_host(
            np.zeros(self.i32.shape[0] - self._head, np.int32))).async_on(r.stream)
        self.op(tp).sync_on(r.stream)

    def capture(self, tp: int) -> bool:
        """Capture length ``tp``'s graph (warned and recorded as ``None`` when refused)."""
        try:
            self.graphs[tp] = self.r.graph_on(self.op(tp))
            return True
        except deviceops.DeviceError as exc:
            self.graphs[tp] = None
            graph_refused((tp, False), exc)
            return False

    def op(self, tp: int) -> DeviceOp[Any]:
        """The packed prefill of ``tp`` (padded) tokens from the device inputs (what a graph
        captures): embed, every layer as a decode step of ``tp`` one-token rows, the final
        norm, the chunks' last rows gathered, the LM head on them, one ``sample``."""
        r = self.r
        arch, w = r.arch, r.weights
        c, n, mb = self.tokens, self.chunks, r.kv.max_blocks
        m = min(tp, n)  # chunks it may hold (each has a token)
        vw = r.arena.views(tp, 1)
        b32 = self.i32
        ids, st, kl = b32[:tp], b32[c:c + tp], b32[2 * c:2 * c + tp]
        last, top_k = b32[3 * c:3 * c + m], b32[3 * c + n:3 * c + n + m]
        table = b32[self._head:self._head + tp * mb].reshape((tp, mb))
        temp, top_p = self.f32[:m], self.f32[n:n + m]
        seed, counter = self.i64[:m], self.i64[n:n + m]
        rows_m, logits, out = self.last_rows[:m], r.logits[:m], self.out[:m]
        th = arch.embed_ops(w, ids, vw["resid"])
        th += decoder_ops(arch, w, r.cache, vw, table, st, kl)
        th += arch.final_norm_ops(w, vw["down"], vw["resid"], vw["normed"])
        th.append(lambda: kernels.embedding(last, vw["normed"], out=rows_m))
        th += arch.lm_head_ops(w, rows_m, logits)
        th.append(lambda: kernels.sample(logits, temp, top_k, top_p, seed, counter, out=out))
        return chain(th)
