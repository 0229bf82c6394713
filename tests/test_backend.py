"""The backend interface (issue 12 item 1): ``deviceops._backend.Backend`` and its two
implementations, and a guard that the core does not branch on the backend.

The cpu half runs everywhere (CI); the cuda half checks the class without a GPU and,
marked ``gpu``, its behaviour on one.
"""

from __future__ import annotations

import ast
import inspect
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import deviceops
from deviceops import api
from deviceops._backend import Backend
from deviceops._cpu_backend import CpuBackend
from deviceops._cpu_stream import CpuEvent, CpuStream
from deviceops._cuda_backend import CudaBackend, CudaEvent, CudaStream
from deviceops._device import backend
from deviceops._errors import DeviceError, LaunchError, OutOfMemoryError
from deviceops._stream import Event, Stream

ROOT = Path(__file__).resolve().parents[1]


def _abstract_names(cls: type) -> set[str]:
    return {n for n, v in vars(cls).items() if getattr(v, "__isabstractmethod__", False)}


# -- both backends implement the whole interface --------------------------------------
@pytest.mark.parametrize("impl", [CpuBackend, CudaBackend, CpuStream, CudaStream, CpuEvent,
                                  CudaEvent])
def test_implementation_leaves_nothing_abstract(impl: type) -> None:
    assert not inspect.isabstract(impl), f"{impl.__name__} misses {impl.__abstractmethods__}"


@pytest.mark.parametrize("impl", [CpuBackend, CudaBackend])
def test_backend_overrides_every_declared_method(impl: type[Backend]) -> None:
    declared = _abstract_names(Backend)
    assert {"new_stream", "wrap_stream", "synchronize", "empty", "host_empty", "download",
            "upload", "copy", "copy_peer", "submit", "begin_capture", "end_capture",
            "abort_capture", "replay", "load_program", "trace_mark", "array_module"} <= declared
    for name in declared:
        assert name in vars(impl), f"{impl.__name__} does not define {name}"
        assert (inspect.getdoc(getattr(Backend, name)) or "").strip(), f"Backend.{name}: no doc"
    for attr in ("kind", "is_cpu", "spin_before_park", "stream_class", "event_class"):
        assert attr in vars(impl), f"{impl.__name__} does not set {attr}"


def test_cuda_backend_class_facts_without_a_gpu() -> None:
    be = CudaBackend()  # creating it imports nothing (CuPy on first use)
    assert (be.kind, be.is_cpu, be.spin_before_park) == ("cuda", False, True)
    assert be.stream_class is CudaStream and be.event_class is CudaEvent
    assert be.device_name(3) == "cuda:3"
    with pytest.raises(DeviceError, match="load_program: cpu is not a CUDA device"):
        be.load_program(deviceops.device("cpu"), "__global__ void k() {}")


def test_stream_base_declares_the_members_core_uses() -> None:
    # what the core calls on any stream: declared on the base, with defaults where only
    # one backend needs them (so no "type: ignore[attr-defined]")
    assert "enqueue" in _abstract_names(Stream)
    assert Stream.native is None
    for name in ("absorb_after", "latch_error", "check_latch"):
        assert name in vars(Stream)
        assert getattr(CudaStream, name) is getattr(Stream, name)  # cuda: the defaults
        assert getattr(CpuStream, name) is not getattr(Stream, name)
    assert CudaEvent.hand_over_error is Event.hand_over_error
    assert CpuEvent.hand_over_error is not Event.hand_over_error


# -- devices delegate to one backend instance per kind ---------------------------------
def test_device_has_one_backend_per_kind() -> None:
    cpu = deviceops.device("cpu")
    assert cpu.backend is backend("cpu")
    assert isinstance(cpu.backend, CpuBackend)
    assert isinstance(backend("cuda"), CudaBackend) and backend("cuda") is backend("cuda")
    assert vars(cpu)["is_cpu"] is True  # a plain attribute, read on hot paths
    assert cpu.xp is np and cpu.backend.array_module is np
    s = cpu.new_stream()
    assert isinstance(s, CpuStream) and s.backend is cpu.backend and s.native is None
    with pytest.raises(ValueError, match="not a device kind"):
        backend("tpu")


def test_cpu_wrap_stream_is_refused_through_the_device() -> None:
    with pytest.raises(DeviceError, match="wrap_stream: the cpu backend has no native streams"):
        deviceops.device("cpu").wrap_stream(object())


