"""The shipped policies: round-robin over a stream pool, one stream, several devices.

| policy                                   | streams                     | zip branches        |
|------------------------------------------|-----------------------------|---------------------|
| ``StreamPoolRoundRobin(device, n=4)``    | ``n`` streams on one device | overlap             |
| ``SingleStream(stream)``                 | that stream                 | run in order        |
| ``MultiDeviceRoundRobin(devices, n=2)``  | ``n`` per device; an op on  | each on its data's  |
|                                          | its inputs' device          | device, else spread |
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from deviceops._errors import DeviceError, SchedulingError
from deviceops._placement import placement

from ._policy import SchedulingPolicy

if TYPE_CHECKING:
    from deviceops._device import Device
    from deviceops._op import DeviceOp
    from deviceops._stream import Stream

__all__ = ["MultiDeviceRoundRobin", "SingleStream", "StreamPoolRoundRobin"]


class StreamPoolRoundRobin(SchedulingPolicy):
    """Hands out ``num_streams`` streams of one device in turn (the default policy).

    Args:
        device: the device (``None``: the default device at construction).
        num_streams: pool size, >= 1.
    """

    def __init__(self, device: Device | int | str | None = None, num_streams: int = 4) -> None:
        from deviceops._device import default_device
        from deviceops._device import device as _device

        if num_streams < 1:
            raise SchedulingError(f"StreamPoolRoundRobin: num_streams must be >= 1, got {num_streams}")
        self._device = default_device() if device is None else _device(device)
        self.streams: tuple[Stream, ...] = tuple(self._device.new_stream() for _ in range(num_streams))
        self._next = itertools.cycle(self.streams).__next__  # atomic under the GIL: no lock

    def next_stream(self) -> Stream:
        return self._next()

    @property
    def device(self) -> Device:
        return self._device

    def __repr__(self) -> str:
        return f"StreamPoolRoundRobin(device={self._device!r}, num_streams={len(self.streams)})"


class SingleStream(SchedulingPolicy):
    """Everything on one stream: ops and zip branches run strictly in order."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    def next_stream(self) -> Stream:
        return self.stream

    @property
    def device(self) -> Device:
        return self.stream.device

    def __repr__(self) -> str:
        return f"SingleStream({self.stream!r})"


class MultiDeviceRoundRobin(SchedulingPolicy):
    """Runs each op on the device its data lives on; spreads the rest over the devices.

    Placement follows the data: an op (or a ``zip`` branch) whose input tensors live on
    one device runs on a stream of that device (its ``streams_per_device`` streams in
    turn); an op with no input tensors (``api.zeros``, ``api.from_host``) takes the next
    device in turn, so independent ``zip`` branches spread over the GPUs and overlap. An
    op whose inputs live on two devices is refused before anything is enqueued, with a
    :class:`~deviceops.DeviceError` naming both devices and ``api.to_device``; copy
    explicitly. ``api.to_device(t, d)`` is placed on ``d``.

    Args:
        devices: the devices (``None``: every CUDA device, or ``cpu`` without one).
            Emulated cpu devices (``"cpu:0"``, ``"cpu:1"``) work as GPUs do; the two
            backends cannot be mixed.
        streams_per_device: streams per device, >= 1.

    Example:
        >>> pol = MultiDeviceRoundRobin(["cpu:0", "cpu:1"])
        >>> with deviceops.using(pol):
        ...     a, b = deviceops.zip(api.ones((4,)), api.ones((4,))).sync()
        >>> (str(a.device), str(b.device))
        ('cpu', 'cpu:1')
    """

    spans_devices = True

    def __init__(self, devices: Sequence[Device | int | str] | None = None, streams_per_device: int = 2) -> None:
        from deviceops._device import backend, cuda_available
        from deviceops._device import device as _device

        if devices is None:
            devices = list(range(backend("cuda").device_count())) if cuda_available() else ["cpu"]
        devs = [_device(d) for d in devices]
        if not devs:
            raise SchedulingError("MultiDeviceRoundRobin: give at least one device")
        if len(set(devs)) != len(devs):
            raise SchedulingError(f"MultiDeviceRoundRobin: a device is named twice in {devs}")
        if len({d.backend for d in devs}) > 1:
            raise SchedulingError("MultiDeviceRoundRobin: cannot mix the cpu backend with CUDA devices")
        if streams_per_device < 1:
            raise SchedulingError(f"MultiDeviceRoundRobin: streams_per_device must be >= 1, got {streams_per_device}")
        self.devices = tuple(devs)
        pools = [[d.new_stream() for _ in range(streams_per_device)] for d in devs]
        # interleave: d0s0, d1s0, ..., d0s1, d1s1, ...
        self.streams: tuple[Stream, ...] = tuple(s for group in zip(*pools, strict=True) for s in group)
        self._next = itertools.cycle(self.streams).__next__
        self._per_device = {d: itertools.cycle(pool).__next__ for d, pool in zip(devs, pools, strict=True)}
        self._lock = threading.Lock()

    def next_stream(self) -> Stream:
        with self._lock:
            return self._next()

    def stream_for(self, op: DeviceOp[Any]) -> Stream:
        """A stream of the device ``op``'s inputs live on, else :meth:`next_stream`.

        Raises:
            DeviceError: the inputs live on two devices, or on a device this policy does
                not cover.
        """
        return self.stream_on(placement(op), op._describe())

    def stream_on(self, dev: Device | None, what: str = "an op") -> Stream:
        """The next stream of ``dev`` (``None``: :meth:`next_stream`); ``what`` names the op
        in the error.

        Raises:
            DeviceError: this policy does not cover ``dev``.
        """
        if dev is None:
            return self.next_stream()
        nxt = self._per_device.get(dev)
        if nxt is None:
            raise DeviceError(
                f"{what}: its inputs live on {dev}, which {self!r} does not cover; "
                f"add {str(dev)!r} to its devices or copy the data with api.to_device",
                op=what, device=str(dev))
        with self._lock:
            return nxt()

    @property
    def device(self) -> Device:
        return self.devices[0]

    def __repr__(self) -> str:
        return f"MultiDeviceRoundRobin(devices={[str(d) for d in self.devices]!r})"
