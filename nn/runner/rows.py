"""The per-row decode state of a :class:`~.runner.Runner`, on the device and its host shadow.

Device memory, one column per cache row: ``state`` ``(5, max_batch)`` int32 with the rows
``start`` (the position the next input token is written at), ``kv_len`` (valid keys after
that write), ``inc`` (1 for an active row, 0 for an idle one: what a decode step adds to
``start``/``kv_len``), ``tokens`` (the input token; a decode step samples the next one
into it) and ``live`` (the row's ``features`` while it is active in the decode step, else 0);
the sampling parameters ``temperature``, ``top_k``, ``top_p``, ``seed`` and the random
``counter`` (draw ``n`` of a row uses ``(seed, n)``).

**Features** (OpenAI's logits adjustments and log-probabilities), per row an int32 bit set
``features``: bit 0 (:data:`ADJUST`) applies ``presence``/``frequency`` penalties over the
row's ``counts`` of generated tokens and its dense ``bias`` row before sampling
(:func:`deviceops.kernels.penalize`) and counts each sampled token; bit 1 (:data:`LOGPROBS`)
writes the sampled token's log-probability and the top :data:`TOP` into ``lp_values``
``(max_batch, TOP + 1)`` / ``lp_ids`` ``(max_batch, TOP)`` (:func:`deviceops.kernels.logprobs`);
bit 2 (:data:`GRAMMAR`) sets the logits of the tokens a grammar forbids to ``-inf`` before
sampling, from the row's ``mask`` row ``(max_batch, ceil(vocab / 32))`` int32 (one bit per
token, :func:`deviceops.kernels.mask_logits`), which the host uploads before each step that
samples for the row (:meth:`RowState.set_mask`).
``counts`` and ``bias`` are ``(max_batch, vocab)`` (int32, float32: 8 bytes per row and
vocabulary entry), allocated with the log-probability buffers the first time a row asks for a
feature (:meth:`RowState.ensure_features`); a model whose rows never ask allocates none.

The host keeps a shadow (``h_state``, ``h_counter``, ``h_sampling``, ``h_features``) and
uploads it only when a decode step's rows do not simply continue from the previous step
(``cont``), or after something else touched the device state (``dirty``). ``primed`` holds,
per row, the position at which the token its last prefill chunk sampled (on the device,
maybe unread) is fed, so a decode step can feed it without the host having read it. An idle row's
position is ``idle``: past every block table, so its writes are skipped.
"""

from __future__ import annotations

import numpy as np

from deviceops import Stream, Tensor, api

__all__ = ["ADJUST", "GRAMMAR", "LOGPROBS", "TOP", "RowState"]

#: ``features`` bit: penalties and logit bias (and counting the sampled tokens).
ADJUST = 1
#: ``features`` bit: the sampled token's log-probability and the top :data:`TOP`.
LOGPROBS = 2
#: ``features`` bit: the row's grammar mask (``mask``) applied to its logits before sampling.
GRAMMAR = 4
#: Top log-probabilities computed per row that asks (OpenAI's ``top_logprobs`` maximum, the
#: largest ``k`` of :func:`deviceops.kernels.logprobs`).
TOP = 20