# -- the cpu backend, method by method -------------------------------------------------
@pytest.fixture
def cpu() -> CpuBackend:
    be = deviceops.device("cpu").backend
    assert isinstance(be, CpuBackend)
    return be


@pytest.fixture
def cs() -> Stream:
    return deviceops.device("cpu").new_stream()


def test_cpu_facts(cpu: CpuBackend) -> None:
    assert (cpu.kind, cpu.is_cpu, cpu.spin_before_park) == ("cpu", True, False)
    assert cpu.device_count() == 1 and cpu.device_name(0) == "cpu"
    assert cpu.new_stream(deviceops.device("cpu")).device is deviceops.device("cpu")


def test_cpu_synchronize_waits_for_every_stream(cpu: CpuBackend, cs: Stream) -> None:
    other = deviceops.device("cpu").new_stream()
    done: list[int] = []
    cs.enqueue(lambda: (time.sleep(0.05), done.append(1)), "slow")
    other.enqueue(lambda: (time.sleep(0.03), done.append(2)), "slow")
    cpu.synchronize(deviceops.device("cpu"))
    assert sorted(done) == [1, 2]


def test_cpu_empty_and_oom(cpu: CpuBackend, cs: Stream) -> None:
    a = cpu.empty(cs, (3, 5), np.dtype("float16"), "t")
    assert isinstance(a, np.ndarray) and a.shape == (3, 5) and a.dtype == np.float16
    with pytest.raises(OutOfMemoryError) as info:
        cpu.empty(cs, (1 << 45,), np.dtype("float32"), "myop")
    msg = str(info.value)
    assert msg.startswith("myop: out of memory on cpu") and "140,737,488,355,328 bytes" in msg
    assert "free" in msg and info.value.op == "myop"


def test_cpu_host_memory_and_interop(cpu: CpuBackend) -> None:
    h = cpu.host_empty((2, 3), np.dtype("int32"))
    assert isinstance(h, np.ndarray) and h.shape == (2, 3) and h.dtype == np.int32
    x = np.random.default_rng(0).standard_normal((4, 7)).astype(np.float32)
    np.testing.assert_array_equal(cpu.to_numpy(x), x)
    y = cpu.from_dlpack(x)
    assert isinstance(y, np.ndarray) and np.shares_memory(x, y)


def test_cpu_copies(cpu: CpuBackend) -> None:
    rng = np.random.default_rng(1)
    dev = deviceops.device("cpu")
    for copy in (lambda d, s: cpu.copy(d, s, None), lambda d, s: cpu.download(s, d, None),
                 lambda d, s: cpu.upload(d, s, None),
                 lambda d, s: cpu.copy_peer(d, dev, s, dev, None)):
        src = rng.standard_normal((5, 3)).astype(np.float32)
        dst = np.full((5, 3), np.nan, np.float32)  # poisoned
        copy(dst, src)
        np.testing.assert_array_equal(dst, src)
    src = rng.standard_normal((6, 4)).astype(np.float32)[:, ::2]  # non-contiguous source
    dst = np.full((6, 2), np.nan, np.float32)
    cpu.copy(dst, src, None)
    np.testing.assert_array_equal(dst, src)


def test_cpu_submit_runs_on_the_worker_and_keeps_failure_records(cpu: CpuBackend,
                                                                 cs: Stream) -> None:
    a = api.zeros((4,)).sync_on(cs)
    b = api.zeros((4,)).sync_on(cs)
    where: list[str] = []
    cpu.submit(cs, "ok", [a._storage], [b._storage],
               lambda: where.append(threading.current_thread().name),
               lambda native: pytest.fail("cuda_fn called on the cpu backend"))
    cs.synchronize()
    assert where and where[0].startswith("deviceops-cpu-stream-")

    def boom() -> None:
        raise RuntimeError("kaput")

    cpu.submit(cs, "bad", [], [b._storage], boom, lambda native: None)
    with pytest.raises(LaunchError, match="bad failed on cpu: RuntimeError: kaput"):
        cs.synchronize()
    assert b._storage.failed is not None and b._storage.failed[0] == "bad"
    # reading the failed tensor is refused at submit, naming the producer
    with pytest.raises(LaunchError, match="an input was produced by bad"):
        cpu.submit(cs, "reader", [b._storage], [], lambda: None, lambda native: None)


