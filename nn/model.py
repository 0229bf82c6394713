"""CausalLM: the user's handle on a language model (config, weights, tokenizer, runner).

A :class:`CausalLM` holds the hyper-parameters (:attr:`~CausalLM.config`), the tokenizer and
chat template (:class:`~.tokenizer.TextCodec`: ``encode``, ``decode``,
``apply_chat_template``), the device weights bound by its architecture
(:mod:`deviceops.nn.models`, picked by ``config.architecture``; QKV and gate/up fused,
stored ``(N, K)`` and used through ``gemm(..., trans_b=True)``), and a
:class:`~deviceops.nn.runner.Runner` that owns the device buffers, the paged KV cache, the
graphs and the step API. A forward step is a lazy chain of kernel ops writing into the
runner's buffers.

Step API (documented in :mod:`deviceops.nn.runner.runner`; what :mod:`.static_batch` and
the serving engine use; every method enqueues on :attr:`CausalLM.device_stream` and
returns without waiting): ``set_sampling``, ``set_mask``, ``prefill``, ``decode_step``,
``decode_begin``, ``reserve``, ``blocks_held``, ``release``, ``share_prefix``,
``cache_prefix``, ``read``, ``capture_graphs``.

Devices: a model lives on one device (``device=``: ``"cpu"``, ``"cpu:N"``, ``"cuda"``,
``"cuda:N"``, an int N or a :class:`~deviceops.Device`; default: the default device when
it is built), and every op it enqueues (weight upload, arena, KV pools, block table,
per-row state, graph captures and replays, eager steps, host copies) runs on
:attr:`CausalLM.device_stream`, a stream of that device, never on a stream of the default
policy (which lives on the *default* device, possibly another one). The ops it hands out
(:meth:`CausalLM.logits`, :meth:`CausalLM.read`) must run there too:
``op.sync_on(model.device_stream)``, ``await op.schedule(model.policy)`` or inside ``with
deviceops.using(model.policy):``; run on a stream of another device they raise
:class:`~deviceops.DeviceError` naming the fix.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np

import deviceops
from deviceops import DeviceOp, Tensor, api

from . import _args, models
from .layers import Embedding, Linear, QuantEmbedding, QuantLinear, RMSNorm
from .models import LlamaConfig
from .runner import BlockAllocator, KVCache, KVCacheFull, Runner, buckets
from .runner.forward import chain
from .tokenizer import TextCodec

__all__ = ["CausalLM", "KVCacheFull", "buckets", "chain", "check_sampling", "model_dtype",
           "resolve_device"]

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


def model_dtype(dtype: Any, device: deviceops.Device) -> str:
    """A model's dtype: ``dtype`` as a name of :data:`_DTYPES`; ``None``: float32 on the
    cpu backend, float16 on CUDA.

    Raises:
        ValueError: a dtype that is not float32, float16 or bfloat16.
    """
    if dtype is None:
        return "float32" if device.is_cpu else "float16"
    try:
        name = dtype if dtype in _DTYPES else str(np.dtype(dtype))
    except TypeError:
        name = str(dtype)
    if name not in _DTYPES:
        raise ValueError(f"CausalLM: dtype {dtype!r} is not supported; use one of {_DTYPES}")
    return name


#: read-only memory-mapped weights of at least this many bytes are used in place on the cpu
#: backend (``api.from_host(copy=False)``) rather than copied
_ADOPT_BYTES = 64 << 20


class CausalLM(TextCodec):
    """A causal language model on deviceops kernels (module docstring).

    Build it with :func:`deviceops.nn.load_gguf`, :func:`deviceops.nn.smollm2`,
    :func:`deviceops.nn.load_safetensors` or :func:`deviceops.nn.random_model`.

    Args:
        config: the hyper-parameters; ``config.architecture`` names the registered
            architecture (:mod:`deviceops.nn.models`) that binds the weights and runs the
            forward.
        weights: float32 host arrays by Hugging Face name (the architecture's
            ``weight_shapes``).
        tokenizer: a ``tokenizers.Tokenizer`` (``None``: ids only).
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

    Raises:
        ValueError: a bad size or dtype, or an architecture that is not registered.

    Attributes:
        config, tokenizer, arch (the :class:`~deviceops.nn.models.Architecture`), weights
        (its device modules), runner (the :class:`~deviceops.nn.runner.Runner`), device,
        dtype, device_stream (the stream of :attr:`device` every op of the model is enqueued
        on), policy (``SingleStream(device_stream)``: schedule or await the ops the model
        hands out with it), max_batch, max_seq, prefill_chunk, cache (the block pools),
        blocks (the :class:`~deviceops.nn.runner.BlockAllocator`), block_size, max_blocks
        (block-table columns).
    """

    def __init__(self, config: LlamaConfig, weights: dict[str, np.ndarray], *, tokenizer: Any,
                 chat_template: str | None = None, dtype: str | None = None, device: Any = None,
                 max_batch: int | None = None, max_seq: int | None = None,
                 prefill_chunk: int = 512, kv_block_size: int = 16,
                 kv_blocks: int | None = None) -> None:
        arch = models.get(config.architecture, what="CausalLM")
        dev = resolve_device(device)
        dtype = model_dtype(dtype, dev)
        if max_batch is None:
            max_batch = 4 if dev.is_cpu else 32
        if max_seq is None:
            max_seq = min(config.max_position_embeddings, 1024 if dev.is_cpu else 2048)
        for name, val in (("max_batch", max_batch), ("max_seq", max_seq), ("prefill_chunk", prefill_chunk),
                          ("kv_block_size", kv_block_size)):
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"CausalLM: {name}={val!r} must be a positive int")
        if kv_blocks is None:
            kv_blocks = max_batch * -(-max_seq // kv_block_size) + 1
        if isinstance(kv_blocks, bool) or not isinstance(kv_blocks, int) or kv_blocks < 2:
            raise ValueError(f"CausalLM: kv_blocks={kv_blocks!r} must be an int >= 2 (block 0 is "
                             "the null block)")
        self.config = config
        self.tokenizer = tokenizer
        self.arch = arch
        if chat_template:
            self._init_chat_template(chat_template)
        stream = dev.new_stream()

        def put(op: DeviceOp[Tensor]) -> Tensor:
            # the cpu backend: enqueued without waiting for each (one synchronize after bind)
            return op.async_on(stream) if dev.is_cpu else op.sync_on(stream)

        def upload(a: np.ndarray) -> Tensor:
            # weights already in the model's dtype (read_gguf(dtype=...)) are copied as they
            # are; others go through float32 (one rounding to the dtype, whatever they were)
            if a.dtype == np.int32:  # a packed quantized weight (weights="native"): its bytes
                return put(api.from_host(np.ascontiguousarray(a), "int32"))
            host = a if str(a.dtype) == dtype else np.ascontiguousarray(a, dtype=np.float32)
            # a large read-only map of the weight cache (a file written once, never changed)
            # is the cpu tensor's memory as it is: no copy (Gemma 3's 671 MB embedding);
            # only large ones, as each map holds a file descriptor
            keep = (isinstance(host, np.memmap) and not host.flags.writeable
                    and host.nbytes >= _ADOPT_BYTES)
            return put(api.from_host(host, dtype, copy=not keep))

        self.weights = arch.bind(config, weights, upload)
        stream.synchronize()
        self.runner = Runner(arch, config, self.weights, device=dev, dtype=dtype, stream=stream,
                             max_batch=max_batch, max_seq=max_seq, prefill_chunk=prefill_chunk,
                             kv_block_size=kv_block_size, kv_blocks=kv_blocks)

    # -- what the runner holds ------------------------------------------------------------------
    @property
    def device(self) -> deviceops.Device:
        """The device the model lives and runs on."""
        return self.runner.device

    @property
    def dtype(self) -> str:
        """The weights' and activations' dtype."""
        return self.runner.dtype

    @property
    def device_stream(self) -> deviceops.Stream:
        """The stream of :attr:`device` every op of the model is enqueued on."""
        return self.runner.stream

    @property
    def policy(self) -> Any:
        """``SingleStream(device_stream)``: schedule or await the model's ops with it."""
        return self.runner.policy

    @property
    def max_batch(self) -> int:
        """Cache rows (concurrent sequences)."""
        return self.runner.max_batch

    @property
    def max_seq(self) -> int:
        """Positions per cache row."""
        return self.runner.max_seq

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens per prefill launch."""
        return self.runner.prefill_chunk

    @property
    def cache(self) -> KVCache:
        """The KV block pools."""
        return self.runner.cache

    @property
    def blocks(self) -> BlockAllocator:
        """The KV block allocator."""
        return self.runner.kv.allocator

    @property
    def block_size(self) -> int:
        """Positions per KV block."""
        return self.runner.kv.block_size

    @property
    def max_blocks(self) -> int:
        """Block-table columns (blocks a row may hold)."""
        return self.runner.kv.max_blocks

    @property
    def contiguous_first_chunk(self) -> bool:
        """A prompt chunk at position 0 attends over its own contiguous keys (default;
        ``DEVICEOPS_NN_PAGED_PREFILL=1`` or ``False``: every chunk reads the paged cache).
        Set it before the first prefill."""
        return self.runner.contiguous_first_chunk

    @contiguous_first_chunk.setter
    def contiguous_first_chunk(self, value: bool) -> None:
        self.runner.contiguous_first_chunk = bool(value)

    @property
    def embed(self) -> Embedding | QuantEmbedding:
        """The token embedding."""
        return self.weights.embed

    @property
    def lm_head(self) -> Linear | QuantLinear:
        """The LM head (the embedding's table when tied)."""
        return self.weights.lm_head

    @property
    def norm(self) -> RMSNorm:
        """The final norm."""
        return self.weights.norm

    @property
    def layers(self) -> list[Any]:
        """The decoder layers' modules (the architecture's records)."""
        return self.weights.layers

    @property
    def weight_bytes(self) -> int:
        """Bytes of the device weights (a decode step reads each once)."""
        return self.weights.nbytes

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
        return self.runner.prefill_logits(ids, slot=slot)

    # -- step API (deviceops.nn.runner.runner's docstring) -----------------------------------
    def set_sampling(self, slot: int, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                     seed: int = 0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                     logit_bias: Any = None, logprobs: bool = False,
                     grammar: bool = False) -> None:
        """Set row ``slot``'s sampling parameters (device memory) and reset its counter;
        OpenAI's penalties, ``logit_bias`` (token id -> bias), ``logprobs`` and ``grammar``
        (draws masked by :meth:`set_mask`) as
        :meth:`~deviceops.nn.runner.Runner.set_sampling` takes them."""
        self.runner.set_sampling(slot, temperature=temperature, top_k=top_k, top_p=top_p,
                                 seed=seed, presence_penalty=presence_penalty,
                                 frequency_penalty=frequency_penalty, logit_bias=logit_bias,
                                 logprobs=logprobs, grammar=grammar)

    def set_mask(self, slots: Sequence[int], bitmask: np.ndarray) -> None:
        """The grammar masks of rows ``slots`` for their next draw
        (:meth:`~deviceops.nn.runner.Runner.set_mask`)."""
        self.runner.set_mask(slots, bitmask)

    def read_logprobs(self, n: int) -> DeviceOp[tuple[np.ndarray, np.ndarray]]:
        """Host copies of rows ``0 .. n-1`` of the log-probability buffers
        (:meth:`~deviceops.nn.runner.Runner.read_logprobs`)."""
        return self.runner.read_logprobs(n)

    def reserve(self, slot: int, n_tokens: int) -> bool:
        """Give row ``slot`` blocks for positions ``[0, n_tokens)`` (keeping those it holds).

        The new blocks' ids go to the row's block-table row on the device (one small copy
        on :attr:`device_stream`). Returns ``False``, taking nothing, when the pool has too
        few free blocks.

        Raises:
            ValueError: bad slot, or ``n_tokens`` outside ``[0, max_seq]``.
        """
        return self.runner.reserve(slot, n_tokens)

    def blocks_held(self, slot: int) -> int:
        """Blocks row ``slot`` holds."""
        return self.runner.blocks_held(slot)

    def share_prefix(self, slot: int, hashes: Sequence[bytes], start: int = 0) -> int:
        """Prefix caching: point row ``slot``'s blocks from ``start`` on at the cached blocks
        of ``hashes`` (a prompt's full-block hash chain,
        :func:`~deviceops.nn.runner.prefix_cache.block_hashes`) as far as they are cached;
        returns the positions the row now shares (prefill it from there). The row must
        have written nothing from ``start`` on."""
        return self.runner.share_prefix(slot, hashes, start)

    def cache_prefix(self, slot: int, hashes: Sequence[bytes]) -> int:
        """Prefix caching: cache row ``slot``'s leading full blocks, which it has written,
        under ``hashes`` (their tokens' hash chain); returns the blocks newly cached. They
        stay cached after :meth:`release` until the pool needs them (least recently used
        first); ``blocks.clear_cache()`` drops every idle one."""
        return self.runner.cache_prefix(slot, hashes)

    def prefill(self, slot: int, ids: Sequence[int], start: int = 0, *, sample: bool = True,
                graph: bool | None = None) -> Tensor | None:
        """Write the KV of ``ids`` at ``start ..`` of row ``slot``; sample the next token.

        Each chunk of up to ``prefill_chunk`` tokens is one forward pass. With ``graph``
        (default: on CUDA) a chunk is padded to a power of two (at least 16) and replays a
        CUDA graph captured once per padded length and kind of chunk (at position 0 or
        later), for every row (the first use runs eagerly and captures; the row's ids,
        positions, block-table row and sampling parameters go to device buffers the graph
        reads): the padding's keys land past the prompt (in the row's blocks, or the null
        block past them), where nothing attends to them before decode overwrites them.
        Without it the chunk runs eagerly, unpadded. The row gets the blocks it writes (see
        :meth:`reserve`).

        Returns:
            With ``sample``: the ``(1,)`` int32 view of the row's token (valid once
            :attr:`device_stream` reaches it; read it with :meth:`read`). Else ``None``.

        Raises:
            ValueError: bad slot or ids, or ``start + len(ids) > max_seq``.
            KVCacheFull: the pool has too few free blocks (nothing enqueued).
        """
        return self.runner.prefill(slot, ids, start, sample=sample, graph=graph)

    def prefill_many(self, chunks: Sequence[tuple[int, Sequence[int], int, bool]], *,
                     graph: bool | None = None) -> Tensor:
        """Several rows' short prompt chunks in one forward pass: what the same
        :meth:`prefill` calls write and draw, for many short prompts at the cost of about one.

        Args:
            chunks: ``(slot, ids, start, sample)`` per row (distinct rows), each as
                :meth:`prefill` takes it; at most 128 tokens a chunk and ``prefill_chunk`` in
                all; rows asking for no sampling feature (penalties, logit bias,
                log-probabilities).
            graph: replay the padded length's CUDA graph (default on CUDA) or run eagerly.

        Returns:
            The ``(max_batch,)`` int32 token buffer: row ``slot`` of a chunk with ``sample``
            holds its token (valid once :attr:`device_stream` reaches it; read it with
            :meth:`read`); a decode step with ``tokens=None`` feeds it.

        Raises:
            ValueError: a bad chunk (as :meth:`prefill`), a repeated row, a chunk over 128
                tokens, more than ``prefill_chunk`` tokens, a row with features (nothing is
                enqueued).
            KVCacheFull: the pool has too few free blocks.
        """
        return self.runner.prefill_many(chunks, graph=graph)

    def decode_step(self, slots: Sequence[int], tokens: Sequence[int] | None,
                    positions: Sequence[int], *, graph: bool | None = None,
                    masks: Any = None) -> Tensor:
        """One decode step: feed ``tokens[i]`` at ``positions[i]`` of row ``slots[i]``.

        Args:
            slots: distinct cache rows.
            tokens: the token each row feeds (the one it sampled last), or ``None``: each
                row feeds the token still on the device, the one its previous decode step
                sampled (the row continues at its next position) or the one its last
                :meth:`prefill` chunk sampled (at the position after that chunk). The host
                need not have read them: a step can be enqueued before the previous one's
                tokens are read (what the serving engine's pipelined steps do).
            positions: each row's position (its current length).
            graph: replay the bucket's graph (default; on the cpu backend a recorded step
                replayed by the stream's worker) or run eagerly (``False``).
            masks: rows with a grammar (``set_sampling(grammar=True)``): a callable asked
                once the forward pass is enqueued, returning ``(slots, bitmask)`` (as
                :meth:`set_mask` takes them) or ``None``; the masks apply to this step's
                draws (:class:`~deviceops.nn.runner.decode.Decoder`).

        Returns:
            The ``(bucket,)`` int32 token view; ``view[slots[i]]`` is row i's new token.

        Raises:
            ValueError: bad slots, tokens or positions (before anything is enqueued);
                ``tokens=None`` for a row whose token is not on the device for that position.
            KVCacheFull: a row needs a block and the pool has none free.
        """
        return self.runner.decode_step(slots, tokens, positions, graph=graph, masks=masks)

    def decode_begin(self, slots: Sequence[int], tokens: Sequence[int] | None,
                     positions: Sequence[int], masks: Any, *,
                     graph: bool | None = None) -> tuple[Tensor, Any]:
        """:meth:`decode_step` in two (grammar rows): the forward pass enqueued now, the masks
        and the sampling by the returned ``finish()``, with nothing else enqueued in between
        (:meth:`~deviceops.nn.runner.Runner.decode_begin`). Returns ``(view, finish)``."""
        return self.runner.decode_begin(slots, tokens, positions, masks, graph=graph)

    def capture_graphs(self, *, graph: bool | None = None, progress: bool = False) -> int:
        """Capture every decode bucket's graph and every padded prefill length's graph now.

        Otherwise each is captured at its first use, inside a step (an eager run, a stream
        synchronization and the capture: tens of milliseconds of host time on the caller's
        thread). Nothing is captured where graphs are not used (``graph`` default: on
        CUDA only). The warm-up runs write only the null block (prefill) or nothing
        (decode, all rows idle). Returns the number of graphs captured now. ``progress``:
        a named bar on stderr for the warm-up runs (kernels compile there on first use) and
        one for the captures (``serve`` shows them at start-up).
        """
        return self.runner.capture_graphs(graph=graph, progress=progress)

    def release(self, slot: int) -> None:
        """Forget row ``slot``: it is idle (writes nothing) from the next decode on, and its
        blocks go back to the pool (work already enqueued that uses them runs first: the
        stream orders it before any later write to them)."""
        self.runner.release(slot)

    def read(self, view: Tensor) -> DeviceOp[np.ndarray]:
        """The host copy of a token view returned by :meth:`prefill` / :meth:`decode_step`.

        Run it on the model's stream (``sync_on(model.device_stream)`` or ``await
        op.schedule(model.policy)``): it is ordered after the step that wrote the view, and
        a stream of another device refuses the view (``DeviceError``).
        """
        return self.runner.read(view)

    # -- generation --------------------------------------------------------------------------
    def generate(self, prompt: Any, max_new_tokens: int = 32, *, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None,
                 stop: Sequence[int] | None = None, seed: int | None = None,
                 graph: bool | None = None) -> Any:
        """Generate new tokens (see :func:`deviceops.nn.static_batch.generate`)."""
        from .static_batch import generate

        return generate(self, prompt, max_new_tokens, temperature=temperature, top_k=top_k,
                        top_p=top_p, stop=stop, seed=seed, graph=graph)

    def stream(self, prompt: Any, max_new_tokens: int = 32, *, temperature: float = 0.0,
               top_k: int | None = None, top_p: float | None = None,
               stop: Sequence[int] | None = None, seed: int | None = None,
               graph: bool | None = None) -> AsyncIterator[int]:
        """Async iterator of new token ids (see :func:`deviceops.nn.static_batch.stream`)."""
        from .static_batch import stream

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