class RowState:
    """Device and host state of ``max_batch`` cache rows (module docstring).

    Args:
        stream: the runner's stream (allocation and uploads).
        max_batch: rows.
        idle: the position of an idle row (``max_blocks * block_size``).
        vocab: the vocabulary size (the feature buffers' width).
    """

    def __init__(self, stream: Stream, max_batch: int, idle: int, vocab: int) -> None:
        n = max_batch
        self.stream = stream
        self.idle = idle
        self.vocab = vocab
        self.state = api.zeros((5, n), "int32").sync_on(stream)
        self.start, self.kv_len, self.inc, self.tokens, self.live = (
            self.state[i] for i in range(5))
        self.temperature = api.zeros((n,), "float32").sync_on(stream)
        self.top_k = api.zeros((n,), "int32").sync_on(stream)
        self.top_p = api.ones((n,), "float32").sync_on(stream)
        self.seed = api.zeros((n,), "int64").sync_on(stream)
        self.counter = api.zeros((n,), "int64").sync_on(stream)
        self.h_sampling = [(0.0, 0, 1.0, 0)] * n  # temperature, top_k, top_p, seed
        self.h_features = np.zeros((n,), np.int32)
        self.features: Tensor | None = None  # the feature buffers, allocated on first use
        self.presence: Tensor | None = None
        self.frequency: Tensor | None = None
        self.counts: Tensor | None = None
        self.bias: Tensor | None = None
        self.lp_values: Tensor | None = None
        self.lp_ids: Tensor | None = None
        self.mask: Tensor | None = None
        self.h_state = np.zeros((5, n), np.int32)
        self.h_state[0] = idle  # inactive: writes skipped
        self.h_state[1] = 1
        self.h_counter = np.zeros((n,), np.int64)
        self.cont = np.zeros((n,), bool)  # row continues from the last decode step
        #: the position a row's prefill-sampled token (on the device) is fed at; -1: none
        self.primed = np.full((n,), -1, np.int64)
        self.dirty = True

    def set_sampling(self, slot: int, temperature: float, top_k: int, top_p: float,
                     seed: int) -> None:
        """Upload row ``slot``'s sampling parameters and reset its counter (checked values)."""
        r = slice(slot, slot + 1)
        for dst, val, dt in ((self.temperature, temperature, np.float32),
                             (self.top_k, top_k, np.int32), (self.top_p, top_p, np.float32),
                             (self.seed, seed, np.int64), (self.counter, 0, np.int64)):
            api.memcpy(dst[r], api.from_host(np.array([val], dt))).async_on(self.stream)
        self.h_sampling[slot] = (temperature, top_k, top_p, seed)
        self.h_counter[slot] = 0
        self.cont[slot] = False
        self.primed[slot] = -1

    def ensure_features(self) -> None:
        """Allocate the feature buffers (module docstring) once, enqueued on the stream."""
        if self.features is not None:
            return
        n, v, s = self.h_features.shape[0], self.vocab, self.stream
        self.features = api.zeros((n,), "int32").async_on(s)
        self.presence = api.zeros((n,), "float32").async_on(s)
        self.frequency = api.zeros((n,), "float32").async_on(s)
        self.counts = api.zeros((n, v), "int32").async_on(s)
        self.bias = api.zeros((n, v), "float32").async_on(s)
        self.lp_values = api.zeros((n, TOP + 1), "float32").async_on(s)
        self.lp_ids = api.zeros((n, TOP), "int32").async_on(s)
        self.mask = api.full((n, -(-v // 32)), -1, "int32").async_on(s)

    def feature_buffers(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``(features, presence, frequency, counts, bias, lp_values, lp_ids)``, allocated."""
        self.ensure_features()
        out = (self.features, self.presence, self.frequency, self.counts, self.bias,
               self.lp_values, self.lp_ids)
        assert all(t is not None for t in out)
        return out  # type: ignore[return-value]

    def set_features(self, slot: int, presence: float, frequency: float,
                     bias: tuple[tuple[int, float], ...], logprobs: bool,
                     grammar: bool = False) -> None:
        """Row ``slot``'s features (checked values): with penalties or a bias, its counts are
        zeroed and its dense bias row uploaded; with ``grammar`` its mask row is set to allow
        every token until :meth:`set_mask` says otherwise; a row asking for nothing only gets
        its host bit set cleared (no device buffer is allocated, read or written for it)."""
        mode = ((ADJUST if presence or frequency or bias else 0) | (LOGPROBS if logprobs else 0)
                | (GRAMMAR if grammar else 0))
        self.cont[slot] = False
        self.h_features[slot] = 0
        if mode == 0:
            return
        feats, pres, freq, counts, dense_bias = self.feature_buffers()[:5]
        r, s = slice(slot, slot + 1), self.stream
        for dst, val, dt in ((feats, mode, np.int32), (pres, presence, np.float32),
                             (freq, frequency, np.float32)):
            api.memcpy(dst[r], api.from_host(np.array([val], dt))).async_on(s)
        if mode & ADJUST:
            dense = np.zeros((1, self.vocab), np.float32)
            for t, b in bias:
                dense[0, t] = b
            api.memcpy(dense_bias[r], api.from_host(dense)).async_on(s)
            api.memcpy(counts[r], api.from_host(np.zeros((1, self.vocab), np.int32))
                       ).async_on(s)
        if mode & GRAMMAR:
            self.set_mask([slot], np.full((1, -(-self.vocab // 32)), -1, np.int32))
        self.h_features[slot] = mode

    def set_mask(self, slots: list[int], bitmask: np.ndarray) -> None:
        """Upload ``bitmask[i]`` (int32, ``ceil(vocab / 32)`` words: token ``t`` allowed when
        bit ``t % 32`` of word ``t // 32`` is set) as row ``slots[i]``'s grammar mask, in one
        copy of the rows ``min(slots) .. max(slots)`` (a row between them that is not in
        ``slots`` gets every token allowed: only a row's own steps read its mask, and each
        is preceded by its own upload), ordered before the next step on the stream (the host
        array is snapshotted now)."""
        mask = self.mask
        assert mask is not None, "set_mask before set_features(grammar=True)"
        w = mask.shape[1]
        if bitmask.shape != (len(slots), w) or bitmask.dtype != np.int32:
            raise ValueError(f"set_mask: bitmask is {bitmask.dtype} {bitmask.shape}; expected "
                             f"int32 ({len(slots)}, {w}) (one row of ceil(vocab/32) words per slot)")
        if not slots:
            return
        lo, hi = min(slots), max(slots) + 1
        block = bitmask
        if hi - lo != len(slots) or list(slots) != list(range(lo, hi)):
            block = np.full((hi - lo, w), -1, np.int32)
            block[np.asarray(slots) - lo] = bitmask
        api.memcpy(mask[lo:hi], api.from_host(block)).async_on(self.stream)

    def idle_state(self, b: int) -> np.ndarray:
        """The shadow with rows ``0 .. b-1`` idle (what a warm-up step runs over)."""
        idle = self.h_state.copy()
        idle[0, :b], idle[1, :b], idle[2, :b], idle[4, :b] = self.idle, 1, 0, 0
        idle[3, :b][idle[3, :b] < 0] = 0
        return idle

    def upload_state(self, state: np.ndarray, *, tokens: bool = True) -> None:
        """Copy ``state`` ``(5, max_batch)`` to the device rows (not the shadow); with
        ``tokens=False`` every row but ``tokens``, which keeps what the last step sampled."""
        if tokens:
            api.memcpy(self.state, api.from_host(state)).async_on(self.stream)
            return
        api.memcpy(self.state[0:3], api.from_host(np.ascontiguousarray(state[0:3]))
                   ).async_on(self.stream)
        api.memcpy(self.state[4:5], api.from_host(np.ascontiguousarray(state[4:5]))
                   ).async_on(self.stream)

    def upload_counters(self) -> None:
        """Copy the host counters to the device."""
        api.memcpy(self.counter, api.from_host(self.h_counter)).async_on(self.stream)
