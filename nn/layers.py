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

__all__ = ["AttentionBuffers", "Embedding", "GeGLU", "LayerNorm", "Linear", "RMSNorm",
           "RotaryAttention", "SwiGLU", "Thunk"]

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

    gate_up: Linear
    down: Linear

    def ops(self, x: Tensor, gate_up_out: Tensor, act_out: Tensor, out: Tensor) -> list[Thunk]:
        """Thunks of the MLP's three launches (``x`` ``(M, K)`` -> ``out`` ``(M, K)``), in order."""
        return [lambda: self.gate_up(x, gate_up_out),
                lambda: kernels.swiglu(gate_up_out, out=act_out),
                lambda: self.down(act_out, out)]


@dataclass
class GeGLU:
    """Gemma's MLP: ``down(gelu_tanh(x W_g^T) * (x W_u^T))`` with ``[W_g; W_u]`` fused ``(2F, K)``."""

    gate_up: Linear
    down: Linear

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

    qkv: Linear
    o: Linear
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
