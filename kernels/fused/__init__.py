"""Fused kernels: a whole decode step of a Llama-family model in one persistent kernel
(:class:`FusedDecodeModel`; the packing in :mod:`._plan`, the phases in ``fused_decode.cu``)."""

from __future__ import annotations

from .op import MAX_ROWS, FusedDecodeModel, FusedLayer, fused_decode_support, phase_plan

__all__ = ["MAX_ROWS", "FusedDecodeModel", "FusedLayer", "fused_decode_support", "phase_plan"]
