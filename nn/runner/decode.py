"""Decode: one token for each active row of a bucket of cache rows (``bucket`` in 1, 2, 4,
..., ``max_batch``), run eagerly op by op or as the bucket's CUDA graph, captured once and
replayed per token (:class:`Decoder`, a part of :class:`~.runner.Runner`, whose
:meth:`~.runner.Runner.decode_step` documents the behaviour).

Positions, key counts, input tokens and sampling state live in device memory
(:class:`~.rows.RowState`); the host keeps a shadow of them and uploads it only when a row
does not continue from the previous step. Every op runs on the runner's stream: graphs are
captured on it under the runner's own policy and replayed there, so nothing consults the
default policy, which lives on the default device.

**Two variants per bucket.** A step whose active rows ask for no feature (penalties, logit
bias, log-probabilities, a grammar mask: :mod:`.rows`) runs the *plain* step, unchanged:
embed, layers, LM head, ``sample``. A step where at least one active row asks runs the
*feature* step, the same ops plus :func:`~deviceops.kernels.penalize` and
:func:`~deviceops.kernels.mask_logits` before ``sample`` and
:func:`~deviceops.kernels.logprobs` after it, all gated per row by the state's ``live`` row
(the row's feature bits while active, else 0). Its graph (:attr:`Decoder.feature_graphs`) is
captured the first time a bucket needs it, once per model (a warm-up run and a capture,
inside that step). Cost: rows asking nothing pay nothing while no row of the batch asks;
in a feature step each of them costs one early-returning block per kernel (three launches
more per step); a row that asks pays one elementwise pass over its logits (penalties, bias),
one more for a grammar mask and ``1 + 20`` passes (log-probabilities and the top 20) per
token.

**Grammar masks** come from the host, which needs each constrained row's previous token
to compute them. A step given a mask source (``masks``) runs the feature step as two
graphs (:attr:`Decoder.split_graphs`): the forward pass is launched, the source is asked
for the masks (the host computes them while the device runs the forward pass), their upload
is enqueued, then the sampling graph (``penalize``, ``mask_logits``, ``sample``,
``logprobs``) is launched: one launch and one small copy more per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

import deviceops.kernels as kernels
from deviceops import DeviceOp, Tensor, api

from .forward import Thunk, chain, decoder_ops
from .fused import fused_rows

if TYPE_CHECKING:
    from .runner import Runner

__all__ = ["Decoder", "MaskSource"]

#: A decode step's grammar masks, asked for once the step's forward pass is enqueued (so the
#: host computes them while the device runs it): ``(slots, bitmask)`` (row ``i`` of the int32
#: bitmask for ``slots[i]``, :meth:`~.rows.RowState.set_mask`), or ``None`` for none.
MaskSource = Callable[[], "tuple[Sequence[int], np.ndarray] | None"]


def _nothing() -> None:
    return None


class Decoder:
    """The decode step of a runner and its graphs, one per bucket.

    Reads the runner's public parts: ``stream``, ``rows`` (:class:`~.rows.RowState`), ``kv``
    (:class:`~.paged_kv.BlockTable`), ``cache``, ``arena``, ``logits``, ``arch``,
    ``weights``, ``buckets`` and ``graph_on``.

    Attributes:
        graphs: bucket -> its captured plain graph.
        feature_graphs: bucket -> its captured feature graph (module docstring).
        split_graphs: bucket -> the feature step as two graphs, the forward pass and the
            sampling (a step with grammar masks: they are computed and uploaded between the
            two, while the device runs the first; module docstring).
    """

    def __init__(self, runner: Runner) -> None:
        self.r = runner
        self.graphs: dict[int, Any] = {}
        self.feature_graphs: dict[int, Any] = {}
        self.split_graphs: dict[int, tuple[Any, Any]] = {}
        self._thunks: dict[tuple[int, bool], tuple[list[Thunk], list[Thunk]]] = {}
        self._kept: Tensor | None = None  # the rows' tokens across a capture

    def step(self, slots: list[int], tokens: list[int] | None, positions: list[int],
             graph: bool | None, masks: MaskSource | None = None) -> Tensor:
        """One decode step of checked rows (:meth:`begin`, then its ``finish``); returns the
        ``(bucket,)`` token view."""
        view, finish = self.begin(slots, tokens, positions, graph, masks)
        finish()
        return view

    def begin(self, slots: list[int], tokens: list[int] | None, positions: list[int],
              graph: bool | None, masks: MaskSource | None = None
              ) -> tuple[Tensor, Callable[[], None]]:
        """One decode step of checked rows: grow their blocks, upload the state if it
        changed, run the bucket's step; returns the ``(bucket,)`` token view and ``finish``.
        With ``masks`` (next paragraph) only the forward pass is enqueued here, and
        ``finish()`` asks for the masks and enqueues their upload and the sampling: the
        caller may do host work in between (e.g. read the previous step's tokens, from which
        the masks follow) but must enqueue nothing on the stream; without, the whole step
        is enqueued here and ``finish`` does nothing. The host shadow is advanced here.

        ``masks`` (rows with a grammar): called once the step's forward pass is enqueued;
        the masks it returns are uploaded before the sampling ops, enqueued after it (the
        feature step split in two: :attr:`split_graphs`); not called when no row of the
        step has a feature (nothing would apply a mask).

        ``tokens=None``: every row feeds the token already on the device: a row continuing
        from the previous step at its next position feeds what that step sampled, a row
        whose prefill sampled (``rows.primed``) feeds that token at the position after its
        prompt. The host need not have read them, so a step can be enqueued before the
        previous one's tokens (or a prompt's first token) are read. An upload (the set of
        rows changed) then leaves the device's tokens as they are.

        Raises:
            ValueError: ``tokens=None`` for a row that neither continues from the previous
                step at its next position nor was primed by a prefill for that position.
        """
        r, rows = self.r, self.r.rows
        sa = np.asarray(slots, np.intp)
        pa = np.asarray(positions, np.int32)
        # a row that does not continue from the last step: the state must go up
        h = rows.h_state
        fresh = not (bool(rows.cont[sa].all()) and bool((h[0, sa] == pa).all())
                     and bool((h[2, sa] == 1).all()))
        if tokens is None and fresh:
            on_device = (rows.cont[sa] & (h[0, sa] == pa) & (h[2, sa] == 1)) | (
                rows.primed[sa] == pa)
            if not bool(on_device.all()):
                bad = [int(x) for x, ok in zip(sa, on_device, strict=True) if not ok]
                raise ValueError(
                    f"decode_step: tokens=None needs every row to continue from the previous "
                    f"step at its next position or to follow its prefill's sampled token; rows "
                    f"{bad} do neither at the positions given; give the tokens")
        bs, rb = r.kv.block_size, r.kv.row_blocks
        for x, p in zip(slots, positions, strict=True):
            if len(rb[x]) * bs <= p:  # position p needs a block the row does not hold yet
                r.kv.grow(x, int(p) + 1, "decode_step")
        b = next(x for x in r.buckets if x > max(slots))
        # (the whole array first: no row with features is the common case, and cheaper to see)
        feat = bool(rows.h_features.any()) and bool(rows.h_features[slots].any())
        split = feat and masks is not None
        graphs: dict[int, Any] = (self.split_graphs if split else
                                  self.feature_graphs if feat else self.graphs)
        # default: the bucket's graph on both backends (on cpu a replay is one hand-off of the
        # recorded step to the stream's worker, instead of ~280 op constructions and hand-offs)
        use_graph = True if graph is None else bool(graph)
        if use_graph and b not in graphs:
            self.capture(b, feat, split)
        want = rows.h_state.copy()
        active = np.zeros(r.max_batch, bool)
        active[sa] = True
        want[0, sa] = pa
        want[1, sa] = pa + 1
        want[2, sa] = 1
        if tokens is not None:
            want[3, sa] = np.asarray(tokens, np.int32)  # a continuing row's is the one there
        want[4, sa] = rows.h_features[sa]
        idle = ~active[:b]
        want[2, :b][idle] = 0
        want[4, :b][idle] = 0
        want[0, :b][idle & (want[0, :b] < rows.idle)] = rows.idle
        want[1, :b][idle] = 1
        old = rows.h_state  # every row but the tokens (row 3), compared as slices (no copies)
        changed = rows.dirty or fresh or not (np.array_equal(want[:3, :b], old[:3, :b])
                                              and np.array_equal(want[4, :b], old[4, :b]))
        if changed:
            if tokens is not None:
                want[3, slots] = tokens  # continuing rows too: the shadow holds their previous input
            want[3, :b][want[3, :b] < 0] = 0  # unknown tokens of idle rows: any valid id
            rows.upload_state(want, tokens=tokens is not None)
            rows.upload_counters()
            rows.dirty = False
        finish: Callable[[], None] = _nothing
        if split:
            if use_graph:
                head, tail = graphs[b]
                head.launch()
                sample: Callable[[], None] = tail.launch
            else:
                ops, rest = self._parts(b, True)
                self._enqueue(ops)

                def sample() -> None:
                    self._enqueue(rest)

            def finish() -> None:
                self._masks(masks)  # the host's mask work overlapped the forward pass
                sample()
        elif use_graph:
            graphs[b].launch()  # on the stream it was captured on; consults no policy
        else:
            self.run_eager(b, feat)
        # advance the shadow: active rows moved one position and drew one number
        want[0, slots] += 1
        want[1, slots] += 1
        rows.h_counter[slots] += 1
        rows.h_state = want
        rows.cont[:] = False
        rows.cont[slots] = True
        rows.primed[sa] = -1
        return rows.tokens[:b], finish

    def warm_up(self, b: int, feat: bool = False) -> None:
        """Run bucket ``b``'s step eagerly with its rows idle (no KV written)."""
        rows = self.r.rows
        rows.upload_state(rows.idle_state(b))
        self.step_op(b, feat).sync_on(self.r.stream)
        rows.dirty = True  # the warm-up advanced the idle rows' counters

    def capture(self, b: int, feat: bool = False, split: bool = False) -> None:
        """Warm bucket ``b`` up eagerly (all rows idle) and capture its plain or feature graph
        (``split``: the feature step as its forward and sampling graphs). The rows' device
        tokens are kept: a row may hold a sampled token the host has not read (``tokens=None``
        feeds it), and the warm-up samples over every row of the bucket."""
        r = self.r
        if self._kept is None:
            self._kept = api.zeros(tuple(r.rows.tokens.shape), "int32").sync_on(r.stream)
        api.memcpy(self._kept, r.rows.tokens).async_on(r.stream)
        self.warm_up(b, feat)
        if split:
            head, tail = self._parts(b, True)
            self.split_graphs[b] = (r.graph_on(chain(head)), r.graph_on(chain(tail)))
        else:
            graph = r.graph_on(self.step_op(b, feat))
            (self.feature_graphs if feat else self.graphs)[b] = graph
        api.memcpy(r.rows.tokens, self._kept).async_on(r.stream)

    def run_eager(self, b: int, feat: bool = False) -> None:
        """Enqueue one decode step over rows ``0 .. b-1`` op by op (no graph): the same ops
        as :meth:`step_op`, each enqueued on the runner's stream as it is built."""
        self._enqueue(self.step_ops(b, feat))

    def _enqueue(self, thunks: list[Thunk]) -> None:
        s = self.r.stream
        for make in thunks:
            make().async_on(s)

    def _masks(self, masks: MaskSource | None) -> None:
        """Ask ``masks`` for this step's grammar masks and enqueue their upload."""
        got = None if masks is None else masks()
        if got is not None:
            slots, bitmask = got
            self.r.rows.set_mask(list(slots), bitmask)

    def step_op(self, b: int, feat: bool = False) -> DeviceOp[Any]:
        """One decode step over cache rows ``0 .. b-1`` (the op a graph captures)."""
        return chain(self.step_ops(b, feat))

    def step_ops(self, b: int, feat: bool = False) -> list[Thunk]:
        """The thunks of a decode step over rows ``0 .. b-1`` (built once per bucket and
        variant)."""
        head, tail = self._parts(b, feat)
        return head + tail

    def _parts(self, b: int, feat: bool) -> tuple[list[Thunk], list[Thunk]]:
        """A step's thunks in two: the forward pass (to the logits) and the rest."""
        th = self._thunks.get((b, feat))
        if th is None:
            th = self._thunks[(b, feat)] = self._build(b, feat)
        return th

    def _build(self, b: int, feat: bool) -> tuple[list[Thunk], list[Thunk]]:
        """Embed, layers, final norm, LM head (one fused kernel for them all when the runner
        has a fused model and ``b`` fits it: :mod:`.fused`), (feature step: ``penalize``,
        ``mask_logits``)
        sample into the token buffer, (feature step: ``logprobs``), advance
        ``start``/``kv_len``."""
        r, rows = self.r, self.r.rows
        arch, w = r.arch, r.weights
        vw = r.arena.views(b, 1)
        st, kl, inc, tok = rows.start[:b], rows.kv_len[:b], rows.inc[:b], rows.tokens[:b]
        logits = r.logits[:b]
        temp, top_k, top_p = rows.temperature[:b], rows.top_k[:b], rows.top_p[:b]
        seed, counter = rows.seed[:b], rows.counter[:b]
        fused = r.fused
        if fused is not None and b <= fused_rows(fused):
            fused.prepare(b, state=rows.state, table=r.kv.table, k_cache=r.cache.k,
                          v_cache=r.cache.v, logits=logits)
            th: list[Thunk] = [lambda: fused.step(b, state=rows.state, table=r.kv.table,
                                                  k_cache=r.cache.k, v_cache=r.cache.v,
                                                  logits=logits)]
        else:
            th = arch.embed_ops(w, tok, vw["resid"])
            th += decoder_ops(arch, w, r.cache, vw, r.kv.table[:b], st, kl)
            th += arch.final_norm_ops(w, vw["down"], vw["resid"], vw["normed"])
            th += arch.lm_head_ops(w, vw["normed"], logits)
        def draw() -> DeviceOp[Any]:
            return kernels.sample(logits, temp, top_k, top_p, seed, counter, out=tok)

        head, th = th, []
        if feat:
            live = rows.live[:b]
            pres, freq, counts, bias, lpv, lpi = (t[:b] for t in rows.feature_buffers()[1:])
            assert rows.mask is not None  # allocated with the feature buffers
            mask = rows.mask[:b]
            th += [
                lambda: kernels.penalize(logits, counts, bias, pres, freq, live),
                lambda: kernels.mask_logits(logits, mask, live),
                draw,
                lambda: kernels.logprobs(logits, tok, live, counts, k=lpi.shape[1], out=lpv,
                                         ids_out=lpi),
            ]
        else:
            th.append(draw)
        th += [
            lambda: kernels.add(st, inc, out=st),
            lambda: kernels.add(kl, inc, out=kl),
        ]
        return head, th
