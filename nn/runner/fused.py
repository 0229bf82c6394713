"""The runner's fused decode step: when and how a model's decode steps run as one kernel
(:class:`deviceops.kernels.FusedDecodeModel`) instead of ~10 ops per layer.

``DEVICEOPS_FUSED_DECODE`` (``0`` by default) decides: ``auto`` fuses on CUDA when the
architecture is the Llama forward (Llama, Qwen2: its layer, embedding, final norm and LM head
ops not overridden) and the shapes fit (:meth:`~deviceops.kernels.FusedDecodeModel.support`);
``1`` fuses wherever it can run (the cpu backend's NumPy version too) and raises when it
cannot; ``0`` never fuses (the default while the fused step is slower than the unfused
graph: ``benchmarks/RESULTS.md``). Buckets above :attr:`~deviceops.kernels.FusedDecodeModel.MAX_ROWS` rows keep
the unfused step. The packed weights are a second copy of the projections (the unfused ops,
prefill among them, keep reading the originals), built once from the device weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from deviceops import _env
from deviceops.kernels import FusedDecodeModel, FusedLayer

from ..layers import Linear
from ..models.llama import Llama

if TYPE_CHECKING:
    from .runner import Runner

__all__ = ["fused_reason", "fused_rows", "make_fused"]

_SAME = ("layer_ops", "embed_ops", "final_norm_ops", "lm_head_ops")


def fused_rows(m: FusedDecodeModel) -> int:
    """The most rows a decode step of ``m`` takes."""
    return min(m.max_batch, m.MAX_ROWS)


def fused_reason(r: Runner) -> str | None:
    """Why the runner's model cannot decode fused, or ``None``."""
    arch = type(r.arch)
    if not issubclass(arch, Llama) or any(getattr(arch, n) is not getattr(Llama, n) for n in _SAME):
        return f"architecture {r.arch.name!r} has its own forward"
    if r.weights.quantized:
        return "its weights are kept quantized (weights='native'); the fused step reads fp16 weights"
    c = r.config
    return FusedDecodeModel.support(hidden=c.hidden_size, ffn=c.intermediate_size, vocab=c.vocab_size,
                                n_heads=c.num_heads, n_kv_heads=c.num_kv_heads,
                                head_dim=c.head_dim, dtype=r.dtype)


def make_fused(r: Runner) -> FusedDecodeModel | None:
    """The runner's fused model under ``DEVICEOPS_FUSED_DECODE`` (module docstring).

    Raises:
        ValueError: the knob is ``1`` and the model cannot run fused, or the knob's value is
            not ``auto``, ``0`` or ``1``.
    """
    mode = (_env.get("DEVICEOPS_FUSED_DECODE") or "0").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"DEVICEOPS_FUSED_DECODE={mode!r}: expected auto, 0 or 1")
    if mode == "0" or (mode == "auto" and r.device.is_cpu):
        return None
    why = fused_reason(r)
    if why is not None:
        if mode == "1":
            raise ValueError(f"DEVICEOPS_FUSED_DECODE=1, but this model cannot decode fused: {why}")
        return None
    w, c = r.weights, r.config

    def host(t: Any) -> np.ndarray:
        return np.asarray(t.to_host().sync_on(r.stream))

    def maybe(t: Any) -> np.ndarray | None:
        return None if t is None else host(t)

    layers = []
    for ly in w.layers:
        a, m = ly.attn, ly.mlp
        layers.append(FusedLayer(
            qkv=host(a.qkv.weight), o=host(a.o.weight), gate_up=host(m.gate_up.weight),
            down=host(m.down.weight), norm1=host(ly.norm1.weight), norm2=host(ly.norm2.weight),
            qkv_bias=maybe(a.qkv.bias), o_bias=maybe(a.o.bias), gate_up_bias=maybe(m.gate_up.bias),
            down_bias=maybe(m.down.bias)))
    assert isinstance(w.lm_head, Linear)  # (fused_reason refuses quantized weights)
    return FusedDecodeModel(
        r.stream, embed=w.embed.table, layers=layers, norm=host(w.norm.weight),
        head=host(w.lm_head.weight), n_heads=c.num_heads, n_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim, eps=float(w.norm.eps), theta=c.rope_theta, max_batch=r.max_batch)
