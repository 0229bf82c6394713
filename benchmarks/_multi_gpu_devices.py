"""The device helpers of ``benchmarks/multi_gpu.py``: the ``--devices`` list, a device's
name, CuPy work on a device (:func:`on`), a device's array module and waiting for a set of
devices (:func:`finish`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import deviceops


# -- devices -----------------------------------------------------------------------------
def parse_devices(spec: str) -> list[deviceops.Device]:
    out = []
    for tok in spec.split(","):
        tok = tok.strip()
        out.append(deviceops.device(int(tok) if tok.isdigit() else tok))
    return out


def device_name(dev: deviceops.Device, cp: Any) -> str:
    if dev.is_cpu or cp is None:
        return f"{dev} (emulated cpu device)"
    name = cp.cuda.runtime.getDeviceProperties(dev.index)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


@contextlib.contextmanager
def on(dev: deviceops.Device, cp: Any) -> Iterator[None]:
    """CuPy work in the block runs on ``dev`` (nothing on the cpu backend)."""
    if dev.is_cpu or cp is None:
        yield
    else:
        with cp.cuda.Device(dev.index):
            yield


def xp_of(dev: deviceops.Device) -> Any:
    return dev.xp


def finish(devs: Sequence[deviceops.Device]) -> None:
    for d in devs:
        d.synchronize()
