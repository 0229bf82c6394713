"""The deviceops exception hierarchy.

Everything the library raises on purpose derives from :class:`DeviceError`::

    DeviceError
    ├── LaunchError          a kernel or copy could not be enqueued, or failed on the device
    ├── SchedulingError      a DeviceOp was executed in a way the scheduler refuses
    │   └── NestedExecutionError   sync()/await inside a then-closure or a capture
    ├── CaptureError         CUDA-graph capture refused an op, or capture failed
    ├── DriverError          the CUDA driver/runtime reported an error
    ├── OutOfMemoryError     (also MemoryError) an allocation did not fit on the device
    ├── ShapeError           (also ValueError) shapes do not fit; raised before launch
    └── DTypeError           (also TypeError) dtypes do not fit; raised before launch

Errors carry, where known, the op name and the device so that a message read in
a log says what failed where.
"""

from __future__ import annotations

__all__ = [
    "CaptureError",
    "DTypeError",
    "DeviceError",
    "DriverError",
    "LaunchError",
    "NestedExecutionError",
    "OutOfMemoryError",
    "SchedulingError",
    "ShapeError",
]


class DeviceError(Exception):
    """Root of every error deviceops raises on purpose.

    Attributes:
        op: name of the operation that failed, when known.
        device: the device (``"cuda:0"``, ``"cpu"``) where it failed, when known.
    """

    def __init__(self, message: str, *, op: str | None = None, device: str | None = None) -> None:
        super().__init__(message)
        self.op = op
        self.device = device


class LaunchError(DeviceError):
    """A kernel or copy could not be enqueued, or failed while running on the device."""


class SchedulingError(DeviceError):
    """A DeviceOp was executed in a way the scheduler does not allow."""


class NestedExecutionError(SchedulingError, RuntimeError):
    """``sync()`` / ``await`` was called while a DeviceOp was being enqueued.

    Raised from inside a ``then``/``map``/``inspect`` closure or a graph capture,
    where blocking on the device would deadlock or break the capture.
    """


class CaptureError(DeviceError):
    """CUDA-graph capture refused an op (e.g. one that allocates), or capture failed."""


class DriverError(DeviceError):
    """The CUDA driver or runtime reported an error."""


class OutOfMemoryError(DeviceError, MemoryError):
    """An allocation did not fit: the message names the bytes asked for and the bytes free."""


class ShapeError(DeviceError, ValueError):
    """Argument shapes do not fit the operation. Raised before anything is launched."""


class DTypeError(DeviceError, TypeError):
    """Argument dtypes do not fit the operation. Raised before anything is launched."""
