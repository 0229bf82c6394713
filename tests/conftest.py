"""Shared fixtures: the device under test, GPU skipping, async backends.

Tests run on the default device: CUDA 0 on a GPU machine, the cpu backend
elsewhere (CI). Tests marked ``gpu`` are skipped, with the reason shown, where
no usable GPU exists. Async tests run under both asyncio and trio through
anyio's pytest plugin.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator

import pytest

import deviceops

_HAS_GPU = deviceops.cuda_available()
_REASON = "needs a CUDA GPU (CuPy with a usable device); this machine has none"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _HAS_GPU:
        return
    skip = pytest.mark.skip(reason=_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config: pytest.Config) -> str:
    return f"deviceops default device: {deviceops.default_device()}"


@pytest.fixture
def dev() -> deviceops.Device:
    """The device under test (the default device)."""
    return deviceops.default_device()


@pytest.fixture
def stream(dev: deviceops.Device) -> deviceops.Stream:
    return dev.new_stream()


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(autouse=True)
def _no_unexecuted_ops() -> Iterator[None]:
    """Fail a test that leaks a never-executed DeviceOp (the RuntimeWarning)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", RuntimeWarning)
        yield
        gc.collect()
    leaked = [w for w in seen if "was never executed" in str(w.message)]
    assert not leaked, f"never-executed DeviceOps leaked: {[str(w.message) for w in leaked]}"


_host_streams: dict[deviceops.Device, deviceops.Stream] = {}


def to_np(t: deviceops.Tensor):  # type: ignore[no-untyped-def]
    """Host copy of a tensor (synchronizing), read on a stream of the tensor's own device."""
    s = _host_streams.get(t.device)
    if s is None:
        s = _host_streams[t.device] = t.device.new_stream()
    return deviceops.api.to_host(t).sync_on(s)