def test_cpu_capture_and_replay(cpu: CpuBackend, cs: Stream) -> None:
    from deviceops._capture import CaptureState

    state = CaptureState(cs, "test")
    cs.capture = state
    cpu.begin_capture(cs)  # nothing to do: the stream records tasks while capture is set
    ran: list[str] = []
    cs.enqueue(lambda: ran.append("a"), "a")
    cs.enqueue(lambda: ran.append("b"), "b")
    cs.capture = None
    assert cpu.end_capture(cs) is None
    cpu.abort_capture(cs)  # never raises
    cs.synchronize()
    assert ran == [] and [n for _, n in state.tasks] == ["a", "b"]
    assert cpu.graph_size(None, state.tasks) == 2
    cpu.replay(cs, None, state.tasks)
    cpu.replay(cs, None, state.tasks)
    cs.synchronize()
    assert ran == ["a", "b", "a", "b"]


def test_cpu_load_program_is_refused_clearly(cpu: CpuBackend) -> None:
    with pytest.raises(DeviceError) as info:
        cpu.load_program(deviceops.device("cpu"), "__global__ void k() {}")
    assert "cpu backend runs no compiled CUDA programs" in str(info.value)
    assert info.value.op == "load_program" and info.value.device == "cpu"


def test_cpu_trace_mark_gives_the_worker_time(cpu: CpuBackend, cs: Stream) -> None:
    """The mark is taken by the worker when it reaches it: after the task before it ended,
    before the host saw it resolved (event order, no duration assumed)."""
    ended: list[float] = []
    gate = threading.Event()
    cs.enqueue(lambda: (gate.wait(10), ended.append(time.perf_counter())), "slow")
    resolve = cpu.trace_mark(cs, {})
    released = time.perf_counter()
    gate.set()
    t = resolve()  # waits for the worker to reach the mark
    assert t is not None and ended and released <= ended[0] <= t <= time.perf_counter()


def test_stream_defaults_do_nothing() -> None:
    s = deviceops.device("cpu").new_stream()
    assert Stream.latch_error(s) is None
    Stream.absorb_after(s, 0)
    Stream.check_latch(s, [RuntimeError("x")], "nothing")
    s.synchronize()  # the base defaults enqueued nothing that fails


def test_cuda_array_interface_is_absent_on_cpu() -> None:
    t = api.zeros((2,)).sync_on(deviceops.device("cpu").new_stream())
    with pytest.raises(AttributeError, match="cpu-backend Tensor has no __cuda_array_interface"):
        _ = t.__cuda_array_interface__
    assert not hasattr(t, "__cuda_array_interface__")


# -- the cuda backend on a GPU (the lead's run) ----------------------------------------
@pytest.mark.gpu
def test_cuda_backend_methods_on_a_gpu() -> None:
    import cupy

    dev = deviceops.device(0)
    be = dev.backend
    assert isinstance(be, CudaBackend) and be.array_module is cupy and be.device_count() >= 1
    s = dev.new_stream()
    assert s.backend is be and s.native is not None
    rng = np.random.default_rng(2)
    host = rng.standard_normal((37, 5)).astype(np.float32)
    a = be.empty(s, (37, 5), np.dtype("float32"), "t")
    b = be.empty(s, (37, 5), np.dtype("float32"), "t")
    with s.native:
        a.fill(np.nan)
        b.fill(np.nan)
    be.upload(a, host, s.native)
    be.copy(b, a, s.native)
    out = be.host_empty((37, 5), np.dtype("float32"))
    out[...] = np.nan
    be.download(b, out, s.native)
    s.synchronize()
    np.testing.assert_array_equal(out, host)
    c = be.empty(s, (37, 5), np.dtype("float32"), "t")
    be.copy_peer(c, dev, b, dev, s.native)
    be.copy(c[:, ::2], a[:, ::2], s.native)  # non-contiguous: an elementwise copy
    s.synchronize()
    np.testing.assert_array_equal(be.to_numpy(c), host)
    np.testing.assert_array_equal(be.to_numpy(be.from_dlpack(c)), host)
    with pytest.raises(OutOfMemoryError, match="out of memory on cuda:0"):
        be.empty(s, (1 << 50,), np.dtype("float32"), "huge")
    w = be.wrap_stream(dev, cupy.cuda.Stream(non_blocking=True))
    assert isinstance(w, CudaStream)
    be.synchronize(dev)
    mod = be.load_program(dev, 'extern "C" __global__ void k(float* x) { x[threadIdx.x] = 1; }')
    assert mod.get_function("k") is not None
    clock: dict[Any, Any] = {}
    m0 = be.trace_mark(s, clock)
    m1 = be.trace_mark(s, clock)
    t0, t1 = m0(), m1()
    assert t0 is not None and t1 is not None and t0 <= t1
    assert be.graph_size(None, []) is None


