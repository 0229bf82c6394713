"""Runner: one model's device state and its step API (prefill chunk, decode step, sampling).

A runner owns, all allocated once on one stream of one device: the activation arena, the
**paged** KV cache (a block pool ``(kv_blocks, Hkv, kv_block_size, D)`` per layer) with the
block table ``(max_batch, max_blocks)`` int32 in device memory (row ``b`` maps cache row
``b``'s positions to blocks; :mod:`.paged_kv`), the per-row decode and sampling state
(:mod:`.rows`), the logits buffer and the graphs: one decode graph per batch-size bucket
(:mod:`.decode`) and one prefill graph per padded chunk length (:mod:`.prefill`). It runs an
architecture's forward (:mod:`deviceops.nn.models`) over device weights it is given, and
knows nothing of tokenizers or serving.

Prefill runs the forward over the prompt in chunks of ``prefill_chunk`` tokens; on CUDA
each chunk is padded to a power of two and replays one graph per padded length (two: a
chunk at position 0 attends over its own keys, kept contiguous, so flash attention runs its
contiguous prefill kernel; a later chunk reads the paged cache), whatever the row. Decode
runs it over the first ``bucket`` cache rows (``bucket`` in 1, 2, 4, ..., ``max_batch``) as
one CUDA graph per bucket, captured once and replayed per token: positions, key counts, the
input tokens, and the sampling parameters and counters live in device memory, the graph
samples the next token straight into the token buffer and advances ``start``/``kv_len``
itself, so a steady decode step is one ``graph.launch()`` plus reading the chosen tokens.

Step API (what :class:`~deviceops.nn.CausalLM` exposes, what generation and the serving
engine use; every method enqueues on :attr:`Runner.stream` and returns without waiting):

* ``set_sampling(slot, temperature=0.0, top_k=0, top_p=1.0, seed=0, presence_penalty=0.0,
  frequency_penalty=0.0, logit_bias=None, logprobs=False, grammar=False)``: the row's
  sampling parameters; resets its random counter (draw ``n`` of a row uses ``(seed, n)``)
  and, with penalties or a bias, its token counts. Penalties and bias adjust the row's
  logits on the device before each draw; ``logprobs`` makes each draw also write the
  token's log-probability and the top 20 (:mod:`.rows`, ``read_logprobs``); ``grammar``
  makes each draw take only the tokens of the row's mask.
* ``set_mask(slots, bitmask)``: the masks (one bit per token; the host computes them from a
  grammar, :mod:`deviceops.nn.serving.grammar`) of rows set up with ``grammar=True``, for
  their next draw. ``decode_step(..., masks=fn)`` asks ``fn`` for them once the step's
  forward pass is enqueued, so the host computes them while the device runs it;
  ``decode_begin(slots, tokens, positions, masks) -> (view, finish)`` enqueues the forward
  pass and leaves the masks and the sampling to ``finish()``, so the host can read the
  previous step's tokens in between (the serving engine's lookahead with grammars).
* ``prefill(slot, ids, start=0, *, sample=True) -> Tensor | None``: writes the KV of
  ``ids`` at positions ``start ..`` of cache row ``slot``; with ``sample`` it samples the
  next token from the last position's logits into the token buffer and returns that
  ``(1,)`` int32 view (read it with ``read(view)``). A long prompt may come in several
  calls (chunks) with growing ``start``.
* ``prefill_many(chunks, *, graph=None) -> Tensor``: several rows' short prompt chunks
  ``(slot, ids, start, sample)`` in one forward pass (:mod:`.packed_prefill`), as the same
  ``prefill`` calls would write and draw; returns the token buffer (row ``slot`` holds a
  sampling chunk's token).
* ``decode_step(slots, tokens, positions, *, graph=None) -> Tensor``: one token per row:
  feeds ``tokens[i]`` at position ``positions[i]`` of row ``slots[i]`` and samples the
  next one; returns the ``(bucket,)`` token view, row ``slots[i]`` holding row i's token.
  Rows of the bucket that are not in ``slots`` are inactive: they write no KV (their
  position is past every block table: skipped), and their sampling counters are restored
  when they become active. A row continuing from the previous decode step (same slot, next
  position) must be given the token that step sampled: it is already on the device and is
  not uploaded again; any other change uploads the row state (one small copy).
* ``reserve(slot, n_tokens) -> bool``: give the row blocks for positions ``[0, n_tokens)``
  (it keeps those it has; uploads its block-table row); ``False`` (nothing taken) when
  the pool has too few free blocks. ``prefill``/``decode_step`` reserve what they write
  themselves (raising :class:`~.paged_kv.KVCacheFull` when the pool is exhausted), so an
  explicit reserve is only needed to claim memory up front (the serving engine does).
* ``release(slot)``: forget the row (it becomes inactive at the next decode step) and give
  its blocks back to the pool (cached ones stay cached, idle, until evicted).
* ``share_prefix(slot, hashes, start=0) -> int`` / ``cache_prefix(slot, hashes) -> int``:
  prefix caching (:mod:`.prefix_cache`): point the row at the cached blocks of a prompt's
  hash chain (it then prefills from the returned position on), and cache the row's written
  full blocks under theirs. ``prefill`` refuses to write into the row's cached blocks.
* ``read(view) -> DeviceOp[np.ndarray]``: the host copy of a token view.
* ``read_logprobs(n) -> DeviceOp[(values, ids)]``: host copies of rows ``0 .. n-1`` of the
  log-probability buffers (``(n, 21)`` float32: the sampled token's, then the top 20; ``(n,
  20)`` int32 ids), as the last draw of each row that asks for them wrote them; enqueue it
  right after the step whose tokens it goes with.
* ``prefill_logits(ids, slot) -> DeviceOp[Tensor]``: prefill logits of every position
  (``CausalLM.logits``).

Rows are independent: a row's tokens do not depend on what the other rows hold (up to
the floating-point differences of different GEMM shapes on the GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import deviceops
from deviceops import DeviceOp, Tensor, _env, api
from deviceops.scheduling import SingleStream

from .._args import check_adjustments, check_sampling
from ..models import Architecture, LlamaConfig, Weights
from .decode import Decoder, MaskSource
from .forward import Arena, buckets, chain
from .fused import make_fused
from .packed_prefill import MAX_CHUNK, Packer
from .paged_kv import BlockAllocator, BlockTable, KVCache
from .prefill import Prefiller
from .rows import GRAMMAR, RowState

__all__ = ["Runner"]


def _plain_ints(xs: Sequence[Any], end: int) -> list[int] | None:
    """``xs`` as a list when every item is a plain ``int`` in ``[0, end)`` (the fast path of a
    decode step's checks: a few C-level passes, no per-item ``isinstance``), else ``None``."""
    xs = list(xs)
    if xs and all(type(x) is int for x in xs) and min(xs) >= 0 and max(xs) < end:
        return xs
    return None


class Runner:
    """The device side of a model: buffers, paged KV, graphs and the step API (module docstring).

    Args:
        arch: the architecture whose forward runs.
        config: its hyper-parameters.
        weights: the device modules (``arch.bind``), on ``device``.
        device: the device (every op runs on :attr:`stream`, a stream of it).
        dtype: the activations' dtype (the weights').
        stream: the stream the weights were uploaded on (the runner's from now on).
        max_batch, max_seq, prefill_chunk, kv_block_size, kv_blocks: as
            :class:`~deviceops.nn.CausalLM` takes them (checked there).

    Attributes:
        stream, policy (``SingleStream(stream)``), arch, config, weights, device, dtype,
        max_batch, max_seq, prefill_chunk, cache (:class:`~.paged_kv.KVCache`), kv (the
        :class:`~.paged_kv.BlockTable`), rows (:class:`~.rows.RowState`), arena, logits,
        buckets, decoder (:class:`~.decode.Decoder`), prefiller
        (:class:`~.prefill.Prefiller`), contiguous_first_chunk, busy (a generate/stream runs).
    """

    def __init__(self, arch: Architecture, config: LlamaConfig, weights: Weights, *,
                 device: deviceops.Device, dtype: str, stream: deviceops.Stream, max_batch: int,
                 max_seq: int, prefill_chunk: int, kv_block_size: int, kv_blocks: int) -> None:
        self.arch = arch
        self.config = config
        self.weights = weights
        self.device = device
        self.dtype = dtype
        self.stream = stream
        self.policy = SingleStream(stream)
        self.max_batch = max_batch
        self.max_seq = max_seq
        self.prefill_chunk = min(prefill_chunk, max_seq)
        s = stream
        self.cache = KVCache.allocate(s, layers=config.num_layers, num_blocks=kv_blocks,
                                      kv_heads=config.num_kv_heads, block_size=kv_block_size,
                                      head_dim=config.head_dim, dtype=dtype)
        self.kv = BlockTable(s, max_batch, max_seq, BlockAllocator(kv_blocks, kv_block_size,
                                                                   reserved=1))
        self.arena = Arena(s, config, max(max_batch, self.prefill_chunk), dtype)
        self.logits = api.zeros((max(max_batch, 1), config.vocab_size), dtype).sync_on(s)
        # an idle row's position: past every table, never written
        self.rows = RowState(s, max_batch, self.kv.max_blocks * kv_block_size, config.vocab_size)
        # a chunk at position 0 attends over its own contiguous keys (flash_attention's
        # contiguous prefill kernel); DEVICEOPS_NN_PAGED_PREFILL=1: every chunk reads the
        # paged cache (set before the first prefill)
        self.contiguous_first_chunk = _env.get("DEVICEOPS_NN_PAGED_PREFILL") != "1"
        self.buckets = buckets(max_batch)
        self.fused = make_fused(self)  # a decode step in one kernel (DEVICEOPS_FUSED_DECODE)
        self.decoder = Decoder(self)
        self.prefiller = Prefiller(self)
        self.packer = Packer(self)
        self.busy = False

    # -- checks ------------------------------------------------------------------------------
    def check_ids(self, ids: Any, what: str) -> list[int]:
        """``ids`` as a non-empty list of ints in ``[0, vocab)``, else ``ValueError``."""
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        if not isinstance(ids, list | tuple) or not ids:
            raise ValueError(f"{what}: ids must be a non-empty list of token ids")
        v = self.config.vocab_size
        out = []
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int | np.integer) or not 0 <= int(t) < v:
                raise ValueError(f"{what}: token id {t!r} is not an int in [0, {v})")
            out.append(int(t))
        return out

    def check_slot(self, slot: Any, what: str) -> int:
        """``slot`` as a cache row in ``[0, max_batch)``, else ``ValueError``."""
        if isinstance(slot, bool) or not isinstance(slot, int | np.integer) or not (
                0 <= slot < self.max_batch):
            raise ValueError(f"{what}: slot {slot!r} is not a cache row in [0, {self.max_batch})")
        return int(slot)

    def graph_on(self, op: DeviceOp[Any]) -> Any:
        """Capture ``op`` into a graph on :attr:`stream`, under :attr:`policy` (a capture
        resolves the current policy; the default one lives on the default device)."""
        with deviceops.using(self.policy):
            return op.graph_on(self.stream)

    # -- step API (module docstring) ------------------------------------------------------------
    def set_sampling(self, slot: int, *, temperature: float = 0.0, top_k: int = 0,
                     top_p: float = 1.0, seed: int = 0, presence_penalty: float = 0.0,
                     frequency_penalty: float = 0.0, logit_bias: Any = None,
                     logprobs: bool = False, grammar: bool = False) -> None:
        """Set row ``slot``'s sampling parameters and features (device memory) and reset its
        counter (and, with penalties or a bias, its token counts; with ``grammar``, its mask
        to every token allowed); ``ValueError`` for a bad argument (``deviceops.nn._args``),
        before anything is uploaded."""
        slot = self.check_slot(slot, "set_sampling")
        sampling = check_sampling(temperature, top_k, top_p, seed)
        pres, freq, bias, _ = check_adjustments(presence_penalty, frequency_penalty, logit_bias,
                                                None, self.config.vocab_size, "set_sampling")
        self.rows.set_sampling(slot, *sampling)
        self.rows.set_features(slot, pres, freq, bias, bool(logprobs), bool(grammar))

    def set_mask(self, slots: Sequence[int], bitmask: np.ndarray) -> None:
        """Row ``slots[i]``'s grammar mask for its next draw: ``bitmask[i]``, int32
        ``ceil(vocab / 32)`` words, token ``t`` allowed when bit ``t % 32`` of word ``t // 32``
        is set (llguidance's layout); only rows set up with ``set_sampling(grammar=True)``
        apply it. Enqueued (the array is snapshotted now): a later ``prefill`` or
        ``decode_step`` of the row reads it. ``ValueError`` for a bad slot or shape."""
        sl = [self.check_slot(x, "set_mask") for x in slots]
        if len(set(sl)) != len(sl):
            raise ValueError(f"set_mask: slots {sl} repeat a row")
        missing = [x for x in sl if not self.rows.h_features[x] & GRAMMAR]
        if missing:
            raise ValueError(f"set_mask: rows {missing} have no grammar; call "
                             "set_sampling(slot, ..., grammar=True) first")
        self.rows.set_mask(sl, np.asarray(bitmask))

    def reserve(self, slot: int, n_tokens: int) -> bool:
        """Give row ``slot`` blocks for positions ``[0, n_tokens)``; ``False`` when too few
        are free (``ValueError`` for a bad slot or ``n_tokens`` outside ``[0, max_seq]``)."""
        slot = self.check_slot(slot, "reserve")
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int | np.integer) or not (
                0 <= n_tokens <= self.max_seq):
            raise ValueError(f"reserve: n_tokens={n_tokens!r} must be an int in [0, max_seq="
                             f"{self.max_seq}]")
        return self.kv.reserve(slot, int(n_tokens))

    def blocks_held(self, slot: int) -> int:
        """Blocks row ``slot`` holds."""
        return len(self.kv.row_blocks[self.check_slot(slot, "blocks_held")])

    def release(self, slot: int) -> None:
        """Forget row ``slot`` and give its blocks back to the pool."""
        slot = self.check_slot(slot, "release")
        self.rows.cont[slot] = False
        self.rows.primed[slot] = -1
        self.kv.release(slot)

    def share_prefix(self, slot: int, hashes: Sequence[bytes], start: int = 0) -> int:
        """Point row ``slot`` at the cached blocks of ``hashes`` from position ``start`` on
        (:meth:`~.paged_kv.BlockTable.share_prefix`); the positions it now shares."""
        slot = self.check_slot(slot, "share_prefix")
        if len(hashes) > self.kv.max_blocks:
            raise ValueError(f"share_prefix: {len(hashes)} block hashes exceed the row's "
                             f"{self.kv.max_blocks} blocks")
        return self.kv.share_prefix(slot, hashes, int(start))

    def cache_prefix(self, slot: int, hashes: Sequence[bytes]) -> int:
        """Cache row ``slot``'s leading (written, full) blocks under ``hashes``
        (:meth:`~.paged_kv.BlockTable.cache_prefix`); the blocks newly cached."""
        return self.kv.cache_prefix(self.check_slot(slot, "cache_prefix"), hashes)

    def prefill(self, slot: int, ids: Sequence[int], start: int = 0, *, sample: bool = True,
                graph: bool | None = None) -> Tensor | None:
        """Write the KV of ``ids`` at ``start ..`` of row ``slot``; sample the next token."""
        slot, ids_l = self.check_chunk(slot, ids, start, "prefill")
        return self.prefiller.prefill(slot, ids_l, start, sample, graph)

    def check_chunk(self, slot: Any, ids: Any, start: Any, what: str) -> tuple[int, list[int]]:
        """A prompt chunk's row and ids, checked: the row, the ids, positions ``start ..``
        inside ``max_seq``, and none of them in the row's cached (shared) blocks."""
        slot = self.check_slot(slot, what)
        ids_l = self.check_ids(list(ids), what)
        if not isinstance(start, int) or start < 0 or start + len(ids_l) > self.max_seq:
            raise ValueError(f"{what}: row {slot}'s positions {start}..{start + len(ids_l) - 1} "
                             f"do not fit max_seq={self.max_seq} (start must be an int >= 0)")
        frozen = self.kv.frozen(slot)
        if start < frozen:
            raise ValueError(f"{what}: row {slot}'s positions 0..{frozen - 1} are cached blocks "
                             f"other rows may read; start={start} would overwrite them (write "
                             f"from {frozen} on, or release the row first)")
        return slot, ids_l

    def prefill_many(self, chunks: Sequence[tuple[int, Sequence[int], int, bool]], *,
                     graph: bool | None = None) -> Tensor:
        """Prompt chunks ``(slot, ids, start, sample)`` of distinct rows in one packed forward
        pass (:mod:`.packed_prefill`); returns the token buffer view (row ``slot`` holds a
        sampling chunk's token). Each chunk as :meth:`prefill` takes it, at most
        :data:`~.packed_prefill.MAX_CHUNK` tokens, ``prefill_chunk`` tokens in all, rows
        without features (penalties, bias, log-probabilities: those use :meth:`prefill`)."""
        if not chunks:
            raise ValueError("prefill_many: no chunks")
        checked: list[tuple[int, list[int], int, bool]] = []
        for slot, ids, start, sample in chunks:
            slot, ids_l = self.check_chunk(slot, ids, start, "prefill_many")
            if len(ids_l) > MAX_CHUNK:
                raise ValueError(f"prefill_many: row {slot}'s chunk has {len(ids_l)} tokens; a "
                                 f"packed chunk takes at most {MAX_CHUNK} (use prefill)")
            if self.rows.h_features[slot]:
                raise ValueError(f"prefill_many: row {slot} has sampling features (penalties, "
                                 "logit bias or log-probabilities); prefill it with prefill")
            checked.append((slot, ids_l, start, bool(sample)))
        slots = [c[0] for c in checked]
        if len(set(slots)) != len(slots):
            raise ValueError(f"prefill_many: rows {slots} repeat a row")
        total = sum(len(c[1]) for c in checked)
        if total > self.packer.tokens:
            raise ValueError(f"prefill_many: {total} tokens exceed prefill_chunk="
                             f"{self.packer.tokens}")
        use_graph = (not self.device.is_cpu) if graph is None else bool(graph)
        self.packer.run(checked, use_graph)
        return self.rows.tokens

    def decode_step(self, slots: Sequence[int], tokens: Sequence[int] | None,
                    positions: Sequence[int], *, graph: bool | None = None,
                    masks: MaskSource | None = None) -> Tensor:
        """One decode step: feed ``tokens[i]`` at ``positions[i]`` of row ``slots[i]``
        (``tokens=None``: each row feeds the token its last decode step or its prefill
        sampled, still on the device; ``masks``: the grammar rows' masks, asked for once the
        forward pass is enqueued: :meth:`~.decode.Decoder.step`)."""
        sl, toks, pos = self._step_args(slots, tokens, positions)
        return self.decoder.step(sl, toks, pos, graph, masks)

    def decode_begin(self, slots: Sequence[int], tokens: Sequence[int] | None,
                     positions: Sequence[int], masks: MaskSource, *,
                     graph: bool | None = None) -> tuple[Tensor, Callable[[], None]]:
        """:meth:`decode_step` in two: enqueue the forward pass now; the returned ``finish()``
        asks ``masks`` for the grammar rows' masks and enqueues their upload and the
        sampling. Between the two the caller may do host work (read the previous step's
        tokens, from which the masks follow) but must enqueue nothing on :attr:`stream`
        (:meth:`~.decode.Decoder.begin`). Returns the token view (valid once ``finish`` is
        called) and ``finish``."""
        sl, toks, pos = self._step_args(slots, tokens, positions)
        return self.decoder.begin(sl, toks, pos, graph, masks)

    def _step_args(self, slots: Sequence[int], tokens: Sequence[int] | None,
                   positions: Sequence[int]) -> tuple[list[int], list[int] | None, list[int]]:
        """A decode step's slots, tokens and positions, checked (``ValueError``)."""
        n = len(slots)
        if n == 0 or (tokens is not None and len(tokens) != n) or len(positions) != n:
            raise ValueError(f"decode_step: slots ({len(slots)}), tokens "
                             f"({'None' if tokens is None else len(tokens)}) and positions "
                             f"({len(positions)}) must be non-empty and of equal length")
        sl, pos = _plain_ints(slots, self.max_batch), _plain_ints(positions, self.max_seq)
        toks = None if tokens is None else _plain_ints(tokens, self.config.vocab_size)
        if sl is None:  # not plain ints in range: the element-wise checks say which
            sl = [self.check_slot(x, "decode_step") for x in slots]
        if len(set(sl)) != n:
            raise ValueError(f"decode_step: slots {sl} repeat a row")
        if toks is None and tokens is not None:
            toks = self.check_ids(list(tokens), "decode_step")
        if pos is None:
            for p in positions:
                if isinstance(p, bool) or not isinstance(p, int | np.integer) or not (
                        0 <= p < self.max_seq):
                    raise ValueError(f"decode_step: position {p!r} is outside [0, max_seq="
                                     f"{self.max_seq})")
            pos = [int(p) for p in positions]
        return sl, toks, pos

    def capture_graphs(self, *, graph: bool | None = None, progress: bool = False) -> int:
        """Capture every decode bucket's and padded prefill length's graph now; returns how
        many were captured (none where graphs are not used: ``graph`` default, CUDA only).
        ``progress``: two named tqdm bars on stderr, one over the warm-up runs (where kernels
        compile on first use) and one over the captures."""
        from tqdm.auto import tqdm

        use_graph = (not self.device.is_cpu) if graph is None else bool(graph)
        if not use_graph:
            return 0
        keys = self.prefiller.kinds()
        packed = self.packer.lengths()
        # eager runs of the largest shapes first: the stream's kernel workspace reaches its
        # final size before any capture, so every graph shares one workspace
        warm: list[tuple[Callable[[Any], None], Any]] = [(self.decoder.warm_up, self.max_batch)]
        warm += [(self.prefiller.warm_up, k) for k in reversed(keys)]
        warm += [(self.packer.warm_up, t) for t in reversed(packed)]
        with tqdm(total=len(warm), desc="compiling kernels (warm-up runs)", unit="run",
                  disable=not progress, leave=False) as bar:
            for run, arg in warm:
                run(arg)
                bar.update()
        todo: list[Any] = [(self.decoder.capture, b) for b in self.buckets
                           if b not in self.decoder.graphs]
        todo += [(self.prefiller.capture, k) for k in keys if k not in self.prefiller.graphs]
        todo += [(self.packer.capture, t) for t in packed if t not in self.packer.graphs]
        n = 0
        with tqdm(total=len(todo), desc="capturing CUDA graphs", unit="graph",
                  disable=not progress, leave=False) as bar:
            for capture, key in todo:
                if capture(key) is not False:  # (Decoder.capture returns None; the others
                    n += 1                     # False when the capture was refused)
                bar.update()
        self.stream.synchronize()
        return n

    def read(self, view: Tensor) -> DeviceOp[np.ndarray]:
        """The host copy of a token view (run it on :attr:`stream`)."""
        return api.to_host(view)

    def read_logprobs(self, n: int) -> DeviceOp[tuple[np.ndarray, np.ndarray]]:
        """Host copies of rows ``0 .. n-1`` of the log-probability buffers (module docstring;
        run it on :attr:`stream`)."""
        lpv, lpi = self.rows.feature_buffers()[5:]
        return deviceops.zip(api.to_host(lpv[:n]), api.to_host(lpi[:n]))

    def prefill_logits(self, ids: Sequence[int], *, slot: int = 0) -> DeviceOp[Tensor]:
        """Prefill logits of ``ids`` into a fresh ``(len(ids), vocab)`` tensor (a lazy op;
        the row keeps the blocks it gets)."""
        ids_l = self.check_ids(list(ids), "logits")
        slot = self.check_slot(slot, "logits")
        if len(ids_l) > self.max_seq:
            raise ValueError(f"logits: {len(ids_l)} tokens exceed max_seq={self.max_seq}")
        self.kv.grow(slot, len(ids_l), "logits")
        n, ch, dev, pf = len(ids_l), self.prefill_chunk, self.device, self.prefiller

        def body(out: Tensor) -> DeviceOp[Any]:
            if out.device is not dev:  # executed on a stream of another device
                raise deviceops.DeviceError(
                    f"CausalLM.logits: the op is executing on a stream of {out.device}, but the "
                    f"model lives on {dev}; run it on the model's stream: "
                    "op.sync_on(model.device_stream), await op.schedule(model.policy), or "
                    "inside `with deviceops.using(model.policy):`",
                    op="CausalLM.logits", device=str(out.device))
            parts = [(a, ids_l[a:a + ch]) for a in range(0, n, ch)]
            thunks = [_chunk_thunk(pf, slot, p, a, out) for a, p in parts]
            return chain(thunks).map(lambda _: out)

        vocab, dtype = self.config.vocab_size, self.dtype
        # rooted at one of the runner's tensors: a policy that places ops by their data
        # (MultiDeviceRoundRobin) runs the op on the runner's device
        return (deviceops.value(self.kv.table)
                .then(lambda _: api.empty((n, vocab), dtype))
                .then(body))


def _chunk_thunk(pf: Prefiller, slot: int, part: list[int], a: int, out: Tensor) -> Any:
    return lambda: pf.chunk_op(slot, part, a, [], out)
