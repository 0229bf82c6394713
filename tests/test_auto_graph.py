"""Automatic graphs (deviceops/graphs/_auto.py): a tenant's repeated small DAG is captured at
its third run and replayed after; everything else runs as before."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import deviceops
from deviceops import ShapeError, api, kernels
from deviceops.graphs import _auto
from deviceops.scheduling import Tenant, TenantPool

CPU = deviceops.device("cpu")


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    _auto.clear()
    yield
    _auto.clear()


def _chain(x: Any, ws: list[Any]) -> Any:
    op: Any = x
    for w in ws:
        op = kernels.gemm(op, w)
    return op


def _data(n: int = 6, k: int = 3, seed: int | None = None) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    xh = rng.standard_normal((n, n)).astype(np.float32)
    whs = [rng.standard_normal((n, n)).astype(np.float32) for _ in range(k)]
    want = xh.astype(np.float64)
    for w in whs:
        want = want @ w.astype(np.float64)
    return xh, whs, want


def _put(dev: deviceops.Device, xh: np.ndarray, whs: list[np.ndarray]) -> tuple[Any, list[Any]]:
    s = dev.new_stream()
    return api.from_host(xh).sync_on(s), [api.from_host(w).sync_on(s) for w in whs]


def test_a_repeated_job_is_captured_at_its_third_run_and_replayed(dev: deviceops.Device) -> None:
    xh, whs, want = _data()
    x, ws = _put(dev, xh, whs)
    t = Tenant("t", device=dev)
    seen = []
    with deviceops.using(t):
        for _ in range(6):
            got = api.to_host(_chain(x, ws)).sync()
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
            seen.append((_auto.stats()["captured"], _auto.stats()["replayed"]))
        assert seen == [(0, 0), (0, 0), (1, 1), (1, 2), (1, 3), (1, 4)]
        # the leaves are read as they are at each replay
        api.memcpy(x, api.from_host(2 * xh)).sync()
        np.testing.assert_allclose(api.to_host(_chain(x, ws)).sync(), 2 * want, rtol=1e-3, atol=1e-3)
        assert _auto.stats()["replayed"] == 5
        # other leaves: another key (eager twice, then its own graph)
        x2, _ = _put(dev, -xh, whs)
        for _ in range(3):
            np.testing.assert_allclose(api.to_host(_chain(x2, ws)).sync(), -want, rtol=1e-3, atol=1e-3)
        assert _auto.stats()["graphs"] == 2


def test_sightings_and_graphs_are_bounded_and_kept_in_use_order(
        dev: deviceops.Device, monkeypatch: pytest.MonkeyPatch) -> None:
    xh, whs, _ = _data()
    _, ws = _put(dev, xh, whs)
    xs = [_put(dev, xh + i, [])[0] for i in range(3)]
    t = Tenant("t", device=dev)

    def job(i: int) -> None:
        api.to_host(_chain(xs[i], ws)).sync()

    with deviceops.using(t):
        monkeypatch.setattr(_auto, "_MAX_KEYS", 1)
        job(0), job(0), job(1), job(0)  # the second key pushed the first's sightings out
        assert _auto.stats()["captured"] == 0
        job(0), job(0)
        assert _auto.stats()["captured"] == 1 and not _auto._seen  # (captured: no sightings kept)
        monkeypatch.setattr(_auto, "MAX_GRAPHS", 2)
        for _ in range(_auto.SIGHTINGS):
            job(1)
        job(0)  # a replay: key 0 is now the most recently used
        for _ in range(_auto.SIGHTINGS):
            job(2)  # evicts key 1, the least recently used
        assert _auto.stats()["captured"] == 3 and _auto.stats()["graphs"] == 2
        n = _auto.stats()["replayed"]
        job(0)
        assert _auto.stats()["replayed"] == n + 1  # kept
        job(1)
        assert _auto.stats()["replayed"] == n + 1  # evicted: eager again


def test_a_dag_of_more_than_max_nodes_runs_eagerly(dev: deviceops.Device) -> None:
    xh, whs, _ = _data(k=1)
    x, _ = _put(dev, xh, whs)
    w = api.from_host(np.eye(6, dtype=np.float32)).sync()
    with deviceops.using(Tenant("t", device=dev)):
        for n in (_auto._MAX_NODES, _auto._MAX_NODES + 1):
            _auto.clear()
            for _ in range(_auto.SIGHTINGS):
                got = api.to_host(_chain(x, [w] * n)).sync()
            np.testing.assert_allclose(got, xh, rtol=1e-5, atol=1e-5)
            assert _auto.stats()["captured"] == (n == _auto._MAX_NODES), n
            assert _auto.stats()["failed"] == 0


def test_a_wide_dag_of_more_than_max_nodes_runs_eagerly(dev: deviceops.Device) -> None:
    """A DAG shallower than _MAX_NODES but with more ops than that is not captured."""
    x = api.from_host(np.full((2, 2), 0.5, np.float32)).sync()
    eye = api.from_host(np.eye(2, dtype=np.float32)).sync()

    def wide(steps: int, tail: bool) -> Any:  # 1 + 2 * steps (+ 1) ops
        op = kernels.gemm(x, eye)
        for _ in range(steps):
            op = kernels.gemm(op, kernels.gemm(x, eye))
        return kernels.gemm(op, eye) if tail else op

    with deviceops.using(Tenant("t", device=dev)):
        for steps, tail, n in ((31, True, 64), (32, False, 65)):
            _auto.clear()
            for _ in range(_auto.SIGHTINGS):
                api.to_host(wide(steps, tail)).sync()
            assert _auto.stats()["captured"] == (n <= _auto._MAX_NODES), n
            assert _auto.stats()["failed"] == 0


def test_a_deep_chain_is_walked_without_recursion(dev: deviceops.Device) -> None:
    """Deeper than Python's recursion limit: the walk stops at _MAX_NODES, the op runs."""
    x = api.from_host(np.full((2, 2), 0.5, np.float32)).sync()
    eye = api.from_host(np.eye(2, dtype=np.float32)).sync()
    with deviceops.using(Tenant("t", device=dev)):
        got = api.to_host(_chain(x, [eye] * 3000)).sync()
    np.testing.assert_array_equal(got, np.full((2, 2), 0.5, np.float32))


