"""Prefill: a prompt's KV written chunk by chunk into a row of the paged cache, eagerly
(one lazy chain per chunk, unpadded) or through one CUDA graph per padded chunk length and
kind (the chunk at position 0 attends over its own contiguous keys; a later chunk reads the
paged cache), whatever the row: ids, positions, the row's block-table row and sampling
parameters go to device buffers the graph reads (:class:`Prefiller`, a part of
:class:`~.runner.Runner`, whose :meth:`~.runner.Runner.prefill` documents the behaviour).
Every op runs on the runner's stream.

A row with features (penalties, logit bias, log-probabilities, a grammar mask: :mod:`.rows`)
draws its first token with the eager sampling ops (``penalize``, ``mask_logits``, ``sample``,
``logprobs`` over the last position's logits, reading the row's own feature buffers); on the
graph path the chunk's graph still runs the forward (its own draw is discarded). Rows
without features take the unchanged paths.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

import deviceops
import deviceops.kernels as kernels
from deviceops import DeviceOp, Tensor, api

from .forward import Thunk, chain, decoder_ops

if TYPE_CHECKING:
    from .runner import Runner

__all__ = ["Prefiller", "graph_refused"]


def graph_refused(key: tuple[int, bool], exc: BaseException) -> None:
    """Say (a ``RuntimeWarning``) that a prefill chunk graph could not be captured: chunks of
    that padded length then run eagerly, correct but slower, for the model's lifetime."""
    warnings.warn(f"prefill: the {key[0]}-token chunk graph (first chunk: {key[1]}) could not be "
                  f"captured ({type(exc).__name__}: {exc}); chunks of that length run eagerly",
                  RuntimeWarning, stacklevel=4)


