"""Encoder: the user's handle on a sentence-embedding model (config, weights, tokenizer, arena).

``embed(texts)`` does what sentence-transformers does with a BERT and its mean pooling
(all-MiniLM-L6-v2): tokenise ([CLS] text [SEP]), run the encoder (:mod:`.models.bert`), take
the mean of the last hidden states over each text's real tokens (special tokens included,
padding excluded), and divide by its L2 norm. The result is float32 ``(N, dim)``.

Batching: the texts are sorted by length (longest first) and cut into batches of rows of
one padded length ``L`` (the longest of the batch, rounded up to a multiple of 8), at most
``max_batch`` rows and ``max_tokens`` tokens each, and no row shorter than half of ``L``
after rounding (so at most about half of a batch is padding). A row's padding is masked out
twice: attention sees only the row's first ``len`` keys (``flash_attention(kv_len=lens)``),
and the pooling weights of its padding positions are 0. Padding never changes a text's embedding
(the tests compare a text alone and in a batch). The pooling is one batched GEMM, the
weights ``1/len`` per real token; the rows come back to the callers' order by an
``embedding`` gather, and the normalisation is an ``rms_norm`` with weight ``1/sqrt(dim)``.

Devices and streams: as :class:`~deviceops.nn.CausalLM`, an encoder lives on one device and
every op it enqueues runs on :attr:`Encoder.device_stream`; it owns one activation arena
(``max_tokens`` rows), so one forward runs at a time: :meth:`Encoder.embed` holds the
encoder's lock while it runs (threads may call it concurrently: they take turns); an op from
:meth:`Encoder.embed_op` must run on ``device_stream`` (``op.sync_on(encoder.device_stream)``
or ``await op.schedule(encoder.policy)``), finished before the next one is enqueued.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

import deviceops
import deviceops.kernels as kernels
from deviceops import DeviceOp, Tensor, api
from deviceops.scheduling import SingleStream

from .model import model_dtype, resolve_device
from .models.bert import BertBuffers, BertConfig, bind, encoder_ops, hf_weights
from .runner.forward import chain

__all__ = ["Encoder"]

_PAD_TO = 8  # padded lengths are multiples of this (fewer kernel plans, aligned rows)


class Encoder:
    """A BERT sentence encoder on deviceops kernels (module docstring).

    Build it with :func:`deviceops.nn.minilm` or :func:`deviceops.nn.load_encoder`.

    Args:
        config: the hyper-parameters.
        weights: float32 host arrays by Hugging Face name (``bert.`` prefix allowed).
        tokenizer: a ``tokenizers.Tokenizer`` whose post-processor adds the special tokens
            (``None``: token ids only, :meth:`embed_ids`); its own padding and truncation
            settings are turned off (this class pads and refuses or truncates).
        dtype: ``"float16"``, ``"bfloat16"`` or ``"float32"``; ``None``: float16 on CUDA,
            float32 on the cpu backend. Embeddings are float32 whatever it is.
        device: as :class:`~deviceops.nn.CausalLM` (``None``: the default device now).
        max_length: the most tokens one text may have, special tokens included (``None``:
            the model's positions, ``config.max_position_embeddings``).
        max_tokens: padded tokens per forward (the arena's rows); ``None``: 16384 on CUDA,
            4096 on cpu. At least ``max_length``.
        max_batch: texts per forward (``None``: 256).
        normalize: divide each embedding by its L2 norm (sentence-transformers'
            ``Normalize`` module).
        name: the model's name (``GET /v1/models``, messages).

    Raises:
        ValueError: a bad size or dtype, or weights that do not fit ``config`` (named).

    Attributes:
        config, tokenizer, weights (:class:`~deviceops.nn.models.bert.BertWeights`), device,
        dtype, device_stream, policy (``SingleStream(device_stream)``), dim, max_length,
        max_tokens, max_batch, normalize, name.

    Example:
        >>> enc = nn.minilm()
        >>> e = enc.embed(["A cat sits on the mat.", "A kitten is on the rug."])
        >>> e.shape, float(e[0] @ e[1]) > 0.5
        ((2, 384), True)
    """

    def __init__(self, config: BertConfig, weights: dict[str, np.ndarray], *, tokenizer: Any,
                 dtype: str | None = None, device: Any = None, max_length: int | None = None,
                 max_tokens: int | None = None, max_batch: int | None = None,
                 normalize: bool = True, name: str = "encoder") -> None:
        dev = resolve_device(device, "Encoder")
        dtype = model_dtype(dtype, dev)
        if max_length is None:
            max_length = config.max_position_embeddings
        if max_tokens is None:
            max_tokens = 4096 if dev.is_cpu else 16384
        if max_batch is None:
            max_batch = 256
        for k, v in (("max_length", max_length), ("max_tokens", max_tokens), ("max_batch", max_batch)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Encoder: {k}={v!r} must be a positive int")
        if not 2 <= max_length <= config.max_position_embeddings:
            raise ValueError(f"Encoder: max_length={max_length} must be in [2, "
                             f"{config.max_position_embeddings}] (the model's positions)")
        if max_tokens < _round_up(max_length):
            raise ValueError(f"Encoder: max_tokens={max_tokens} must hold one text of max_length "
                             f"{max_length} padded to a multiple of {_PAD_TO} "
                             f"({_round_up(max_length)})")
        checked = hf_weights(config, weights, repr(name))
        self.config = config
        self.tokenizer = tokenizer
        if tokenizer is not None:
            tokenizer.no_padding()
            tokenizer.no_truncation()
        self.device = dev
        self.dtype = dtype
        self.max_length = max_length
        self.max_tokens = max_tokens
        self.max_batch = max_batch
        self.normalize = bool(normalize)
        self.name = name
        self.device_stream = dev.new_stream()
        self.policy = SingleStream(self.device_stream)
        self._lock = threading.Lock()
        stream = self.device_stream

        def upload(a: np.ndarray) -> Tensor:
            return api.from_host(np.ascontiguousarray(a, np.float32), dtype).sync_on(stream)

        self.weights = bind(config, checked, upload)
        self._arena = _Arena(stream, config, max_tokens, dtype)
        # rms_norm(x, w = 1/sqrt(dim), eps): x / sqrt(|x|^2 + eps dim), i.e. x / max(|x|, 1e-12)
        self._unit = api.full((config.hidden_size,), 1.0 / math.sqrt(config.hidden_size),
                              np.float32).sync_on(stream)

    @property
    def dim(self) -> int:
        """The embeddings' width (``hidden_size``)."""
        return self.config.hidden_size

    def __repr__(self) -> str:
        return (f"<Encoder {self.name!r}: {self.config.num_layers} layers, dim {self.dim}, "
                f"{self.dtype} on {self.device}>")

    # -- text ---------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` as the model reads it ([CLS] ... [SEP]), not truncated.

        Raises:
            RuntimeError: the encoder has no tokenizer.
            TypeError: ``text`` is not a str.
        """
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` of each text (the tokenizer's batch call: its own threads)."""
        if self.tokenizer is None:
            raise RuntimeError(f"Encoder {self.name!r} has no tokenizer; pass token ids "
                               "(embed_ids)")
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"Encoder: texts[{i}] is a {type(t).__name__}, not a str")
        return [list(e.ids) for e in self.tokenizer.encode_batch(list(texts))]

    def _ids_of(self, texts: str | Sequence[str], truncate: bool) -> list[list[int]]:
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, Sequence):
            raise TypeError(f"Encoder.embed: texts must be a str or a list of str, not "
                            f"{type(texts).__name__}")
        seqs = self.encode_batch(texts)
        if truncate:  # as the tokenizer truncates one sequence: the content, then [SEP]
            m = self.max_length
            seqs = [s if len(s) <= m else s[: m - 1] + s[-1:] for s in seqs]
        return seqs

    # -- embeddings ---------------------------------------------------------------------------
    def embed(self, texts: str | Sequence[str], *, truncate: bool = False) -> np.ndarray:
        """The embeddings of ``texts`` (a str is one text), float32 ``(N, dim)``, in order.

        Args:
            texts: a str or a sequence of str (``N = 0`` gives ``(0, dim)``).
            truncate: cut a text over :attr:`max_length` tokens to its first ones (and the
                closing [SEP]) as sentence-transformers does; ``False``: refuse it.

        Raises:
            TypeError: an element that is not a str.
            ValueError: a text over :attr:`max_length` tokens (without ``truncate``).
        """
        return self.embed_ids(self._ids_of(texts, truncate))

    def embed_ids(self, ids: Sequence[Sequence[int]]) -> np.ndarray:
        """The embeddings of token-id sequences taken as they are (special tokens included:
        :meth:`encode` gives them), float32 ``(N, dim)``.

        Raises:
            TypeError: ``ids`` is not a sequence of sequences of ints.
            ValueError: an empty sequence, an id outside ``[0, vocab_size)``, or a sequence
                over :attr:`max_length` tokens (at the call).
        """
        op = self._embed_op(ids)
        with self._lock:
            return api.to_host(op).sync_on(self.device_stream)

    def embed_op(self, texts: str | Sequence[str] | Sequence[Sequence[int]], *,
                 truncate: bool = False) -> DeviceOp[Tensor]:
        """:meth:`embed` (texts) or :meth:`embed_ids` (sequences of ids) as a lazy op
        producing a fresh float32 ``(N, dim)`` tensor on :attr:`device`. Texts are tokenised
        and everything is checked now; nothing runs until the op does. Run it on
        :attr:`device_stream` (module docstring), one at a time.
        """
        if isinstance(texts, str) or (isinstance(texts, Sequence) and texts
                                      and all(isinstance(t, str) for t in texts)):
            return self._embed_op(self._ids_of(cast("str | Sequence[str]", texts), truncate))
        return self._embed_op(cast("Sequence[Sequence[int]]", texts))

    def _embed_op(self, ids: Sequence[Sequence[int]]) -> DeviceOp[Tensor]:
        seqs = self._check_ids(ids)
        n, h = len(seqs), self.dim
        order = sorted(range(n), key=lambda i: -len(seqs[i]))  # stable: ties keep their order
        rank = np.empty(n, np.int32)
        rank[order] = np.arange(n, dtype=np.int32)
        batches = self._batches([len(seqs[i]) for i in order])
        if n == 0:
            return api.zeros((0, h), np.float32)

        def run(pooled: Tensor) -> DeviceOp[Tensor]:
            th = []
            for r0, rows, length in batches:
                th += self._batch_ops([seqs[i] for i in order[r0:r0 + rows]], length,
                                      pooled[r0:r0 + rows].reshape(rows, 1, h))
            return chain(th).then(lambda _: self._finish(pooled, rank))

        return api.empty((n, h), self.dtype).then(run)

    def _finish(self, pooled: Tensor, rank: np.ndarray) -> DeviceOp[Tensor]:
        """The pooled rows (sorted by length) as float32, back in order, normalised."""
        back = kernels.embedding(api.from_host(rank), api.convert(pooled, np.float32))
        if not self.normalize:
            return back
        eps = 1e-24 / self.dim
        return back.then(lambda t: kernels.rms_norm(t, self._unit, eps=eps, out=t))

    def _check_ids(self, ids: Sequence[Sequence[int]]) -> list[list[int]]:
        if isinstance(ids, str) or not isinstance(ids, Sequence):
            raise TypeError(f"Encoder: token ids must be a list of lists of ints, not "
                            f"{type(ids).__name__}")
        v, m = self.config.vocab_size, self.max_length
        out = []
        for i, s in enumerate(ids):
            try:
                a = np.asarray(s)
            except (TypeError, ValueError):
                a = np.asarray([], dtype=object)
            if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
                raise TypeError(f"Encoder: input {i} is not a sequence of ints")
            if a.size == 0:
                raise ValueError(f"Encoder: input {i} has no tokens")
            if a.size > m:
                raise ValueError(f"Encoder: input {i} has {a.size} tokens; the most this model "
                                 f"takes is {m} (max_length); shorten it, or embed(..., "
                                 "truncate=True) to cut it")
            if int(a.min()) < 0 or int(a.max()) >= v:
                raise ValueError(f"Encoder: input {i} has token id {int(a.min()) if a.min() < 0 else int(a.max())}"
                                 f" outside the vocabulary [0, {v})")
            out.append([int(x) for x in a])
        return out

    def _batches(self, lengths: list[int]) -> list[tuple[int, int, int]]:
        """``(first row, rows, padded length)`` of each forward over ``lengths`` (sorted
        longest first; module docstring)."""
        out, r = [], 0
        while r < len(lengths):
            length = _round_up(lengths[r])
            cap = min(self.max_batch, self.max_tokens // length, len(lengths) - r)
            rows = 1
            while rows < cap and 2 * _round_up(lengths[r + rows]) > length:
                rows += 1
            out.append((r, rows, length))
            r += rows
        return out

    def _batch_ops(self, seqs: list[list[int]], length: int, out: Tensor) -> list[Any]:
        """Thunks of one forward of ``seqs`` padded to ``length``, pooled into ``out``
        ``(B, 1, dim)``."""
        b = len(seqs)
        lens = np.array([len(s) for s in seqs], np.int32)
        host = np.zeros((2 * b * length + b,), np.int32)  # ids, positions, lens
        ids = host[: b * length].reshape(b, length)
        ids[...] = self.config.pad_token_id
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = s
        host[b * length: 2 * b * length] = np.tile(np.arange(length, dtype=np.int32), b)
        host[2 * b * length:] = lens
        weights = np.zeros((b, 1, length), np.float32)
        for i, n in enumerate(lens):
            weights[i, 0, :n] = 1.0 / n
        buf = self._arena.views(b, length)
        th: list[Any] = [lambda: api.memcpy(buf.ints, api.from_host(host))]
        th += encoder_ops(self.config, self.weights, buf.bert)
        x3 = buf.bert.x.reshape(b, length, self.dim)
        th.append(lambda: kernels.gemm(api.from_host(weights, self.dtype), x3, out=out))
        return th


def _round_up(n: int) -> int:
    return -(-n // _PAD_TO) * _PAD_TO


class _ArenaViews:
    """One forward's views: the packed int32 inputs and the encoder's buffers."""

    def __init__(self, ints: Tensor, bert: BertBuffers) -> None:
        self.ints = ints
        self.bert = bert


class _Arena:
    """Flat activation buffers for ``rows`` padded tokens, viewed per ``(B, L)``."""

    def __init__(self, stream: deviceops.Stream, cfg: BertConfig, rows: int, dtype: str) -> None:
        h, f = cfg.hidden_size, cfg.intermediate_size

        def buf(n: int, dt: Any = dtype) -> Tensor:
            return api.zeros((n,), dt).sync_on(stream)

        self.cfg = cfg
        self.ints = buf(3 * rows, np.int32)
        self.x, self.emb, self.merged = buf(rows * h), buf(rows * h), buf(rows * h)
        self.qkv = buf(rows * 3 * h)
        self.q, self.k, self.v = buf(rows * h), buf(rows * h), buf(rows * h)
        self.att, self.ffn = buf(rows * h), buf(rows * f)
        self._memo: dict[tuple[int, int], _ArenaViews] = {}

    def views(self, b: int, length: int) -> _ArenaViews:
        got = self._memo.get((b, length))
        if got is None:
            got = self._memo[(b, length)] = self._views(b, length)
        return got

    def _views(self, b: int, length: int) -> _ArenaViews:
        c, n = self.cfg, b * length
        h, nh, d = c.hidden_size, c.num_heads, c.head_dim

        def v(t: Tensor, *shape: int, at: int = 0) -> Tensor:
            return t[at: at + math.prod(shape)].reshape(shape)

        ints = v(self.ints, 2 * n + b)
        bert = BertBuffers(ids=v(ints, n), pos=v(ints, n, at=n), lens=v(ints, b, at=2 * n),
                           x=v(self.x, n, h), emb=v(self.emb, n, h), qkv=v(self.qkv, n, 3 * h),
                           q=v(self.q, b, nh, length, d), k=v(self.k, b, nh, length, d),
                           v=v(self.v, b, nh, length, d), att=v(self.att, b, nh, length, d),
                           merged=v(self.merged, n, h), ffn=v(self.ffn, n, c.intermediate_size))
        return _ArenaViews(ints, bert)
