"""NumPy references of the lookup family: ``embedding`` (clamped gather) and ``argmax``."""

from __future__ import annotations

from typing import Any

import numpy as np


def embedding_reference(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """``table[clip(ids, 0, V - 1)]``: out-of-range ids are clamped, as the CUDA kernel does."""
    v = table.shape[0]
    return np.asarray(table[np.clip(ids.astype(np.int64), 0, v - 1)])


def argmax_reference(x: np.ndarray, dtype: Any) -> np.ndarray:
    """Index of the first maximum over the last dim (NaN counts as the largest)."""
    return np.asarray(np.argmax(x.astype(np.float64), axis=-1)).astype(dtype)