class Prefiller:
    """The prefill paths of a runner, their device inputs and graphs.

    Reads the runner's public parts (``stream``, ``rows``, ``kv``, ``cache``, ``arena``,
    ``logits``, ``arch``, ``weights``, ``prefill_chunk``, ``contiguous_first_chunk``,
    ``graph_on``).

    Device inputs: ``pos`` (eager: start, kv_len, last row); for the graphs, one upload per
    dtype: ``i32`` = [ids (chunk) | start, kv_len, last row, top_k | block-table row
    (max_blocks)], ``f32`` = [temperature, top_p], ``i64`` = [seed, counter]; a graph
    samples into ``token``.

    Attributes:
        graphs: ``(padded length, chunk at position 0)`` -> its graph (``None``: capture
            refused; those chunks run eagerly).
    """

    def __init__(self, runner: Runner) -> None:
        r = self.r = runner
        s, c, mb = r.stream, r.prefill_chunk, r.kv.max_blocks
        self.pos = api.zeros((3,), "int32").sync_on(s)
        self.i32 = api.zeros((c + 4 + mb,), "int32").sync_on(s)
        self.f32 = api.zeros((2,), "float32").sync_on(s)
        self.i64 = api.zeros((2,), "int64").sync_on(s)
        self.token = api.zeros((1,), "int32").sync_on(s)
        self.last_row = api.zeros((1, r.config.hidden_size), r.dtype).sync_on(s)
        self.graphs: dict[tuple[int, bool], Any] = {}

    def prefill(self, slot: int, ids: list[int], start: int, sample: bool,
                graph: bool | None) -> Tensor | None:
        """Checked ``ids`` at ``start ..`` of row ``slot``: reserve, run the chunks."""
        r, rows = self.r, self.r.rows
        use_graph = (not r.device.is_cpu) if graph is None else bool(graph)
        ch = r.prefill_chunk
        r.kv.grow(slot, start + len(ids), "prefill")
        rows.cont[slot] = False
        rows.primed[slot] = start + len(ids) if sample else -1
        for a in range(0, len(ids), ch):
            part = ids[a:a + ch]
            last = a + ch >= len(ids)
            draw = last and sample
            if draw:
                rows.h_state[3, slot] = -1  # the device holds a token the host has not seen
            if use_graph and self._graphed(slot, part, start + a, draw):
                continue
            tail = self._sample_ops(slot) if draw else []
            if draw:
                rows.h_counter[slot] += 1
            self.chunk_op(slot, part, start + a, tail, None).async_on(r.stream)
        return rows.tokens[slot:slot + 1] if sample else None

    def pad_len(self, t: int) -> int:
        """The graph length of a ``t``-token chunk: a power of two >= 16, at most ``prefill_chunk``."""
        p = 16
        while p < t:
            p *= 2
        return min(p, self.r.prefill_chunk)

    def kinds(self) -> list[tuple[int, bool]]:
        """Every graph key: each padded length, for a chunk at position 0 and a later one."""
        c = self.r.prefill_chunk
        lengths, tp = [], 16
        while True:
            lengths.append(min(tp, c))
            if tp >= c:
                break
            tp *= 2
        firsts = (True, False) if self.r.contiguous_first_chunk else (False,)
        return [(tp, first) for tp in lengths for first in firsts]

    def warm_up(self, key: tuple[int, bool]) -> None:
        """Run ``key``'s graph op eagerly on a chunk that writes only the null block."""
        c = self.r.prefill_chunk
        i32 = np.zeros(c + 4 + self.r.kv.max_blocks, np.int32)  # table row: the null block
        i32[c:c + 3] = (0, key[0], key[0] - 1)
        api.memcpy(self.i32, api.from_host(i32)).async_on(self.r.stream)
        self.graph_op(*key).sync_on(self.r.stream)

    def capture(self, key: tuple[int, bool]) -> bool:
        """Capture ``key``'s graph (warned and recorded as ``None`` when refused)."""
        try:
            self.graphs[key] = self.r.graph_on(self.graph_op(*key))
            return True
        except deviceops.DeviceError as exc:  # capture refused (e.g. a kernel that allocates)
            self.graphs[key] = None
            graph_refused(key, exc)
            return False

    def _graphed(self, slot: int, part: list[int], start: int, draw: bool) -> bool:
        """Run one chunk through its padded length's graph; False: use the eager path."""
        r, rows = self.r, self.r.rows
        t = len(part)
        tp = self.pad_len(t)
        key = (tp, start == 0 and r.contiguous_first_chunk)
        g = self.graphs.get(key, False)
        if start + tp > rows.idle or g is None:
            return False
        s, c = r.stream, r.prefill_chunk
        tail = self._sample_ops(slot) if draw and rows.h_features[slot] else None
        i32 = np.zeros(c + 4 + r.kv.max_blocks, np.int32)
        i32[:t] = part
        temp, top_k, top_p, seed = rows.h_sampling[slot]
        i32[c:c + 4] = (start, start + tp, t - 1, top_k)
        i32[c + 4:] = r.kv.row(slot)
        api.memcpy(self.i32, api.from_host(i32)).async_on(s)
        api.memcpy(self.f32, api.from_host(np.array([temp, top_p], np.float32))).async_on(s)
        api.memcpy(self.i64, api.from_host(np.array([seed, rows.h_counter[slot]], np.int64))
                   ).async_on(s)
        if draw:
            rows.h_counter[slot] += 1
        rows.h_state[3, slot] = -1  # the graph samples into the row's token either way
        if g is False:
            self.graph_op(*key).sync_on(s)  # this chunk, eagerly; then capture
            self.capture(key)
        else:
            g.launch()
        if tail is not None:  # the row's own draw, with its features, from the graph's logits
            chain(tail).async_on(s)
        else:
            api.memcpy(rows.tokens[slot:slot + 1], self.token).async_on(s)
        return True

    def graph_op(self, tp: int, first: bool) -> DeviceOp[Any]:
        """A padded prompt chunk of ``tp`` tokens of any row, from the device inputs (the op a
        graph captures; class docstring). ``first``: the chunk starts at position 0
        (attention over its own contiguous keys; the keys still go to the row's blocks)."""
        r = self.r
        arch, w = r.arch, r.weights
        vw = r.arena.views(1, tp)
        c, mb, b32 = r.prefill_chunk, r.kv.max_blocks, self.i32
        st, kl, last, top_k = b32[c:c + 1], b32[c + 1:c + 2], b32[c + 2:c + 3], b32[c + 3:c + 4]
        table = b32[c + 4:c + 4 + mb].reshape((1, mb))
        temp, top_p = self.f32[0:1], self.f32[1:2]
        seed, counter = self.i64[0:1], self.i64[1:2]
        th = arch.embed_ops(w, b32[:tp], vw["resid"])
        th += decoder_ops(arch, w, r.cache, vw, table, st, kl, first)
        th += arch.final_norm_ops(w, vw["down"], vw["resid"], vw["normed"])
        th.append(lambda: kernels.embedding(last, vw["normed"], out=self.last_row))  # last real row
        th += arch.lm_head_ops(w, self.last_row, r.logits[0:1])
        th.append(lambda: kernels.sample(r.logits[0:1], temp, top_k, top_p, seed, counter,
                                         out=self.token))
        return chain(th)

    def chunk_op(self, slot: int, ids: list[int], start: int, tail: list[Thunk],
                 all_logits: Tensor | None) -> DeviceOp[Any]:
        """One prompt chunk, eagerly: KV of ``ids`` at ``start ..`` of ``slot``, the last
        row's logits (or, with ``all_logits``, every row's into it), then ``tail``."""
        r = self.r
        arch, w = r.arch, r.weights
        t = len(ids)
        vw = r.arena.views(1, t)
        pos = np.array([start, start + t, t - 1], np.int32)
        ids_a = np.asarray(ids, np.int32)
        st, kl = self.pos[0:1], self.pos[1:2]
        th: list[Thunk] = [lambda: api.memcpy(self.pos, api.from_host(pos))]
        th += arch.embed_ops(w, api.from_host(ids_a), vw["resid"])
        th += decoder_ops(arch, w, r.cache, vw, r.kv.table[slot:slot + 1], st, kl,
                          first=start == 0 and r.contiguous_first_chunk)
        if all_logits is not None:  # every row's logits (Runner.prefill_logits)
            th += arch.final_norm_ops(w, vw["down"], vw["resid"], vw["normed"])
            th += arch.lm_head_ops(w, vw["normed"], all_logits[start:start + t])
        else:
            last = slice(t - 1, t)
            th += arch.final_norm_ops(w, vw["down"][last], vw["resid"][last], vw["normed"][last])
            th += arch.lm_head_ops(w, vw["normed"][last], r.logits[0:1])
        return chain([*th, *tail])

    def _sample_ops(self, slot: int) -> list[Thunk]:
        """Thunks sampling row ``slot``'s next token from the prefill logits (counter restored;
        with the row's features: penalised, biased and masked first, log-probabilities
        after)."""
        rows, logits = self.r.rows, self.r.logits[0:1]
        rg = slice(slot, slot + 1)
        cnt = np.array([rows.h_counter[slot]], np.int64)
        th: list[Thunk] = [lambda: api.memcpy(rows.counter[rg], api.from_host(cnt))]
        def draw() -> DeviceOp[Any]:
            return kernels.sample(logits, rows.temperature[rg], rows.top_k[rg], rows.top_p[rg],
                                  rows.seed[rg], rows.counter[rg], out=rows.tokens[rg])

        if not rows.h_features[slot]:
            return [*th, draw]
        feats, pres, freq, counts, bias, lpv, lpi = (t[rg] for t in rows.feature_buffers())
        assert rows.mask is not None  # allocated with the feature buffers
        mask = rows.mask[rg]
        return [*th,
                lambda: kernels.penalize(logits, counts, bias, pres, freq, feats),
                lambda: kernels.mask_logits(logits, mask, feats),
                draw,
                lambda: kernels.logprobs(logits, rows.tokens[rg], feats, counts,
                                         k=lpi.shape[1], out=lpv, ids_out=lpi)]
