"""The transformer kernels on CUDA: loading ``transformer.cu`` (``rope``, ``rope_kv_write``,
``merge_heads``, ``split_qkv``, ``qk_rms_norm``; one module, every instantiation named up front). The launches (in
:mod:`.op`) are flat: one thread per unit of :data:`..runtime._rows.THREADS`-thread blocks,
16-byte accesses where the row length and the pointers allow (:func:`..runtime._rows.vec_width`)."""

from __future__ import annotations

from typing import Any

from ..runtime._rows import CTYPE, MOVE_TYPES, kernel_function

__all__ = ["function"]

_SOURCE = "transformer/transformer.cu"


def _names() -> tuple[str, ...]:
    out = []
    for c in CTYPE.values():
        vecs = (1, 16 // (4 if c == "float" else 2))
        out += [f"{k}<{c}, {v}>" for k in ("rope", "rope_kv_write") for v in vecs]
    out += [f"{k}<{e}>" for k in ("merge_heads", "split_qkv") for e in MOVE_TYPES.values()]
    out += [f"qk_rms_norm<{c}>" for c in CTYPE.values()]
    return tuple(out)


def function(device_index: int, expr: str) -> Any:
    """The compiled kernel ``expr`` (e.g. ``"rope<f16, 8>"``) of ``transformer.cu``."""
    return kernel_function(device_index, _SOURCE, expr, _names())