def test_a_launcher_that_may_not_be_recorded_is_never_captured(
        dev: deviceops.Device, monkeypatch: pytest.MonkeyPatch) -> None:
    from deviceops.kernels.gemm.op import _GEMM

    xh, whs, _ = _data()
    x, ws = _put(dev, xh, whs)
    monkeypatch.setattr(_GEMM, "replay", False)
    with deviceops.using(Tenant("t", device=dev)):
        for job in (lambda: _chain(x, ws), lambda: kernels.gemm(x, ws[0])):
            for _ in range(_auto.SIGHTINGS + 1):
                api.to_host(job()).sync()
    assert _auto.stats()["captured"] == 0 and _auto.stats()["failed"] == 0  # not even tried


def test_a_fresh_process_counts_from_zero() -> None:
    import subprocess
    import sys

    got = subprocess.run([sys.executable, "-c", "from deviceops.graphs import _auto; print(_auto.stats())"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert got.strip() == str({"captured": 0, "replayed": 0, "failed": 0, "graphs": 0})


def test_replayed_ops_count_as_executed(dev: deviceops.Device) -> None:
    xh, whs, _ = _data()
    x, ws = _put(dev, xh, whs)
    t = Tenant("t", device=dev)
    with deviceops.using(t), warnings.catch_warnings():
        warnings.simplefilter("error")  # no "never executed" warning for the replayed ops
        for _ in range(_auto.SIGHTINGS + 1):
            mid = kernels.gemm(x, ws[0])
            op = api.to_host(kernels.gemm(mid, ws[1]))
            op.sync()
        assert _auto.stats()["replayed"] == 2
        assert op.to_dot().count("stream ") == 3  # every op says where it ran
        with pytest.raises(deviceops.SchedulingError, match="already executed"):
            op.sync()  # a DeviceOp runs once, replayed or not
        with pytest.raises(deviceops.SchedulingError, match="already executed"):
            mid._exec(deviceops.extend.ExecutionContext(t.streams[0], None))


def test_each_leaf_is_part_of_the_key_and_kept_alive(dev: deviceops.Device) -> None:
    """A later op's own weight is in the key (another weight: another graph), and a captured
    leaf stays alive with its graph, so a new tensor never takes its identity."""
    import gc
    import weakref

    xh, whs, _ = _data(k=3)
    x, ws = _put(dev, xh, whs)
    want = {i: (xh.astype(np.float64) @ whs[0]) @ whs[i] for i in (1, 2)}
    with deviceops.using(Tenant("t", device=dev)):
        for i in (1, 2):
            for _ in range(_auto.SIGHTINGS + 1):
                got = api.to_host(kernels.gemm(kernels.gemm(x, ws[0]), ws[i])).sync()
                np.testing.assert_allclose(got, want[i], rtol=1e-3, atol=1e-3)
        assert _auto.stats()["captured"] == 2
        old = id(ws[2])
        alive = weakref.ref(ws[2])
        del ws[2]
        gc.collect()
        assert alive() is not None  # held by its graph's entry
        for _ in range(50):  # a new tensor in the old one's place would replay a stale graph
            fresh = api.from_host(3 * whs[2]).sync()
            assert id(fresh) != old
            got = api.to_host(kernels.gemm(kernels.gemm(x, ws[0]), fresh)).sync()
            np.testing.assert_allclose(got, 3 * want[2], rtol=1e-3, atol=1e-3)


def test_clear_forgets_graphs_and_sightings(dev: deviceops.Device) -> None:
    xh, whs, _ = _data()
    x, ws = _put(dev, xh, whs)
    with deviceops.using(Tenant("t", device=dev)):
        for _ in range(_auto.SIGHTINGS):
            api.to_host(_chain(x, ws)).sync()
        api.to_host(_chain(x2 := _put(dev, xh, [])[0], ws)).sync()  # one sighting of another key
        assert _auto.stats()["graphs"] == 1 and _auto._seen
        _auto.clear()
        assert _auto.stats() == {"captured": 0, "replayed": 0, "failed": 0, "graphs": 0}
        assert not _auto._seen and not _auto._graphs
        api.to_host(_chain(x, ws)).sync()  # eager again: a first sighting
        assert _auto.stats()["replayed"] == 0
        del x2


def test_sightings_are_forgotten_least_recently_seen_first(
        dev: deviceops.Device, monkeypatch: pytest.MonkeyPatch) -> None:
    xh, whs, _ = _data()
    _, ws = _put(dev, xh, whs)
    xs = [_put(dev, xh + i, [])[0] for i in range(3)]
    monkeypatch.setattr(_auto, "_MAX_KEYS", 2)
    with deviceops.using(Tenant("t", device=dev)):
        for i in (0, 1, 0, 2):  # key 0 seen again before key 2 comes: key 1 is forgotten
            api.to_host(_chain(xs[i], ws)).sync()
        api.to_host(_chain(xs[0], ws)).sync()  # key 0's third sighting: captured
        assert _auto.stats()["captured"] == 1


def test_what_is_not_eligible_runs_eagerly(dev: deviceops.Device) -> None:
    xh, whs, want = _data()
    x, ws = _put(dev, xh, whs)
    on = Tenant("on", device=dev)
    off = Tenant("off", device=dev, auto_graph=False)
    jobs = {
        "device result": lambda: _chain(x, ws),
        "a map in the chain": lambda: api.to_host(kernels.gemm(_chain(x, ws[:1]).map(lambda v: v), ws[1])),
        "a partition argument": lambda: api.to_host(kernels.gemm(x.partition((3, 6)), ws[0])),
        "a shared op": lambda: api.to_host(kernels.add(*([_chain(x, ws[:1]).shared()] * 2))),
        "a copy in the chain": lambda: api.to_host(kernels.gemm(api.dup(x), ws[0])),
        "a copy at the root": lambda: api.dup(_chain(x, ws)),
    }
    with deviceops.using(on):
        for name, make in jobs.items():
            for _ in range(_auto.SIGHTINGS + 1):
                make().sync()
            assert _auto.stats()["captured"] == 0 and _auto.stats()["failed"] == 0, name
    from deviceops.kernels.gemm import GemmOverride
    from deviceops.kernels.runtime import overrides

    with deviceops.using(on), overrides(GemmOverride(splits=1)):  # an experiment: as it says
        for _ in range(_auto.SIGHTINGS + 1):
            api.to_host(_chain(x, ws)).sync()
    assert _auto.stats()["captured"] == 0
    for policy in (off, None):
        for _ in range(_auto.SIGHTINGS + 1):
            if policy is None:
                got = api.to_host(_chain(x, ws)).sync()  # the default policy
            else:
                with deviceops.using(policy):
                    got = api.to_host(_chain(x, ws)).sync()
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
    assert _auto.stats()["captured"] == 0
    with pytest.raises(deviceops.SchedulingError, match="auto_graph must be a bool"):
        Tenant("bad", auto_graph=1)  # type: ignore[arg-type]


def test_a_failed_capture_runs_eagerly_for_good(dev: deviceops.Device,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    xh, whs, want = _data()
    x, ws = _put(dev, xh, whs)
    calls = []

    def refuse(*a: Any, **k: Any) -> Any:
        calls.append(1)
        raise deviceops.CaptureError("refused here")

    monkeypatch.setattr(_auto, "capture_locked", refuse)
    with deviceops.using(Tenant("t", device=dev)):
        for _ in range(_auto.SIGHTINGS + 3):
            np.testing.assert_allclose(api.to_host(_chain(x, ws)).sync(), want, rtol=1e-3, atol=1e-3)
    assert calls == [1] and _auto.stats()["failed"] == 1 and _auto.stats()["replayed"] == 0


def test_a_misfit_is_refused_as_it_would_be_eagerly(dev: deviceops.Device) -> None:
    xh, whs, _ = _data()
    x, ws = _put(dev, xh, whs)
    bad = api.from_host(np.ones((5, 6), np.float32)).sync()
    with deviceops.using(Tenant("t", device=dev)):
        for _ in range(_auto.SIGHTINGS + 1):
            with pytest.raises(ShapeError):
                api.to_host(kernels.gemm(kernels.gemm(x, ws[0]), bad)).sync()


def test_graphs_are_bounded(dev: deviceops.Device, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_auto, "MAX_GRAPHS", 2)
    xh, whs, _ = _data()
    _, ws = _put(dev, xh, whs)
    with deviceops.using(Tenant("t", device=dev)):
        for i in range(4):
            x, _ = _put(dev, xh + i, [])
            for _ in range(_auto.SIGHTINGS):
                api.to_host(_chain(x, ws)).sync()
    assert _auto.stats()["captured"] == 4 and _auto.stats()["graphs"] == 2


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.anyio
async def test_awaiting_tenants_each_get_their_own_results(anyio_backend: str) -> None:
    pool = TenantPool([CPU], streams_per_priority=2, max_queued=2)
    jobs = []
    for i in range(6):
        xh, whs, want = _data(seed=i)
        x, ws = _put(CPU, xh, whs)
        jobs.append((pool.tenant(f"t{i}", priority="high"), x, ws, want))
    bad: list[str] = []

    async def loop(t: Tenant, x: Any, ws: list[Any], want: np.ndarray) -> None:
        with deviceops.using(t):
            for _ in range(6):
                got = await api.to_host(_chain(x, ws))
                if not np.allclose(got, want, rtol=1e-3, atol=1e-3):
                    bad.append(t.name)

    async with anyio.create_task_group() as tg:
        for job in jobs:
            tg.start_soon(loop, *job)
    assert not bad
    assert _auto.stats()["captured"] == 6 and _auto.stats()["replayed"] == 6 * 4


@pytest.mark.gpu
def test_gpu_replay_is_bit_equal_to_eager() -> None:
    dev = deviceops.device(0)
    rng = np.random.default_rng()
    xh = rng.standard_normal((200, 256), dtype=np.float32).astype(np.float16)
    whs = [(rng.standard_normal((256, 256), dtype=np.float32) / 16).astype(np.float16) for _ in range(4)]
    x, ws = _put(dev, xh, whs)
    eager = api.to_host(_chain(x, ws)).sync()
    with deviceops.using(Tenant("t", device=dev, priority="high")):
        outs = [api.to_host(_chain(x, ws)).sync() for _ in range(_auto.SIGHTINGS + 3)]
    assert _auto.stats()["replayed"] == 4
    for got in outs:
        np.testing.assert_array_equal(got, eager)
    want = xh.astype(np.float64)
    for w in whs:
        want = (want @ w.astype(np.float64)).astype(np.float16).astype(np.float64)
    np.testing.assert_allclose(eager.astype(np.float64), want, rtol=2e-2, atol=2e-2)
