"""``deviceops.kernels.testing``: kernels that exist to test and demonstrate ordering,
deliberately slow readers and writers (not part of ``deviceops.kernels``' product API).

``slow_copy(dst, src, delay_s)`` waits ``delay_s`` on the device (a ``clock64``
spin on cuda, ``time.sleep`` on the cpu worker) and then copies ``src`` into
``dst``. Launched on one stream while another touches the same tensors, it
turns any missing cross-stream ordering into a wrong result almost every time.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from deviceops.extend import ExecutionContext, ShapeError, Tensor, launch

from .runtime._driver import fast_kernel
from .runtime._module import expanded_source, load_module
from .runtime._op import KernelOp

__all__ = ["slow_copy"]

_fn: dict[int, Any] = {}
_clock_khz: dict[int, int] = {}


def _kernel(index: int) -> Any:
    if index not in _fn:
        import cupy

        mod = load_module(expanded_source("elementwise/elementwise.cu"), device_id=index,
                          name_expressions=("saxpy<float>",))
        _fn[index] = fast_kernel(mod.get_function("slow_copy"), "slow_copy", index)
        _clock_khz[index] = int(cupy.cuda.Device(index).attributes["ClockRate"])
    return _fn[index]


def slow_copy(dst: Tensor, src: Tensor, delay_s: float = 0.05) -> KernelOp:
    """After ``delay_s`` on the device, ``dst[...] = src``; produces ``dst``."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ShapeError(f"slow_copy: dst {dst.shape} {dst.dtype} != src {src.shape} {src.dtype}", op="slow_copy")

    def run(ctx: ExecutionContext, d: Tensor, s: Tensor) -> Tensor:
        da, sa = d.array, s.array

        def cpu() -> None:
            time.sleep(delay_s)
            np.copyto(da, sa)

        def cuda(native: Any) -> None:
            fn = _kernel(ctx.device.index)
            cycles = np.int64(delay_s * _clock_khz[ctx.device.index] * 1e3)
            fn((1,), (256,), (da, sa, np.int64(da.nbytes), cycles), stream=native)

        launch(ctx, "slow_copy", (s,), (d,), cpu, cuda)
        return d

    return KernelOp("slow_copy", run, (dst, src))
