"""Layers: thin, stateless wrappers that turn weights + preallocated buffers into kernel ops.

Every call returns a lazy :class:`~deviceops.DeviceOp` (a kernel launch) that writes into a
buffer the caller owns; the multi-launch layers return *thunks* (zero-argument callables
building those ops when the chain reaches them), so a whole forward step is a chain of
ops that can be run eagerly, awaited, or captured once into a CUDA graph. Weights are stored as checkpoints
store them, ``(N, K)`` (out features, in features), and multiplied with
``gemm(..., trans_b=True)``.

| layer                           | computes                                                      |
|---------------------------------|---------------------------------------------------------------|
| :class:`Embedding`              | ``table[ids]``                                                |
| :class:`Linear`                 | ``x @ W^T (+ bias)``                                          |
| :class:`QuantLinear`            | ``x @ W^T (+ bias)``, ``W`` kept in GGUF block formats        |
| :class:`QuantEmbedding`         | ``dequant(table)[ids]`` (rows dequantized on the fly)         |
| :class:`RMSNorm`                | ``x / sqrt(mean(x^2) + eps) * w``; ``add_norm`` fuses ``x + r`` |
| :class:`LayerNorm`              | ``(x - mean) / sqrt(var + eps) * w + b``                      |
| :class:`SwiGLU`                 | ``down(silu(gate(x)) * up(x))`` with gate/up fused            |
| :class:`GeGLU`                  | ``down(gelu_tanh(gate(x)) * up(x))`` with gate/up fused       |
| :class:`RotaryAttention`        | fused QKV, (q/k norm), RoPE + KV-cache write, causal GQA flash attention (window), O |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import deviceops.kernels as kernels
from deviceops import DeviceOp, Tensor

__all__ = ["DENSE_PREFILL_ROWS", "AttentionBuffers", "Embedding", "GeGLU", "LayerNorm", "Linear",
           "QuantEmbedding", "QuantLinear", "QuantPart", "RMSNorm", "RotaryAttention", "SwiGLU",
           "Thunk"]

#: :class:`QuantLinear` on CUDA: inputs of more rows than this (prefill) dequantize the weight
#: into a float scratch matrix and run ``gemm``; fewer (decode) run ``qmatmul``
DENSE_PREFILL_ROWS = 32

Thunk = Callable[[], DeviceOp[Any]]


@dataclass
class Embedding:
    """Token embedding: ``(V, D)`` table; ``__call__(ids, out)`` gathers rows."""

    table: Tensor

    def __call__(self, ids: Any, out: Tensor) -> DeviceOp[Any]:
        """``out[i] = table[ids[i]]``; ids int32 of any shape, out ``(*ids.shape, D)``."""
        return kernels.embedding(ids, self.table, out=out)


@dataclass
class Linear:
    """``y = x @ W^T + b`` with ``W`` stored ``(N, K)`` (as checkpoints store it)."""

    weight: Tensor
    bias: Tensor | None = None

    @property
    def out_features(self) -> int:
        """``N``."""
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        """``K``."""
        return int(self.weight.shape[1])

    def __call__(self, x: Any, out: Tensor) -> DeviceOp[Any]:
        """``x`` ``(M, K)`` -> ``out`` ``(M, N)``."""
        return kernels.gemm(x, self.weight, out=out, bias=self.bias, trans_b=True)


@dataclass
class QuantPart:
    """One weight of a :class:`QuantLinear`: rows ``row0 .. row0 + N`` of the layer's output
    features, in one GGUF block format.

    Attributes:
        weight: the packed int32 ``(N, W)`` tensor (:func:`deviceops.kernels.quant.pack`).
        fmt: its format (``"Q4_K"``).
        bias: ``(N,)`` in the activations' dtype, or ``None``.
        row0: its first output feature.
    """

    weight: Tensor
    fmt: str
    bias: Tensor | None
    row0: int

    @property
    def rows(self) -> int:
        """``N``."""
        return int(self.weight.shape[0])


def _after(th: Thunk) -> Callable[[Any], DeviceOp[Any]]:
    def then(_value: Any) -> DeviceOp[Any]:
        return th()
    return then


def _chain(thunks: list[Thunk]) -> DeviceOp[Any]:
    """One op running the thunks' ops in order on one stream (the last one's output)."""
    op = thunks[0]()
    for th in thunks[1:]:
        op = op.then(_after(th))
    return op


@dataclass
class QuantLinear:
    """``y = x @ W^T + b`` with ``W`` ``(N, K)`` kept as GGUF blocks: one or more
    :class:`QuantPart` s stacked along ``N`` (a fused QKV whose parts have different formats
    is several parts; one format, one part).

    A call of at most :data:`DENSE_PREFILL_ROWS` rows (decode), or any call on the cpu
    backend, runs :func:`deviceops.kernels.qmatmul` per part, each writing its columns of
    ``out``. More rows on CUDA (prefill), with a ``scratch`` buffer: each part is dequantized
    (:func:`deviceops.kernels.dequantize`) into its rows of a float ``(N, K)`` matrix in
    ``scratch`` and one ``gemm(..., trans_b=True)`` runs on it (tensor cores); without
    ``scratch`` (an LM head, whose matrix would be large) ``qmatmul`` runs in tiles of 32 rows.

    Attributes:
        parts: the weights, by ascending ``row0``, covering ``0 .. N``.
        in_features: ``K``.
        bias: the whole ``(N,)`` bias (the gemm path's), or ``None``.
        scratch: a flat float tensor of at least ``N * K`` elements in the activations'
            dtype, shared by the model's layers (they run one after another on one stream),
            or ``None``.
        dense_on_cpu: take the scratch + gemm path on the cpu backend too (tests; slower
            there than ``qmatmul``, whose dequantized weights are cached).
    """

    parts: list[QuantPart]
    in_features: int
    bias: Tensor | None = None
    scratch: Tensor | None = None
    dense_on_cpu: bool = False

    @property
    def out_features(self) -> int:
        """``N``."""
        return sum(p.rows for p in self.parts)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weights."""
        return sum(p.weight.nbytes for p in self.parts)

    def __call__(self, x: Any, out: Tensor) -> DeviceOp[Any]:
        """``x`` ``(M, K)`` -> ``out`` ``(M, N)``."""
        k = self.in_features
        rows = int(x.shape[0]) if isinstance(x, Tensor) else 0
        sc = self.scratch
        if sc is not None and rows > DENSE_PREFILL_ROWS and (self.dense_on_cpu or not out.device.is_cpu):
            n = self.out_features
            w = sc[:n * k].reshape((n, k))

            def deq(p: QuantPart) -> Thunk:
                return lambda: kernels.dequantize(p.weight, out=w[p.row0:p.row0 + p.rows], fmt=p.fmt, k=k)

            ths = [deq(p) for p in self.parts]
            ths.append(lambda: kernels.gemm(x, w, out=out, bias=self.bias, trans_b=True))
            return _chain(ths)

        def qmm(p: QuantPart) -> Thunk:
            return lambda: kernels.qmatmul(x, p.weight, out, fmt=p.fmt, bias=p.bias, out_col=p.row0)

        return _chain([qmm(p) for p in self.parts])


@dataclass
class QuantEmbedding:
    """Token embedding from a quantized ``(V, D)`` table: the rows of ``ids`` dequantized
    into ``out`` (:func:`deviceops.kernels.dequantize`); the packed table may also serve as
    the LM head (a tied :class:`QuantLinear`)."""

    table: Tensor
    fmt: str
    dim: int

    def __call__(self, ids: Any, out: Tensor) -> DeviceOp[Any]:
        """``out[i] = dequant(table)[ids[i]]``; ids int32 of any shape, out ``(*ids.shape, D)``."""
        return kernels.dequantize(self.table, ids, out=out, fmt=self.fmt, k=self.dim)


@dataclass
class RMSNorm:
    """RMS norm over the last dim with a learned scale."""

    weight: Tensor
    eps: float

    def __call__(self, x: Any, out: Tensor) -> DeviceOp[Any]:
        """``out = rms_norm(x) * weight``."""
        return kernels.rms_norm(x, self.weight, eps=self.eps, out=out)

    def add_norm(self, x: Any, residual: Tensor, out: Tensor) -> DeviceOp[Any]:
        """``residual += x`` (in place), ``out = rms_norm(residual) * weight`` (one kernel)."""
        return kernels.add_rms_norm(x, residual, self.weight, eps=self.eps, out=out)


@dataclass
class LayerNorm:
    """Layer norm over the last dim (biased variance), with weight and optional bias."""

    weight: Tensor
    bias: Tensor | None
    eps: float

    def __call__(self, x: Any, out: Tensor) -> DeviceOp[Any]:
        """``out = layer_norm(x) * weight + bias``."""
        return kernels.layer_norm(x, self.weight, self.bias, eps=self.eps, out=out)


@dataclass
class SwiGLU:
    """Llama's MLP: ``down(silu(x W_g^T) * (x W_u^T))`` with ``[W_g; W_u]`` fused ``(2F, K)``."""

    gate_up: Linear | QuantLinear
    down: Linear | QuantLinear

    def ops(self, x: Tensor, gate_up_out: Tensor, act_out: Tensor, out: Tensor) -> list[Thunk]:
        """Thunks of the MLP's three launches (``x`` ``(M, K)`` -> ``out`` ``(M, K)``), in order."""
        return [lambda: self.gate_up(x, gate_up_out),
                lambda: kernels.swiglu(gate_up_out, out=act_out),
                lambda: self.down(act_out, out)]


@dataclass
class GeGLU:
    """Gemma's MLP: ``down(gelu_tanh(x W_g^T) * (x W_u^T))`` with ``[W_g; W_u]`` fused ``(2F, K)``."""

    gate_up: Linear | QuantLinear
    down: Linear | QuantLinear

    def ops(self, x: Tensor, gate_up_out: Tensor, act_out: Tensor, out: Tensor) -> list[Thunk]:
        """Thunks of the MLP's three launches (``x`` ``(M, K)`` -> ``out`` ``(M, K)``), in order."""
        return [lambda: self.gate_up(x, gate_up_out),
                lambda: kernels.geglu(gate_up_out, out=act_out),
                lambda: self.down(act_out, out)]


@dataclass
class RotaryAttention:
    """Self-attention with RoPE, grouped-query heads and a KV cache (Llama; Gemma 3 with
    the optional fields).

    ``qkv`` is the fused projection ``((Hq + 2 Hkv) D, hidden)`` (q heads, then k, then v),
    ``o`` the output projection. :meth:`ops` writes the keys and values of the ``L`` new
    tokens of each of ``B`` rows into the cache at positions ``start[b] ..``, and attends
    causally over the first ``kv_len[b]`` cache positions (the last ``window`` of them
    for each query when ``window`` is set).

    Optional: ``q_norm`` / ``k_norm`` (``(D,)``, both or neither): every q and k head is
    RMS-normed with them (``norm_eps``) before RoPE (:func:`deviceops.kernels.qk_rms_norm`);
    ``window``: sliding-window attention; ``scale``: the softmax scale (``1/sqrt(D)`` when
    ``None``).
    """

    qkv: Linear | QuantLinear
    o: Linear | QuantLinear
    n_heads: int
    n_kv_heads: int
    head_dim: int
    theta: float
    q_norm: Tensor | None = None
    k_norm: Tensor | None = None
    norm_eps: float = 1e-6
    window: int | None = None
    scale: float | None = None

    def ops(self, x: Tensor, k_cache: Tensor, v_cache: Tensor, start: Tensor, kv_len: Tensor,
            bufs: AttentionBuffers, out: Tensor, block_table: Tensor | None = None,
            fresh_kv: tuple[Tensor, Tensor] | None = None) -> list[Thunk]:
        """Thunks of the launches for ``x`` ``(B*L, hidden)`` -> ``out`` ``(B*L, hidden)``.

        Args:
            x: normed hidden states of ``B`` rows of ``L`` tokens, ``(B*L, hidden)``.
            k_cache, v_cache: ``(B, Hkv, S, D)`` (views of the model's cache rows), or with
                ``block_table`` the block pools ``(num_blocks, Hkv, block_size, D)``.
            start: int32 ``(B,)``: position of each row's first new token.
            kv_len: int32 ``(B,)``: ``start + L`` (valid keys after the write).
            bufs: the scratch views (see :class:`AttentionBuffers`).
            out: ``(B*L, hidden)``.
            block_table: optional int32 ``(B, max_blocks)`` in device memory: paged cache
                (see :func:`deviceops.kernels.rope_kv_write`).
            fresh_kv: optional contiguous ``(k, v)`` of ``(B, Hkv, L, D)``, for a chunk that
                starts at position 0 (its keys are all the keys): the keys and values are
                also written there and attention reads them instead of the (paged) cache,
                which lets flash_attention use its contiguous prefill kernel.
        """
        length = bufs.q.shape[2]
        win, sc = self.window, self.scale
        ops: list[Thunk] = [lambda: self.qkv(x, bufs.qkv2)]
        qn, kn = self.q_norm, self.k_norm
        if qn is not None and kn is not None:
            ops.append(lambda: kernels.qk_rms_norm(bufs.qkv3, qn, kn, n_heads=self.n_heads,
                                                   n_kv_heads=self.n_kv_heads, eps=self.norm_eps))
        ops += [
            lambda: kernels.rope_kv_write(bufs.qkv3, start, k_cache, v_cache, n_heads=self.n_heads,
                                          n_kv_heads=self.n_kv_heads, theta=self.theta, q_out=bufs.q,
                                          block_table=block_table),
        ]
        if fresh_kv is None:
            ops.append(lambda: kernels.flash_attention(bufs.q, k_cache, v_cache, causal=True,
                                                       kv_len=kv_len, out=bufs.att,
                                                       block_table=block_table, window=win,
                                                       scale=sc))
        else:
            kf, vf = fresh_kv
            ops += [
                lambda: kernels.rope_kv_write(bufs.qkv3, start, kf, vf, n_heads=self.n_heads,
                                              n_kv_heads=self.n_kv_heads, theta=self.theta,
                                              q_out=bufs.q),
                lambda: kernels.flash_attention(bufs.q, kf, vf, causal=True, kv_len=kv_len,
                                                out=bufs.att, window=win, scale=sc),
            ]
        if length > 1:  # (B, Hq, L, D) -> (B, L, Hq*D); for L == 1 the layouts coincide
            ops.append(lambda: kernels.merge_heads(bufs.att, out=bufs.merged3))
        ops.append(lambda: self.o(bufs.merged2, out))
        return ops


@dataclass
class AttentionBuffers:
    """Scratch views of one attention call for ``B`` rows of ``L`` tokens.

    Attributes:
        qkv2: ``(B*L, (Hq+2Hkv) D)`` the fused projection's output; ``qkv3`` the same
            memory as ``(B, L, (Hq+2Hkv) D)``.
        q: ``(B, Hq, L, D)`` rotated queries; att: attention output, same shape.
        merged3: ``(B, L, Hq D)``; merged2: the same as ``(B*L, Hq D)`` (for ``L == 1``
            it is ``att`` itself viewed as rows).
    """

    qkv2: Tensor
    qkv3: Tensor
    q: Tensor
    att: Tensor
    merged3: Tensor
    merged2: Tensor
