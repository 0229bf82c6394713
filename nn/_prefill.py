"""Prefill: a prompt's KV written chunk by chunk into a row of the paged cache, eagerly
(one lazy chain per chunk, unpadded) or through one CUDA graph per padded chunk length and
kind (the chunk at position 0 attends over its own contiguous keys; a later chunk reads the
paged cache), whatever the row: ids, positions, the row's block-table row and sampling
parameters go to device buffers the graph reads. Functions of a
:class:`~.model.CausalLM`, whose :meth:`~.model.CausalLM.prefill` documents the behaviour.
Every op runs on the model's :attr:`~.model.CausalLM.device_stream`."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

import deviceops
import deviceops.kernels as kernels
from deviceops import DeviceOp, Tensor, api

from ._forward import Thunk, chain, head, layers_chain

if TYPE_CHECKING:
    from .model import CausalLM

__all__ = ["bind_chunk", "graph_on_model", "graph_refused", "launch", "prefill", "prefill_graph_op"]


def prefill(m: CausalLM, slot: int, ids: Sequence[int], start: int, sample: bool,
            graph: bool | None) -> Tensor | None:
    """:meth:`CausalLM.prefill <.model.CausalLM.prefill>`: check, reserve, run the chunks."""
    slot = m._check_slot(slot, "prefill")
    ids_l = m._check_ids(list(ids), "prefill")
    if not isinstance(start, int) or start < 0 or start + len(ids_l) > m.max_seq:
        raise ValueError(f"prefill: positions {start}..{start + len(ids_l) - 1} do not fit "
                         f"max_seq={m.max_seq} (start must be an int >= 0)")
    use_graph = (not m.device.is_cpu) if graph is None else bool(graph)
    ch = m.prefill_chunk
    m._grow(slot, start + len(ids_l), "prefill")
    m._cont[slot] = False
    s = m.device_stream
    for a in range(0, len(ids_l), ch):
        part = ids_l[a:a + ch]
        last = a + ch >= len(ids_l)
        draw = last and sample
        if draw:
            m._h_state[3, slot] = -1  # the device holds a token the host has not seen
        if use_graph and prefill_graphed(m, slot, part, start + a, draw):
            continue
        tail = prefill_sample(m, slot) if draw else []
        if draw:
            m._h_counter[slot] += 1
        prefill_chunk_op(m, slot, part, start + a, tail, None).async_on(s)
    return m._tokens[slot:slot + 1] if sample else None


def graph_on_model(m: CausalLM, op: DeviceOp[Any]) -> Any:
    """Capture ``op`` into a graph on the model's stream, under the model's policy (a
    capture resolves the current policy; the default one lives on the default device)."""
    with deviceops.using(m.policy):
        return op.graph_on(m.device_stream)


def launch(m: CausalLM, g: Any) -> None:
    """Enqueue one replay of the captured graph ``g`` on the stream it was captured on (the
    model's; ``CudaGraph.launch`` consults no policy)."""
    g.launch()


def graph_refused(key: tuple[int, bool], exc: BaseException) -> None:
    """Say (a ``RuntimeWarning``) that a prefill chunk graph could not be captured: chunks of
    that padded length then run eagerly, correct but slower, for the model's lifetime."""
    warnings.warn(f"prefill: the {key[0]}-token chunk graph (first chunk: {key[1]}) could not be "
                  f"captured ({type(exc).__name__}: {exc}); chunks of that length run eagerly",
                  RuntimeWarning, stacklevel=3)


def pad_len(m: CausalLM, t: int) -> int:
    """The graph length of a ``t``-token chunk: a power of two >= 16, at most ``prefill_chunk``."""
    p = 16
    while p < t:
        p *= 2
    return min(p, m.prefill_chunk)


def prefill_graphed(m: CausalLM, slot: int, part: list[int], start: int, draw: bool) -> bool:
    """Run one chunk through its padded length's graph; False: use the eager path."""
    t = len(part)
    tp = pad_len(m, t)
    key = (tp, start == 0 and m.contiguous_first_chunk)
    g = m._pf_graphs.get(key, False)
    if start + tp > m._idle or g is None:
        return False
    s, c, mb = m.device_stream, m.prefill_chunk, m.max_blocks
    i32 = np.zeros(c + 4 + mb, np.int32)
    i32[:t] = part
    temp, top_k, top_p, seed = m._h_sampling[slot]
    i32[c:c + 4] = (start, start + tp, t - 1, top_k)
    i32[c + 4:] = m._table_row(slot)
    api.memcpy(m._pf_i32, api.from_host(i32)).async_on(s)
    api.memcpy(m._pf_f32, api.from_host(np.array([temp, top_p], np.float32))).async_on(s)
    api.memcpy(m._pf_i64, api.from_host(np.array([seed, m._h_counter[slot]], np.int64))).async_on(s)
    if draw:
        m._h_counter[slot] += 1
    m._h_state[3, slot] = -1  # the graph samples into the row's token either way
    if g is False:
        prefill_graph_op(m, *key).sync_on(s)  # this chunk, eagerly; then capture
        try:
            m._pf_graphs[key] = graph_on_model(m, prefill_graph_op(m, *key))
        except deviceops.DeviceError as exc:  # capture refused (e.g. a kernel that allocates)
            m._pf_graphs[key] = None
            graph_refused(key, exc)
    else:
        launch(m, g)
    r = slice(slot, slot + 1)
    api.memcpy(m._tokens[r], m._pf_tok).async_on(s)
    return True


def prefill_graph_op(m: CausalLM, tp: int, first: bool) -> DeviceOp[Any]:
    """A padded prompt chunk of ``tp`` tokens of any row, from device buffers (the op a
    graph captures): ``_pf_i32`` = ids, (start, start + tp, last real row, top_k), the
    row's block-table row; ``_pf_f32`` = (temperature, top_p); ``_pf_i64`` = (seed,
    counter). The token goes to ``_pf_tok``. ``first``: the chunk starts at position 0
    (attention over its own contiguous keys; the keys still go to the row's blocks)."""
    vw = m._arena.views(1, tp)
    c, mb, b32 = m.prefill_chunk, m.max_blocks, m._pf_i32
    st, kl, last, top_k = b32[c:c + 1], b32[c + 1:c + 2], b32[c + 2:c + 3], b32[c + 3:c + 4]
    table = b32[c + 4:c + 4 + mb].reshape((1, mb))
    temp, top_p = m._pf_f32[0:1], m._pf_f32[1:2]
    seed, counter = m._pf_i64[0:1], m._pf_i64[1:2]
    th: list[Thunk] = [lambda: m.embed(b32[:tp], vw["resid"])]
    th += layers_chain(m.layers, m.cache, vw, table, st, kl, first)
    th += [lambda: m.norm.add_norm(vw["down"], vw["resid"], vw["normed"]),
           lambda: kernels.embedding(last, vw["normed"], out=m._pf_row),  # the last real row
           lambda: m.lm_head(m._pf_row, m._logits[0:1]),
           lambda: kernels.sample(m._logits[0:1], temp, top_k, top_p, seed, counter,
                                  out=m._pf_tok)]
    return chain(th)


def prefill_chunk_op(m: CausalLM, slot: int, ids: list[int], start: int, tail: list[Thunk],
                     all_logits: Tensor | None) -> DeviceOp[Any]:
    """One prompt chunk: KV of ``ids`` at ``start ..`` of ``slot``, then ``tail``."""
    t = len(ids)
    vw = m._arena.views(1, t)
    pos = np.array([start, start + t, t - 1], np.int32)
    ids_a = np.asarray(ids, np.int32)
    st, kl = m._pf_pos[0:1], m._pf_pos[1:2]
    th: list[Thunk] = [
        lambda: api.memcpy(m._pf_pos, api.from_host(pos)),
        lambda: m.embed(api.from_host(ids_a), vw["resid"]),
    ]
    th += layers_chain(m.layers, m.cache, vw, m._table[slot:slot + 1], st, kl,
                       first=start == 0 and m.contiguous_first_chunk)
    if all_logits is not None:  # every row's logits (CausalLM.logits)
        th += head(m.norm, m.lm_head, vw["down"], vw["resid"], vw["normed"], all_logits[start:start + t])
    else:
        last = slice(t - 1, t)
        th += head(m.norm, m.lm_head, vw["down"][last], vw["resid"][last], vw["normed"][last], m._logits[0:1])
    return chain([*th, *tail])


def prefill_sample(m: CausalLM, slot: int) -> list[Thunk]:
    """Thunks sampling row ``slot``'s next token from the prefill logits (counter restored)."""
    r = slice(slot, slot + 1)
    cnt = np.array([m._h_counter[slot]], np.int64)
    return [lambda: api.memcpy(m._counter[r], api.from_host(cnt)),
            lambda: kernels.sample(m._logits[0:1], m._temperature[r], m._top_k[r], m._top_p[r],
                                   m._seed[r], m._counter[r], out=m._tokens[r])]


def bind_chunk(m: CausalLM, slot: int, part: list[int], a: int, out: Tensor) -> Thunk:
    """A thunk of one chunk of :meth:`CausalLM.logits <.model.CausalLM.logits>` (every
    row's logits into ``out``)."""
    return lambda: prefill_chunk_op(m, slot, part, a, [], out)
