"""The ``cpu`` tasks of the elementwise kernels: NumPy ``saxpy``, ``add`` and ``mul``.

float16/bfloat16 compute in float32 (as the CUDA kernels do); integer ``saxpy`` computes in
float64 and truncates toward zero.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from deviceops.extend import Tensor, bfloat16, float16, is_floating


def _cpu_task(name: str, a: float, w: Tensor, x: Tensor, y: Tensor | None) -> Any:
    wa, xa, dt = w._array, x._array, w._array.dtype
    if name == "saxpy":
        def saxpy_cpu() -> None:
            if is_floating(dt):
                wa[...] = (np.float32(a) * xa.astype(np.float32) + wa.astype(np.float32)).astype(dt)
            else:
                wa[...] = (np.float64(np.float32(a)) * xa.astype(np.float64) + wa).astype(dt)

        return saxpy_cpu
    assert y is not None
    ya = y._array
    ufunc = np.add if name == "add" else np.multiply

    def binary_cpu() -> None:
        if dt in (float16, bfloat16):
            wa[...] = ufunc(xa.astype(np.float32), ya.astype(np.float32)).astype(dt)
        else:
            ufunc(xa, ya, out=wa)

    return binary_cpu
