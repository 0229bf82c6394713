"""Decode: one token for each active row of a bucket of cache rows (``bucket`` in 1, 2, 4,
..., ``max_batch``), run eagerly op by op or as the bucket's CUDA graph, captured once
and replayed per token. Positions, key counts, input tokens and sampling state live in
device memory; the host keeps a shadow of them and uploads it only when a row does not
continue from the previous step. Functions of a :class:`~.model.CausalLM`, whose
:meth:`~.model.CausalLM.decode_step` documents the behaviour.

Every op runs on the model's :attr:`~.model.CausalLM.device_stream`: graphs are captured
on it under the model's own policy and replayed there, so nothing consults the default
policy, which lives on the default device."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

import deviceops
import deviceops.kernels as kernels
from deviceops import DeviceOp, Tensor, api

from ._forward import Thunk, chain, head, layers_chain
from ._prefill import graph_on_model, graph_refused, launch, prefill_graph_op

if TYPE_CHECKING:
    from .model import CausalLM

__all__ = ["capture_graphs", "decode_step", "step_ops"]


def decode_step(m: CausalLM, slots: Sequence[int], tokens: Sequence[int],
                positions: Sequence[int], graph: bool | None) -> Tensor:
    """:meth:`CausalLM.decode_step <.model.CausalLM.decode_step>`: check the rows, grow
    their blocks, upload the state if it changed, run the bucket's step."""
    n = len(slots)
    if n == 0 or len(tokens) != n or len(positions) != n:
        raise ValueError(f"decode_step: slots ({len(slots)}), tokens ({len(tokens)}) and positions "
                         f"({len(positions)}) must be non-empty and of equal length")
    sl = [m._check_slot(x, "decode_step") for x in slots]
    if len(set(sl)) != n:
        raise ValueError(f"decode_step: slots {sl} repeat a row")
    toks = m._check_ids(list(tokens), "decode_step")
    for p in positions:
        if isinstance(p, bool) or not isinstance(p, int | np.integer) or not 0 <= p < m.max_seq:
            raise ValueError(f"decode_step: position {p!r} is outside [0, max_seq={m.max_seq})")
    bs, rb = m.block_size, m._row_blocks
    for x, p in zip(sl, positions, strict=True):
        if len(rb[x]) * bs <= p:  # position p needs a block the row does not hold yet
            m._grow(x, int(p) + 1, "decode_step")
    b = next(x for x in m._bucket_list if x > max(sl))
    # default: the bucket's graph on both backends (on cpu a replay is one hand-off of the
    # recorded step to the stream's worker, instead of ~280 op constructions and hand-offs)
    use_graph = True if graph is None else bool(graph)
    if use_graph and b not in m._graphs:
        capture(m, b)
    want = m._h_state.copy()
    active = np.zeros(m.max_batch, bool)
    fresh = False  # a row that does not continue from the last step (its state must go up)
    for x, t, p in zip(sl, toks, positions, strict=True):
        active[x] = True
        if not (m._cont[x] and want[0, x] == p and want[2, x] == 1):
            fresh = True
        want[:, x] = (p, p + 1, 1, t)  # a continuing row's token is the one already there
    idle = ~active[:b]
    want[2, :b][idle] = 0
    want[0, :b][idle & (want[0, :b] < m._idle)] = m._idle
    want[1, :b][idle] = 1
    changed = m._dirty or fresh or not np.array_equal(want[:3, :b], m._h_state[:3, :b])
    s = m.device_stream
    if changed:
        want[3, sl] = toks  # continuing rows too: the shadow holds their previous input
        want[3, :b][want[3, :b] < 0] = 0  # unknown tokens of idle rows: any valid id
        api.memcpy(m._state, api.from_host(want)).async_on(s)
        api.memcpy(m._counter, api.from_host(m._h_counter)).async_on(s)
        m._dirty = False
    if use_graph:
        launch(m, m._graphs[b])
    else:
        run_eager(m, b)
    # advance the shadow: active rows moved one position and drew one number
    want[0, sl] += 1
    want[1, sl] += 1
    m._h_counter[sl] += 1
    m._h_state = want
    m._cont[:] = False
    m._cont[sl] = True
    return m._tokens[:b]


