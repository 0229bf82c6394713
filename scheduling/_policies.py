"""The shipped policies: round-robin over a stream pool, one stream, several devices.

| policy                                   | streams                     | zip branches        |
|------------------------------------------|-----------------------------|---------------------|
| ``StreamPoolRoundRobin(device, n=4)``    | ``n`` streams on one device | overlap             |
| ``SingleStream(stream)``                 | that stream                 | run in order        |
| ``MultiDeviceRoundRobin(devices, n=2)``  | ``n`` per device, rotating  | spread over devices |
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from deviceops._errors import SchedulingError

from ._policy import SchedulingPolicy

if TYPE_CHECKING:
    from deviceops._device import Device
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
    """Rotates over devices, and over ``streams_per_device`` streams on each.

    Successive ops and zip branches land on successive devices, so independent
    branches of a ``zip`` spread over the GPUs. An op still runs where it is
    placed: a tensor from another device is refused with an error naming
    ``api.to_device``; copy it explicitly.

    Args:
        devices: the devices (``None``: every CUDA device, or ``cpu`` without one).
        streams_per_device: streams per device, >= 1.
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
        if len({d.backend for d in devs}) > 1:
            raise SchedulingError("MultiDeviceRoundRobin: cannot mix the cpu backend with CUDA devices")
        if streams_per_device < 1:
            raise SchedulingError(f"MultiDeviceRoundRobin: streams_per_device must be >= 1, got {streams_per_device}")
        self.devices = tuple(devs)
        pools = [[d.new_stream() for _ in range(streams_per_device)] for d in devs]
        # interleave: d0s0, d1s0, ..., d0s1, d1s1, ...
        self.streams: tuple[Stream, ...] = tuple(s for group in zip(*pools, strict=True) for s in group)
        self._next = itertools.cycle(self.streams).__next__
        self._lock = threading.Lock()

    def next_stream(self) -> Stream:
        with self._lock:
            return self._next()

    @property
    def device(self) -> Device:
        return self.devices[0]

    def __repr__(self) -> str:
        return f"MultiDeviceRoundRobin(devices={list(self.devices)!r})"
