"""Shared fixtures: the device under test, GPU skipping, async backends.

Tests run on the default device: CUDA 0 on a GPU machine, the cpu backend
elsewhere (CI). Tests marked ``gpu`` are skipped, with the reason shown (the CUDA
probe's own words: CuPy missing, no driver, no device), where no usable GPU exists.
Async tests run under both asyncio and trio through anyio's pytest plugin.

``DEVICEOPS_REQUIRE_GPU=N`` (``1`` on a one-GPU machine; every GPU script in ``tools/``
sets it) turns each skip for a GPU reason into a failure that prints the skip's reason
and the probe's: a skip whose reason says a GPU, CUDA, CuPy or a second device is missing
(every ``gpu``-marked test without a GPU, ``importorskip("cupy")``, "needs a CUDA GPU").
Tests that need more GPUs than ``N`` (their reason says "needs two CUDA GPUs" / "needs >= 2
CUDA GPUs") still skip when the machine has fewer; architecture skips (``sm_90`` only) and
by-design skips (a device fault would poison the CUDA context) stay skips.
"""

from __future__ import annotations

import gc
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import deviceops
from deviceops import _env
from deviceops._device import _probe_cuda

_HAS_GPU, _PROBE = _probe_cuda()
_REASON = f"needs a CUDA GPU (CuPy with a usable device); the CUDA probe says: {_PROBE}"


def required_gpus(raw: str | None = None) -> int:
    """GPUs ``DEVICEOPS_REQUIRE_GPU`` (or ``raw``) asks for (0: skips allowed; ``1``/``true``:
    one). Raises ``ValueError`` on anything else."""
    raw = (_env.get("DEVICEOPS_REQUIRE_GPU") if raw is None else raw).strip().lower()
    if raw in ("", "0", "no", "false", "off"):
        return 0
    if raw in ("yes", "true", "on"):
        return 1
    try:
        return max(1, int(raw))
    except ValueError:
        raise ValueError(f"DEVICEOPS_REQUIRE_GPU={raw!r}: give the number of GPUs the run must "
                         "use (1, 2 ...) or 0") from None


_REQUIRED = 0


def pytest_configure(config: pytest.Config) -> None:
    global _REQUIRED
    try:
        _REQUIRED = required_gpus()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


_GPU_WORDS = re.compile(r"\bGPUs?\b|\bCUDA\b|\bCuPy\b|\bcupy\b|second device")
_ABSENT = re.compile(r"\bneeds?\b|\bno\b|\bnone\b|not (?:importable|installed)|"
                     r"run on a GPU machine")
_NEEDS_N = re.compile(r"needs (?:>= ?)?(\d+|two) CUDA GPUs", re.IGNORECASE)
_ARCH = re.compile(r"\bsm_\d+")


def gpu_skip_is_failure(reason: str, required: int, gpus: int) -> bool:
    """Whether a skip with ``reason`` fails the run under ``DEVICEOPS_REQUIRE_GPU=required``
    on a machine with ``gpus`` GPUs: the reason says a GPU (CUDA, CuPy, a second device) is
    missing, and not that the test needs more GPUs than required and present."""
    if required <= 0 or _ARCH.search(reason):
        return False
    if not (_GPU_WORDS.search(reason) and _ABSENT.search(reason)):
        return False
    m = _NEEDS_N.search(reason)
    if m:
        need = 2 if m.group(1).lower() == "two" else int(m.group(1))
        return need <= required or need <= gpus  # asked for, or present and still skipped
    return True


def _gpu_count() -> int:
    if not _HAS_GPU:
        return 0
    try:
        return int(deviceops.device(0).backend.device_count())
    except Exception:
        return 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _HAS_GPU:
        return
    skip = pytest.mark.skip(reason=_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    outcome = yield
    rep = outcome.get_result()
    required = _REQUIRED
    if not rep.skipped or not required or getattr(rep, "wasxfail", None) is not None:
        return
    lr = rep.longrepr
    reason = str(lr[2]) if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
    if not gpu_skip_is_failure(reason, required, _gpu_count()):
        return
    rep.outcome = "failed"
    rep.longrepr = (f"DEVICEOPS_REQUIRE_GPU={required}: this GPU test "
                    f"would have been skipped: {reason}\nCUDA probe: {_PROBE} "
                    f"({_gpu_count()} GPU(s) usable)")


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = [f"deviceops default device: {deviceops.default_device()}",
             f"CUDA probe: {_PROBE}"]
    if _REQUIRED:
        lines.append(f"DEVICEOPS_REQUIRE_GPU={_REQUIRED}: a GPU skip is a failure")
    return lines


@pytest.fixture(scope="session", autouse=True)
def _weight_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The tests' converted GGUF weights go to a folder of this session (removed after it),
    not to the user's cache: tests load many short-lived files. A ``DEVICEOPS_WEIGHT_CACHE``
    set by the caller is kept."""
    import os
    import shutil

    if "DEVICEOPS_WEIGHT_CACHE" in os.environ:
        yield
        return
    folder = tmp_path_factory.mktemp("weight_cache")
    os.environ["DEVICEOPS_WEIGHT_CACHE"] = str(folder)
    try:
        yield
    finally:
        os.environ.pop("DEVICEOPS_WEIGHT_CACHE", None)
        shutil.rmtree(folder, ignore_errors=True)


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


def traced(t: Any, name: str) -> list[Any]:
    """The records of ``name`` in trace ``t`` (``deviceops.trace()``), device times resolved."""
    recs = [r for r in t.records if r.name == name]
    assert recs, f"no {name!r} in the trace: {[r.name for r in t.records]}"
    assert all(r.start is not None and r.end is not None for r in recs), recs
    return recs


def overlapped(recs: list[Any]) -> bool:
    """Whether all ``recs`` (trace records) ran at one time: some instant lies in every one."""
    return max(r.start for r in recs) < min(r.end for r in recs)



@pytest.fixture(scope="session")
def smollm2_chat_template() -> str:
    """SmolLM2's chat template, read once from its GGUF (reading the file's metadata takes
    seconds); skips without the weights."""
    from deviceops.nn.checkpoint import smollm2_path

    try:
        path = smollm2_path()
    except FileNotFoundError as exc:
        pytest.skip(f"needs the SmolLM2 GGUF: {exc}")
    import gguf

    field = gguf.GGUFReader(str(path)).fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny random Llama of :mod:`tests.nn_tiny` as a GGUF file (an untied head), written
    once; the serving tests load it as ``--model``."""
    from . import nn_tiny

    path = Path(tmp_path_factory.mktemp("tiny_gguf")) / "tiny.gguf"
    nn_tiny.write_gguf(path, nn_tiny.hf_weights(1, tied=False), "F32")
    return str(path)
