"""CausalLM: a Llama-architecture language model running on deviceops kernels.

The model owns its weights (device tensors; QKV and gate/up fused at load, stored
``(N, K)`` and used through ``gemm(..., trans_b=True)``), one activation arena, the
**paged** KV cache (a block pool ``(kv_blocks, Hkv, kv_block_size, D)`` per layer, see
:mod:`.kv_cache`), the block table ``(max_batch, max_blocks)`` int32 in device memory
(row ``b`` maps cache row ``b``'s positions to blocks) and the per-row decode state, all
allocated once. A forward step is a lazy chain of kernel ops writing into them::

    embedding -> per layer: add_rms_norm, QKV gemm, rope_kv_write (RoPE + cache write),
    flash_attention(causal, kv_len), merge_heads, O gemm, add_rms_norm, gate/up gemm,
    swiglu, down gemm -> final norm -> LM head (only rows that need logits) -> sample

Prefill runs that chain with flash attention over the prompt (in chunks of
``prefill_chunk`` tokens; on CUDA each chunk is padded to a power of two and replays one
graph per padded length (two: a chunk at position 0 attends over its own keys, kept
contiguous, so flash attention runs its contiguous prefill kernel; a later chunk reads the
paged cache), whatever the row: ids, positions, the row's block-table row and sampling
parameters are copied into device buffers the graph reads). Decode runs it over
the first ``bucket`` cache rows (``bucket`` in 1, 2, 4, ..., ``max_batch``) as one CUDA
graph per bucket (the block table is read from device memory), captured once
and replayed per token: positions (``start``), key counts (``kv_len``), the input tokens,
and the sampling parameters and counters live in device memory, the graph samples the
next token straight into the token buffer and advances ``start``/``kv_len`` itself, so a
steady decode step is one ``graph.launch()`` plus reading the chosen tokens.

Internal step API (what :mod:`.generation` and a continuous-batching engine use; all
methods enqueue on :attr:`CausalLM.device_stream` and return without waiting):

* ``set_sampling(slot, temperature=0.0, top_k=0, top_p=1.0, seed=0)``: the row's sampling
  parameters; resets its random counter (draw ``n`` of a row uses ``(seed, n)``).
* ``prefill(slot, ids, start=0, *, sample=True) -> Tensor | None``: writes the KV of
  ``ids`` at positions ``start ..`` of cache row ``slot``; with ``sample`` it samples the
  next token from the last position's logits into the token buffer and returns that
  ``(1,)`` int32 view (read it with ``read(view)``). A long prompt may come in several
  calls (chunks) with growing ``start``.
* ``decode_step(slots, tokens, positions, *, graph=None) -> Tensor``: one token per row:
  feeds ``tokens[i]`` at position ``positions[i]`` of row ``slots[i]`` and samples the
  next one; returns the ``(bucket,)`` token view, row ``slots[i]`` holding row i's token.
  Rows of the bucket that are not in ``slots`` are inactive: they write no KV
  (their position is past every block table: skipped), and their sampling counters are restored when
  they become active. A row continuing from the previous decode step (same slot, next
  position) must be given the token that step sampled: it is already on the device
  and is not uploaded again; any other change uploads the row state (one small copy).
* ``reserve(slot, n_tokens) -> bool``: give the row blocks for positions ``[0, n_tokens)``
  (it keeps those it has; uploads its block-table row); ``False`` (nothing taken) when
  the pool has too few free blocks. ``prefill``/``decode_step`` reserve what they write
  themselves (raising :class:`KVCacheFull` when the pool is exhausted), so an explicit
  reserve is only needed to claim memory up front (the serving engine does, at admission).
* ``release(slot)``: forget the row (it becomes inactive at the next decode step) and give
  its blocks back to the pool.
* ``read(view) -> DeviceOp[np.ndarray]``: the host copy of a token view (run it on the
  model's stream: ``sync_on(model.device_stream)`` or ``await op.schedule(model.policy)``).

Devices: a model lives on one device (``device=``: ``"cpu"``, ``"cpu:N"``, ``"cuda"``,
``"cuda:N"``, an int N or a :class:`~deviceops.Device`; default: the default device when
it is built), and every op it enqueues — weight upload, arena, KV pools, block table, per-row state, graph
captures and replays, eager steps, host copies — runs on :attr:`CausalLM.device_stream`, a
stream of that device, never on a stream of the default policy (which lives on the
*default* device, possibly another one). The ops it hands out (:meth:`CausalLM.logits`,
:meth:`CausalLM.read`) must run there too: ``op.sync_on(model.device_stream)``,
``await op.schedule(model.policy)`` or inside ``with deviceops.using(model.policy):``;
run on a stream of another device they raise :class:`~deviceops.DeviceError` naming the
fix.

Rows are independent: a row's tokens do not depend on what the other rows hold (up to
the floating-point differences of different GEMM shapes on the GPU).

Layout: this module holds the model's state and its public methods; the work is done by
functions of the model in :mod:`._forward` (arena, layer chain, head), :mod:`._weights`
(weight binding), :mod:`._prefill` (eager and graphed prompt chunks) and :mod:`._decode`
(the decode step, bucket graphs, ``capture_graphs``).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np

import deviceops
from deviceops import DeviceOp, Tensor, api
from deviceops.scheduling import SingleStream

from . import _args, _decode, _prefill
from ._forward import Arena, Thunk, buckets, chain
from ._weights import bind_weights
from .config import LlamaConfig
from .kv_cache import BlockAllocator, KVCache
from .tokenizer import ChatTemplate

__all__ = ["CausalLM", "KVCacheFull", "buckets", "chain", "check_sampling"]


class KVCacheFull(RuntimeError):
    """The KV block pool has too few free blocks for what a row must write."""


_DTYPES = ("float32", "float16", "bfloat16")


def resolve_device(device: Any, what: str = "CausalLM") -> deviceops.Device:
    """The :class:`~deviceops.Device` a model is built on.

    Args:
        device: a Device, ``"cpu"``, ``"cpu:N"``, ``"cuda"``, ``"cuda:N"``, an int N (CUDA
            ordinal), or ``None``: the default device at this moment.
        what: the caller, named in errors.

    Raises:
        TypeError, ValueError: ``device`` names no device.
        DeviceError: a CUDA device that does not exist (or no GPU at all).
    """
    if device is None:
        return deviceops.default_device()
    try:
        return deviceops.device(device)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{what}: {exc}") from exc


class CausalLM:
    """A Llama-architecture causal language model on deviceops kernels.

    Build it with :func:`deviceops.nn.load_gguf`, :func:`deviceops.nn.smollm2` or
    :func:`deviceops.nn.load_safetensors`.

    Args:
        config: the hyper-parameters.
        weights: float32 host arrays by Hugging Face name (see :mod:`.loader`).
        tokenizer: a ``tokenizers.Tokenizer``.
        chat_template: the jinja2 chat template text, if any.
        dtype: ``"float16"``, ``"bfloat16"`` or ``"float32"``; ``None``: float16 on CUDA,
            float32 on the cpu backend.
        device: where the model lives and runs: a :class:`~deviceops.Device`, ``"cpu"``,
            ``"cpu:N"`` (an emulated cpu device), ``"cuda"``, ``"cuda:N"``, a CUDA index, or
            ``None`` (the default device now). Every op of the model runs on a stream of it,
            whatever the default device and policy are later.
        max_batch: cache rows (concurrent sequences); ``None``: 32 on CUDA, 4 on cpu.
        max_seq: positions per row; ``None``: ``min(context, 2048)`` on CUDA, 1024 on cpu.
        prefill_chunk: prompt tokens per prefill launch (longer prompts go in chunks).
        kv_block_size: positions per KV block (the paged cache's unit).
        kv_blocks: blocks in the pool, the null block included; ``None``: enough for every
            row at ``max_seq`` (``max_batch * ceil(max_seq / kv_block_size) + 1``). Fewer
            lets ``max_batch`` rows share less memory (rows hold only the blocks their
            length needs; see ``reserve``).

    Attributes:
        config, tokenizer, device, dtype, device_stream (the stream of :attr:`device` every
        op of the model is enqueued on), policy (``SingleStream(device_stream)``: schedule or
        await the ops the model hands out with it), max_batch, max_seq, cache (the block
        pools), blocks (the :class:`~.kv_cache.BlockAllocator`), block_size, max_blocks
        (block-table columns).
    """

    def __init__(self, config: LlamaConfig, weights: dict[str, np.ndarray], *, tokenizer: Any,
                 chat_template: str | None = None, dtype: str | None = None, device: Any = None,
                 max_batch: int | None = None, max_seq: int | None = None,
                 prefill_chunk: int = 512, kv_block_size: int = 16,
                 kv_blocks: int | None = None) -> None:
        dev = resolve_device(device)
        if dtype is None:
            dtype = "float32" if dev.is_cpu else "float16"
        dtype = str(np.dtype(dtype)) if dtype not in _DTYPES else dtype
        if dtype not in _DTYPES:
            raise ValueError(f"CausalLM: dtype {dtype!r} is not supported; use one of {_DTYPES}")
        if max_batch is None:
            max_batch = 4 if dev.is_cpu else 32
        if max_seq is None:
            max_seq = min(config.max_position_embeddings, 1024 if dev.is_cpu else 2048)
        for name, val in (("max_batch", max_batch), ("max_seq", max_seq), ("prefill_chunk", prefill_chunk),
                          ("kv_block_size", kv_block_size)):
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"CausalLM: {name}={val!r} must be a positive int")
        mb = -(-max_seq // kv_block_size)
        if kv_blocks is None:
            kv_blocks = max_batch * mb + 1
        if isinstance(kv_blocks, bool) or not isinstance(kv_blocks, int) or kv_blocks < 2:
            raise ValueError(f"CausalLM: kv_blocks={kv_blocks!r} must be an int >= 2 (block 0 is "
                             "the null block)")
        self.config = config
        self.tokenizer = tokenizer
        self.device = dev
        self.dtype = dtype
        self.max_batch = max_batch
        self.max_seq = max_seq
        self.prefill_chunk = min(prefill_chunk, max_seq)
        self.device_stream = dev.new_stream()
        self.policy = SingleStream(self.device_stream)
        self._template = None
        if chat_template:
            bos = self._token_text(config.bos_token_id)
            eos = self._token_text(config.eos_token_id)
            self._template = ChatTemplate(chat_template, bos_token=bos, eos_token=eos)
        wts = bind_weights(config, weights, self.device_stream, dtype)
        self.embed, self.lm_head, self.norm, self.layers = wts.embed, wts.lm_head, wts.norm, wts.layers
        self._weights = wts
        s = self.device_stream
        self.block_size = kv_block_size
        self.max_blocks = mb
        self._idle = mb * kv_block_size  # an idle row's position: past every table, never written
        self.cache = KVCache.allocate(s, layers=config.num_layers, num_blocks=kv_blocks,
                                      kv_heads=config.num_kv_heads, block_size=kv_block_size,
                                      head_dim=config.head_dim, dtype=dtype)
        self.blocks = BlockAllocator(kv_blocks, kv_block_size, reserved=1)
        self._table = api.zeros((max_batch, mb), "int32").sync_on(s)  # 0: the null block
        self._row_blocks: list[list[int]] = [[] for _ in range(max_batch)]
        self._arena = Arena(s, config, max(max_batch, self.prefill_chunk), dtype)
        self._logits = api.zeros((max(max_batch, 1), config.vocab_size), dtype).sync_on(s)
        # per-row decode state, device: (4, max_batch) int32 rows start, kv_len, inc, token
        n = max_batch
        self._state = api.zeros((4, n), "int32").sync_on(s)
        self._start, self._kv_len, self._inc, self._tokens = (self._state[i] for i in range(4))
        self._temperature = api.zeros((n,), "float32").sync_on(s)
        self._top_k = api.zeros((n,), "int32").sync_on(s)
        self._top_p = api.ones((n,), "float32").sync_on(s)
        self._seed = api.zeros((n,), "int64").sync_on(s)
        self._counter = api.zeros((n,), "int64").sync_on(s)
        self._pf_pos = api.zeros((3,), "int32").sync_on(s)  # eager prefill: start, kv_len, last row
        # graph prefill inputs, one upload per dtype: int32 [ids (chunk) | start, kv_len, last
        # row, top_k | block-table row (max_blocks)], float32 [temperature, top_p], int64
        # [seed, counter]; the graph samples into _pf_tok
        c = self.prefill_chunk
        self._pf_i32 = api.zeros((c + 4 + mb,), "int32").sync_on(s)
        self._pf_f32 = api.zeros((2,), "float32").sync_on(s)
        self._pf_i64 = api.zeros((2,), "int64").sync_on(s)
        self._pf_tok = api.zeros((1,), "int32").sync_on(s)
        self._pf_row = api.zeros((1, config.hidden_size), dtype).sync_on(s)
        # (padded length, chunk at position 0) -> graph (None: capture refused)
        self._pf_graphs: dict[tuple[int, bool], Any] = {}
        self._h_sampling = [(0.0, 0, 1.0, 0)] * n  # host copy: temperature, top_k, top_p, seed
        # a chunk at position 0 attends over its own contiguous keys (flash_attention's
        # contiguous prefill kernel); DEVICEOPS_NN_PAGED_PREFILL=1: every chunk reads the
        # paged cache (set before the first prefill)
        self.contiguous_first_chunk = os.environ.get("DEVICEOPS_NN_PAGED_PREFILL", "0") != "1"
        # host shadow of the device state (see decode)
        self._h_state = np.zeros((4, n), np.int32)
        self._h_state[0] = self._idle  # inactive: writes skipped
        self._h_state[1] = 1
        self._h_counter = np.zeros((n,), np.int64)
        self._cont = np.zeros((n,), bool)  # row continues from the last decode step
        self._dirty = True
        self._graphs: dict[int, Any] = {}
        self._step_thunks: dict[int, list[Thunk]] = {}
        self._busy = False  # a generate/stream is running (see generation)
        self._bucket_list = buckets(max_batch)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the device weights (a decode step reads each once)."""
        return self._weights.nbytes

    # -- tokenizer ---------------------------------------------------------------------------
    def _token_text(self, tid: int | None) -> str:
        if tid is None:
            return ""
        t = self.tokenizer.id_to_token(int(tid))
        return "" if t is None else str(t)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens such as ``<|im_start|>`` matched; no BOS for
        models whose tokenizer adds none, like SmolLM2)."""
        if not isinstance(text, str):
            raise TypeError(f"encode: text must be a str, got {type(text).__name__}")
        ids = [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False).ids]
        if self.config.add_bos_token and self.config.bos_token_id is not None:
            ids = [self.config.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``: special tokens kept, as the model's own tokenizer decodes, or with
        ``skip_special_tokens=True`` left out (``<|im_end|>``, EOS: the text a user reads)."""
        return str(self.tokenizer.decode([int(i) for i in ids],
                                         skip_special_tokens=bool(skip_special_tokens)))

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> str:
        """The prompt text of a conversation (the model's template, ``add_generation_prompt=True``).

        Raises:
            ValueError: the checkpoint has no chat template, or a message is malformed.
        """
        if self._template is None:
            raise ValueError("apply_chat_template: this checkpoint has no chat template")
        return self._template.render(messages, add_generation_prompt=True)

    def _check_ids(self, ids: Any, what: str) -> list[int]:
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

    def _check_slot(self, slot: Any, what: str) -> int:
        if isinstance(slot, bool) or not isinstance(slot, int | np.integer) or not 0 <= slot < self.max_batch:
            raise ValueError(f"{what}: slot {slot!r} is not a cache row in [0, {self.max_batch})")
        return int(slot)

    # -- public forward ----------------------------------------------------------------------
    def logits(self, ids: Sequence[int], *, slot: int = 0) -> DeviceOp[Tensor]:
        """Prefill logits of ``ids``: a lazy op producing a fresh ``(len(ids), vocab)`` tensor.

        It writes the prompt's keys and values into cache row ``slot`` (default 0), which
        gets the blocks it needs and keeps them (:meth:`release` gives them back).

        Run the op on the model's stream: ``op.sync_on(model.device_stream)``, ``await
        op.schedule(model.policy)`` or inside ``with deviceops.using(model.policy):`` (a
        policy that places ops by their data, such as ``MultiDeviceRoundRobin``, also
        finds the model's device). The output lives on :attr:`device`.

        Raises:
            ValueError: bad ids or slot, or more than ``max_seq`` tokens (at the call).
            KVCacheFull: the pool has too few free blocks (at the call).
            DeviceError: the op was executed on a stream of another device than the
                model's (when it is enqueued; nothing of the model runs).
        """
        ids_l = self._check_ids(list(ids), "logits")
        slot = self._check_slot(slot, "logits")
        if len(ids_l) > self.max_seq:
            raise ValueError(f"logits: {len(ids_l)} tokens exceed max_seq={self.max_seq}")
        self._grow(slot, len(ids_l), "logits")
        n, ch, dev = len(ids_l), self.prefill_chunk, self.device

        def body(out: Tensor) -> DeviceOp[Any]:
            if out.device is not dev:  # executed on a stream of another device
                raise deviceops.DeviceError(
                    f"CausalLM.logits: the op is executing on a stream of {out.device}, but the "
                    f"model lives on {dev}; run it on the model's stream: "
                    "op.sync_on(model.device_stream), await op.schedule(model.policy), or "
                    "inside `with deviceops.using(model.policy):`",
                    op="CausalLM.logits", device=str(out.device))
            parts = [(a, ids_l[a:a + ch]) for a in range(0, n, ch)]
            thunks = [_prefill.bind_chunk(self, slot, p, a, out) for a, p in parts]
            return chain(thunks).map(lambda _: out)

        vocab, dtype = self.config.vocab_size, self.dtype
        # rooted at one of the model's tensors: a policy that places ops by their data
        # (MultiDeviceRoundRobin) runs the op on the model's device
        return (deviceops.value(self._table)
                .then(lambda _: api.empty((n, vocab), dtype))
                .then(body))

    # -- step API (see the module docstring) -------------------------------------------------
    def set_sampling(self, slot: int, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                     seed: int = 0) -> None:
        """Set row ``slot``'s sampling parameters (device memory) and reset its counter."""
        slot = self._check_slot(slot, "set_sampling")
        temperature, top_k, top_p, seed = check_sampling(temperature, top_k, top_p, seed)
        s, r = self.device_stream, slice(slot, slot + 1)
        for dst, val, dt in ((self._temperature, temperature, np.float32), (self._top_k, top_k, np.int32),
                             (self._top_p, top_p, np.float32), (self._seed, seed, np.int64),
                             (self._counter, 0, np.int64)):
            api.memcpy(dst[r], api.from_host(np.array([val], dt))).async_on(s)
        self._h_sampling[slot] = (temperature, top_k, top_p, seed)
        self._h_counter[slot] = 0
        self._cont[slot] = False

    def reserve(self, slot: int, n_tokens: int) -> bool:
        """Give row ``slot`` blocks for positions ``[0, n_tokens)`` (keeping those it holds).

        The new blocks' ids go to the row's block-table row on the device (one small copy
        on :attr:`device_stream`). Returns ``False``, taking nothing, when the pool has too
        few free blocks.

        Raises:
            ValueError: bad slot, or ``n_tokens`` outside ``[0, max_seq]``.
        """
        slot = self._check_slot(slot, "reserve")
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int | np.integer) or not (
                0 <= n_tokens <= self.max_seq):
            raise ValueError(f"reserve: n_tokens={n_tokens!r} must be an int in [0, max_seq="
                             f"{self.max_seq}]")
        held = self._row_blocks[slot]
        need = self.blocks.blocks_for(int(n_tokens)) - len(held)
        if need <= 0:
            return True
        ids = self.blocks.acquire(need)
        if ids is None:
            return False
        held += ids
        # the whole row: entries past the blocks held go back to the null block
        api.memcpy(self._table[slot], api.from_host(self._table_row(slot))).async_on(self.device_stream)
        return True

    def blocks_held(self, slot: int) -> int:
        """Blocks row ``slot`` holds."""
        return len(self._row_blocks[self._check_slot(slot, "blocks_held")])

    def _grow(self, slot: int, n_tokens: int, what: str) -> None:
        if not self.reserve(slot, n_tokens):
            need = self.blocks.blocks_for(n_tokens) - len(self._row_blocks[slot])
            raise KVCacheFull(
                f"{what}: row {slot} needs {need} more KV blocks for {n_tokens} positions, the "
                f"pool has {self.blocks.free} free of {self.blocks.capacity} (release finished rows, "
                "or build the model with a larger kv_blocks)")

    def prefill(self, slot: int, ids: Sequence[int], start: int = 0, *, sample: bool = True,
                graph: bool | None = None) -> Tensor | None:
        """Write the KV of ``ids`` at ``start ..`` of row ``slot``; sample the next token.

        Each chunk of up to ``prefill_chunk`` tokens is one forward pass. With ``graph``
        (default: on CUDA) a chunk is padded to a power of two (at least 16) and replays a
        CUDA graph captured once per padded length and kind of chunk (at position 0 or
        later), for every row (the first use runs eagerly and captures; the row's ids, positions, block-table row and sampling
        parameters go to device buffers the graph reads): the padding's keys land past the
        prompt (in the row's blocks, or the null block past them), where nothing attends to
        them before decode overwrites them. Without it the chunk runs eagerly, unpadded.
        The row gets the blocks it writes (see :meth:`reserve`).

        Returns:
            With ``sample``: the ``(1,)`` int32 view of the row's token (valid once
            :attr:`device_stream` reaches it; read it with :meth:`read`). Else ``None``.

        Raises:
            ValueError: bad slot or ids, or ``start + len(ids) > max_seq``.
            KVCacheFull: the pool has too few free blocks (nothing enqueued).
        """
        return _prefill.prefill(self, slot, ids, start, sample, graph)

    def _table_row(self, slot: int) -> np.ndarray:
        row = np.zeros(self.max_blocks, np.int32)
        held = self._row_blocks[slot]
        row[:len(held)] = held
        return row

    def decode_step(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int], *,
                    graph: bool | None = None) -> Tensor:
        """One decode step: feed ``tokens[i]`` at ``positions[i]`` of row ``slots[i]``.

        Args:
            slots: distinct cache rows.
            tokens: the token each row feeds (the one it sampled last).
            positions: each row's position (its current length).
            graph: replay the bucket's graph (default; on the cpu backend a recorded step
                replayed by the stream's worker) or run eagerly (``False``).

        Returns:
            The ``(bucket,)`` int32 token view; ``view[slots[i]]`` is row i's new token.

        Raises:
            ValueError: bad slots, tokens or positions (before anything is enqueued).
            KVCacheFull: a row needs a block and the pool has none free.
        """
        return _decode.decode_step(self, slots, tokens, positions, graph)

    def capture_graphs(self, *, graph: bool | None = None) -> int:
        """Capture every decode bucket's graph and every padded prefill length's graph now.

        Otherwise each is captured at its first use, inside a step (an eager run, a stream
        synchronization and the capture: tens of milliseconds of host time on the caller's
        thread). Nothing is captured where graphs are not used (``graph`` default: on
        CUDA only). The warm-up runs write only the null block (prefill) or nothing
        (decode, all rows idle). Returns the number of graphs captured now.
        """
        return _decode.capture_graphs(self, graph)

    def release(self, slot: int) -> None:
        """Forget row ``slot``: it is idle (writes nothing) from the next decode on, and its
        blocks go back to the pool (work already enqueued that uses them runs first: the
        stream orders it before any later write to them)."""
        slot = self._check_slot(slot, "release")
        self._cont[slot] = False
        held = self._row_blocks[slot]
        if held:
            self.blocks.release(held)
            self._row_blocks[slot] = []

    def read(self, view: Tensor) -> DeviceOp[np.ndarray]:
        """The host copy of a token view returned by :meth:`prefill` / :meth:`decode_step`.

        Run it on the model's stream (``sync_on(model.device_stream)`` or ``await
        op.schedule(model.policy)``): it is ordered after the step that wrote the view, and
        a stream of another device refuses the view (``DeviceError``).
        """
        return api.to_host(view)

    # -- generation --------------------------------------------------------------------------
    def generate(self, prompt: Any, max_new_tokens: int = 32, *, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None,
                 stop: Sequence[int] | None = None, seed: int | None = None,
                 graph: bool | None = None) -> Any:
        """Generate new tokens (see :func:`deviceops.nn.generation.generate`)."""
        from .generation import generate

        return generate(self, prompt, max_new_tokens, temperature=temperature, top_k=top_k,
                        top_p=top_p, stop=stop, seed=seed, graph=graph)

    def stream(self, prompt: Any, max_new_tokens: int = 32, *, temperature: float = 0.0,
               top_k: int | None = None, top_p: float | None = None,
               stop: Sequence[int] | None = None, seed: int | None = None,
               graph: bool | None = None) -> AsyncIterator[int]:
        """Async iterator of new token ids (see :func:`deviceops.nn.generation.stream`)."""
        from .generation import stream

        return stream(self, prompt, max_new_tokens, temperature=temperature, top_k=top_k,
                      top_p=top_p, stop=stop, seed=seed, graph=graph)

    def __repr__(self) -> str:
        c = self.config
        return (f"CausalLM({c.name!r}, {c.num_layers} layers, hidden {c.hidden_size}, "
                f"{self.dtype}, {self.device}, max_batch {self.max_batch}, max_seq {self.max_seq})")


def check_sampling(temperature: Any, top_k: Any, top_p: Any, seed: Any) -> tuple[float, int, float, int]:
    """Validate sampling arguments; ``None`` means off (top_k 0, top_p 1.0, seed 0).

    See :func:`deviceops.nn._args.check_sampling` (a ``top_k`` beyond any vocabulary is off).
    """
    return _args.check_sampling(temperature, top_k, top_p, seed)