def capture(m: CausalLM, b: int) -> None:
    """Warm the bucket up eagerly (all rows idle: no KV written) and capture its graph."""
    s = m.device_stream
    idle = m._h_state.copy()
    idle[0, :b], idle[1, :b], idle[2, :b] = m._idle, 1, 0
    idle[3, :b][idle[3, :b] < 0] = 0
    api.memcpy(m._state, api.from_host(idle)).async_on(s)
    step_op(m, b).sync_on(s)
    m._graphs[b] = graph_on_model(m, step_op(m, b))
    m._dirty = True  # the warm-up advanced the idle rows' counters


def capture_graphs(m: CausalLM, graph: bool | None) -> int:
    """:meth:`CausalLM.capture_graphs <.model.CausalLM.capture_graphs>`."""
    use_graph = (not m.device.is_cpu) if graph is None else bool(graph)
    if not use_graph:
        return 0
    s, c = m.device_stream, m.prefill_chunk
    lengths, tp = [], 16
    while True:
        lengths.append(min(tp, c))
        if tp >= c:
            break
        tp *= 2
    # eager runs of the largest shapes first: the stream's kernel workspace reaches its
    # final size before any capture, so every graph shares one workspace
    idle = m._h_state.copy()
    idle[0], idle[1], idle[2] = m._idle, 1, 0
    idle[3][idle[3] < 0] = 0
    api.memcpy(m._state, api.from_host(idle)).async_on(s)
    step_op(m, m.max_batch).sync_on(s)
    m._dirty = True
    i32 = np.zeros(c + 4 + m.max_blocks, np.int32)  # table row: the null block
    kinds = (True, False) if m.contiguous_first_chunk else (False,)
    keys = [(tp, first) for tp in lengths for first in kinds]
    for key in reversed(keys):
        i32[c:c + 3] = (0, key[0], key[0] - 1)
        api.memcpy(m._pf_i32, api.from_host(i32)).async_on(s)
        prefill_graph_op(m, *key).sync_on(s)
    n = 0
    for b in m._bucket_list:
        if b not in m._graphs:
            capture(m, b)
            n += 1
    for key in keys:
        if key not in m._pf_graphs:
            try:
                m._pf_graphs[key] = graph_on_model(m, prefill_graph_op(m, *key))
                n += 1
            except deviceops.DeviceError as exc:
                m._pf_graphs[key] = None
                graph_refused(key, exc)
    s.synchronize()
    return n


def run_eager(m: CausalLM, b: int) -> None:
    """Enqueue one decode step over rows ``0 .. b-1`` op by op (no graph): the same ops
    as :func:`step_op`, each enqueued on :attr:`device_stream` as it is built."""
    s = m.device_stream
    for make in step_ops(m, b):
        make().async_on(s)


def step_op(m: CausalLM, b: int) -> DeviceOp[Any]:
    """One decode step over cache rows ``0 .. b-1`` (the op a graph captures)."""
    return chain(step_ops(m, b))


def step_ops(m: CausalLM, b: int) -> list[Thunk]:
    """The thunks of a decode step over rows ``0 .. b-1`` (built once per bucket)."""
    th = m._step_thunks.get(b)
    if th is None:
        th = m._step_thunks[b] = build_step(m, b)
    return th


def build_step(m: CausalLM, b: int) -> list[Thunk]:
    """Embed, layers, head, sample into the token buffer, advance ``start``/``kv_len``."""
    vw = m._arena.views(b, 1)
    st, kl, inc, tok = m._start[:b], m._kv_len[:b], m._inc[:b], m._tokens[:b]
    logits = m._logits[:b]
    temp, top_k, top_p = m._temperature[:b], m._top_k[:b], m._top_p[:b]
    seed, counter = m._seed[:b], m._counter[:b]
    th: list[Thunk] = [lambda: m.embed(tok, vw["resid"])]
    th += layers_chain(m.layers, m.cache, vw, m._table[:b], st, kl)
    th += head(m.norm, m.lm_head, vw["down"], vw["resid"], vw["normed"], logits)
    th += [
        lambda: kernels.sample(logits, temp, top_k, top_p, seed, counter, out=tok),
        lambda: kernels.add(st, inc, out=st),
        lambda: kernels.add(kl, inc, out=kl),
    ]
    return th
