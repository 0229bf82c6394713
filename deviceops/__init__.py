"""deviceops: lazy DAGs of GPU device operations.

Compose work as :class:`DeviceOp` values and run it with ``op.sync()``,
``await op`` (asyncio or trio), ``op.schedule()`` or as a CUDA-graph replay
(``op.graph()``). Runs on CUDA through CuPy, or on the ``cpu`` backend (NumPy,
one worker thread per stream) with the same semantics.

Example:
    >>> import deviceops
    >>> from deviceops import api, kernels
    >>> x = api.ones((4, 4)).sync()
    >>> y = kernels.add(x, x).sync()
    >>> api.to_host(y).sync()[0, 0]
    2.0
"""

from __future__ import annotations

from . import api
from . import graphs as _graphs  # noqa: F401  (installs the capture hook; see _hooks)
from ._async import configure_await
from ._backend import on_program_load
from ._context import ExecutionContext
from ._device import Device, cuda_available, default_device, device, set_default_device
from ._dtypes import bfloat16, float16, float32, int32, int64
from ._errors import (
    CaptureError,
    DeviceError,
    DriverError,
    DTypeError,
    LaunchError,
    NestedExecutionError,
    OutOfMemoryError,
    SchedulingError,
    ShapeError,
)
from ._future import DeviceFuture
from ._op import DeviceOp, SharedOp, unzip, value, zip
from ._stream import Event, Stream
from ._tensor import Partition, Tensor
from ._trace import Trace, trace
from .scheduling import SchedulingPolicy, set_default_policy, using

__version__ = "0.1.0"

__all__ = [
    "CaptureError",
    "DTypeError",
    "Device",
    "DeviceError",
    "DeviceFuture",
    "DeviceOp",
    "DriverError",
    "Event",
    "ExecutionContext",
    "LaunchError",
    "NestedExecutionError",
    "OutOfMemoryError",
    "Partition",
    "SchedulingError",
    "SchedulingPolicy",
    "ShapeError",
    "SharedOp",
    "Stream",
    "Tensor",
    "Trace",
    "api",
    "bfloat16",
    "configure_await",
    "on_program_load",
    "cuda_available",
    "default_device",
    "device",
    "float16",
    "float32",
    "int32",
    "int64",
    "set_default_device",
    "set_default_policy",
    "trace",
    "unzip",
    "using",
    "value",
    "zip",
]
