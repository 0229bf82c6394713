"""The extension interface: what a kernel library needs from the deviceops core.

``deviceops.kernels`` is written against this module only (plus the public ``deviceops``
names), and so is any third-party kernel package: a launcher validates its arguments,
builds a :class:`DeviceOp` whose ``_execute`` receives an :class:`ExecutionContext`, and
enqueues its device work through :func:`launch` (or, for pre-recorded driver calls,
:func:`ordered`), which keeps the cross-stream hazard records every other op relies on.

| name                                   | what it is                                          |
|----------------------------------------|-----------------------------------------------------|
| :class:`DeviceOp`, :func:`drive`       | the op base class; the iterative DAG driver         |
| :class:`ExecutionContext`              | the stream (and policy) an op executes on           |
| :data:`enqueue_lock`                   | held while an op is enqueued (one enqueue at a time)|
| :class:`Tensor`, :class:`Partition`, :class:`Storage` | tensors, tilings, the memory behind them |
| :func:`allocate`, :func:`check_device` | an output on the executing stream; a device check   |
| :func:`take_spare`                     | an output from the stream's spare arrays, if any    |
| :func:`launch`                         | hazards + enqueue of one unit of device work        |
| :func:`ordered`                        | hazards + a driver call made by the caller          |
| :func:`set_launch_recorder`            | observe the storages each :func:`launch` touches    |
| :func:`tracing`, ``trace_state``       | whether a :func:`deviceops.trace` is recording      |
|                                        | (``trace_state.current is not None``: one read)     |
| ``FRESH``, ``DONE``                    | a DeviceOp's state when made without ``__init__``;  |
|                                        | once executed (for an op that overrides ``_exec``)  |
| :class:`Stream`                        | the stream interface (``native``, ``capture``, ...) |
| dtypes: ``FLOATING``, ``normalize_dtype``, ``is_floating``, the dtype constants | |
| errors: ``ShapeError``, ``DTypeError``, ``DeviceError``, ``DriverError``, ``CaptureError``, ``LaunchError`` | |

Everything here is stable for kernel authors; the modules it comes from are private.
"""

from __future__ import annotations

from . import _trace as trace_state
from ._context import ExecutionContext, enqueue_lock
from ._dtypes import (
    FLOATING,
    bfloat16,
    float16,
    float32,
    int32,
    int64,
    is_floating,
    normalize_dtype,
)
from ._errors import CaptureError, DeviceError, DriverError, DTypeError, LaunchError, ShapeError
from ._launch import launch, ordered, set_launch_recorder
from ._op import _DONE as DONE
from ._op import _FRESH as FRESH
from ._op import DeviceOp
from ._op import _drive as drive
from ._stream import Stream
from ._tensor import (
    Partition,
    Storage,
    Tensor,
    allocate,
    check_device,
    host_data_hint,
    take_spare,
)

__all__ = [
    "DONE",
    "FLOATING",
    "FRESH",
    "CaptureError",
    "DTypeError",
    "DeviceError",
    "DriverError",
    "LaunchError",
    "ShapeError",
    "DeviceOp",
    "ExecutionContext",
    "Partition",
    "Storage",
    "Stream",
    "Tensor",
    "allocate",
    "bfloat16",
    "check_device",
    "drive",
    "enqueue_lock",
    "float16",
    "float32",
    "host_data_hint",
    "int32",
    "int64",
    "is_floating",
    "launch",
    "normalize_dtype",
    "ordered",
    "set_launch_recorder",
    "take_spare",
    "trace_state",
    "tracing",
]


def tracing() -> bool:
    """True while a :func:`deviceops.trace` block records launches (kernels then take their
    fully reported path, not a replay)."""
    return trace_state.current is not None