# -- the guard: the core does not branch on the backend ---------------------------------
BACKEND_MODULES = {"deviceops/_cuda_backend.py", "deviceops/_cuda_device.py", "deviceops/_cpu_backend.py", "deviceops/_cpu_stream.py"}
# explicit exceptions, each with its reason (none: deviceops/_launch.py submits through
# ``stream.backend.submit``)
IS_CPU_EXCEPTIONS: set[str] = set()
CORE_FILES = sorted({*(p.relative_to(ROOT).as_posix() for p in (ROOT / "deviceops").glob("*.py")),
                     *(p.relative_to(ROOT).as_posix() for p in (ROOT / "graphs").glob("*.py")),
                     *(p.relative_to(ROOT).as_posix() for p in (ROOT / "scheduling").glob("*.py"))}
                    - BACKEND_MODULES)


def _cupy_uses(tree: ast.AST) -> list[str]:
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bad += [f"line {node.lineno}: import {a.name}" for a in node.names
                    if a.name.split(".")[0] in ("cupy", "cupyx")]
        elif isinstance(node, ast.ImportFrom) and not node.level and \
                (node.module or "").split(".")[0] in ("cupy", "cupyx"):
            bad.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Name) and node.id in ("cupy", "cupyx"):
            bad.append(f"line {node.lineno}: {node.id}")
    return bad


def _backend_branches(tree: ast.AST) -> list[str]:
    """Reads of ``.is_cpu`` / ``.is_cuda``, except as the value copied into such an
    attribute (``Device.__init__``: ``self.is_cpu = self.backend.is_cpu``)."""
    names = ("is_cpu", "is_cuda")
    copied = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
              and all(isinstance(t, ast.Attribute) and t.attr in names for t in n.targets)}
    return [f"line {n.lineno}: .{n.attr}" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr in names
            and isinstance(n.ctx, ast.Load) and id(n) not in copied]


@pytest.mark.parametrize("path", CORE_FILES)
def test_core_module_has_no_cupy(path: str) -> None:
    bad = _cupy_uses(ast.parse((ROOT / path).read_text()))
    assert not bad, f"{path} uses CuPy directly (move it into deviceops/_cuda_backend.py): {bad}"


@pytest.mark.parametrize("path", CORE_FILES)
def test_core_module_does_not_branch_on_the_backend(path: str) -> None:
    bad = _backend_branches(ast.parse((ROOT / path).read_text()))
    if path in IS_CPU_EXCEPTIONS:
        assert len(bad) <= 1, f"{path}: more is_cpu branches than the one excepted: {bad}"
        return
    assert not bad, f"{path} branches on the backend (call device.backend / stream.backend): {bad}"


def test_guard_sees_what_it_refuses() -> None:
    src = ("import cupy\nfrom cupyx import x\nif d.is_cpu:\n    y = cupy.empty(1)\n"
           "d.is_cpu = b.is_cpu\nz = 1 if s.device.is_cpu else 2\nk = {d.is_cuda for d in ds}\n")
    tree = ast.parse(src)
    assert len(_cupy_uses(tree)) == 3
    assert _backend_branches(tree) == ["line 3: .is_cpu", "line 6: .is_cpu", "line 7: .is_cuda"]
    assert "deviceops/_tensor.py" in CORE_FILES and "graphs/_graph.py" in CORE_FILES
    assert "deviceops/_cuda_backend.py" not in CORE_FILES


@pytest.mark.parametrize("path", CORE_FILES)
def test_no_ignore_for_declared_stream_members(path: str) -> None:
    members = (".native", ".enqueue(", ".absorb_after(", ".latch_error(", ".check_latch(",
               ".take =")
    bad = [f"line {i}" for i, line in enumerate((ROOT / path).read_text().splitlines(), 1)
           if "type: ignore[attr-defined]" in line and any(m in line for m in members)]
    if path in IS_CPU_EXCEPTIONS:
        return  # the lead's module: its ignores go with the launch rewrite (pyproject override)
    assert not bad, f"{path}: type: ignore on members the Stream base declares: {bad}"
