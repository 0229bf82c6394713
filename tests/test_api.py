"""deviceops.api against NumPy, every dtype; interop round trips."""

from __future__ import annotations

import importlib.util
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import deviceops
from deviceops import api

from .conftest import to_np

DTYPES = ["float32", "float16", "bfloat16", "int32", "int64"]
FLOATS = ["float32", "float16", "bfloat16"]


def npdt(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zeros_ones_full_empty(dtype: str) -> None:
    for op, ref in ((api.zeros((3, 5), dtype), np.zeros((3, 5))), (api.ones((7,), dtype), np.ones(7)),
                    (api.full((2, 3, 4), 5, dtype), np.full((2, 3, 4), 5))):
        t = op.sync()
        assert t.dtype == npdt(dtype)
        np.testing.assert_array_equal(to_np(t).astype(np.float64), ref)
    e = api.empty((4, 4), dtype).sync()
    assert e.shape == (4, 4) and e.dtype == npdt(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_arange(dtype: str) -> None:
    np.testing.assert_array_equal(to_np(api.arange(3, 17, 2, dtype=dtype).sync()).astype(np.float64),
                                  np.arange(3, 17, 2).astype(np.float64))
    assert api.arange(5).sync().dtype == np.int64
    assert api.arange(0.0, 1.0, 0.25).sync().dtype == np.float32


@pytest.mark.parametrize("dtype", FLOATS)
def test_linspace_eye(dtype: str) -> None:
    tol = 1e-6 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(to_np(api.linspace(-1, 2, 13, dtype).sync()).astype(np.float64),
                               np.linspace(-1, 2, 13), atol=tol * 2)
    np.testing.assert_array_equal(to_np(api.eye(4, 6, dtype, k=1).sync()).astype(np.float64),
                                  np.eye(4, 6, k=1))


@pytest.mark.parametrize("dtype", FLOATS)
def test_rand_randn(dtype: str) -> None:
    u = to_np(api.rand((200, 50), dtype).sync()).astype(np.float64)
    assert u.min() >= 0 and u.max() <= 1 and 0.45 < u.mean() < 0.55
    n = to_np(api.randn((200, 50), dtype).sync()).astype(np.float64)
    assert abs(n.mean()) < 0.05 and 0.95 < n.std() < 1.05
    a = to_np(api.rand((8,), dtype, seed=3).sync())
    b = to_np(api.rand((8,), dtype, seed=3).sync())
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(to_np(api.rand((8,), dtype).sync()), to_np(api.rand((8,), dtype).sync()))


def test_rand_needs_float() -> None:
    with pytest.raises(deviceops.DTypeError, match="rand: needs a floating dtype"):
        api.rand((2,), "int32")


@pytest.mark.parametrize("dtype", DTYPES)
def test_from_host_dup_memcpy_to_host(dtype: str) -> None:
    rng = np.random.default_rng()
    host = (rng.standard_normal((5, 7)) * 10).astype(npdt(dtype))
    t = api.from_host(host).sync()
    assert t.dtype == npdt(dtype)
    np.testing.assert_array_equal(to_np(t), host)
    d = api.dup(t).sync()
    np.testing.assert_array_equal(to_np(d), host)
    z = api.zeros((5, 7), dtype).sync()
    api.memcpy(z, t).sync()
    np.testing.assert_array_equal(to_np(z), host)
    assert isinstance(api.to_host(t).sync(), np.ndarray)


def test_from_host_snapshots_at_enqueue() -> None:
    host = np.arange(4, dtype=np.float32)
    op = api.from_host(host)
    t = op.sync()
    host[:] = -1
    np.testing.assert_array_equal(to_np(t), [0, 1, 2, 3])


@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("dst", DTYPES)
def test_convert(src: str, dst: str) -> None:
    host = np.array([[0, 1.5, -2.25], [100, 3, 7]]).astype(npdt(src))
    out = api.convert(api.from_host(host).sync(), dst).sync()
    assert out.dtype == npdt(dst)
    np.testing.assert_array_equal(to_np(out), host.astype(npdt(dst)))


def test_errors_raise_before_launch() -> None:
    a = api.zeros((2, 3)).sync()
    b = api.zeros((3, 2)).sync()
    with pytest.raises(deviceops.ShapeError, match=r"memcpy: dst shape \(2, 3\) != src shape \(3, 2\)"):
        api.memcpy(a, b)
    with pytest.raises(ValueError):
        api.memcpy(a, b)
    c = api.zeros((2, 3), "int32").sync()
    with pytest.raises(deviceops.DTypeError, match=r"use api\.convert"):
        api.memcpy(a, c)
    with pytest.raises(TypeError):
        api.memcpy(a, c)
    with pytest.raises(deviceops.DTypeError, match="float64 is not supported"):
        api.zeros((2,), "float64")
    with pytest.raises(deviceops.ShapeError, match="negative"):
        api.zeros((-1, 2))


def test_tensor_views_share_hazards() -> None:
    t = api.arange(12, dtype="float32").sync()
    v = t.reshape(3, 4)
    assert v.shape == (3, 4) and v._storage is t._storage
    p = v.partition((2, 2))
    assert p.grid == (2, 2) and p.unpartition() is v
    with pytest.raises(deviceops.ShapeError, match="cannot view"):
        t.reshape(5, 5)
    with pytest.raises(deviceops.ShapeError, match="tile shape"):
        v.partition((2,))


def test_dlpack_roundtrip_numpy_or_cupy(dev: deviceops.Device) -> None:
    t = api.arange(6, dtype="float32").sync()
    back = deviceops.Tensor.from_dlpack(t)
    assert back.device is dev
    np.testing.assert_array_equal(to_np(back), np.arange(6))
    if dev.is_cpu:
        arr = np.from_dlpack(t)
    else:
        import cupy

        arr = cupy.from_dlpack(t).get()
        assert t.__cuda_array_interface__["shape"] == (6,)
        c = cupy.arange(5, dtype=cupy.float32)
        w = deviceops.Tensor(c)
        np.testing.assert_array_equal(to_np(w), np.arange(5))
        wc = cupy.asarray(w)  # via __cuda_array_interface__
        assert int(wc.data.ptr) == int(c.data.ptr)
    np.testing.assert_array_equal(arr, np.arange(6))


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_dlpack_roundtrip_torch(dev: deviceops.Device) -> None:
    import torch

    t = api.arange(6, dtype="float32").sync()
    if dev.is_cpu:
        tt = torch.from_dlpack(t)
        assert tt.tolist() == [0, 1, 2, 3, 4, 5]
        src = torch.arange(4, dtype=torch.float32)
    else:
        tt = torch.from_dlpack(t)
        assert tt.is_cuda and tt.cpu().tolist() == [0, 1, 2, 3, 4, 5]
        src = torch.arange(4, dtype=torch.float32, device="cuda")
        torch.cuda.synchronize()
    back = deviceops.Tensor.from_dlpack(src)
    np.testing.assert_array_equal(to_np(back), [0, 1, 2, 3])


def test_from_host_keeps_zero_dim_shape(stream: deviceops.Stream) -> None:
    t = api.from_host(np.float32(3.5)).sync_on(stream)
    assert t.shape == ()
    assert float(to_np(t)) == 3.5


def test_from_host_on_the_cpu_backend_is_a_private_snapshot() -> None:
    # (the cpu backend keeps the snapshot as the tensor's memory: it must still be a copy of
    # the caller's array, of the asked dtype, and refused inside a capture like any allocation)
    s = deviceops.device("cpu").new_stream()
    a = np.arange(6, dtype=np.float64).reshape(2, 3)
    t = api.from_host(a, "float32").sync_on(s)
    assert t.dtype == np.float32 and not np.shares_memory(t.array, a)
    a[0, 0] = 99.0
    assert float(api.to_host(t).sync_on(s)[0, 0]) == 0.0
    with pytest.raises(deviceops.CaptureError):
        api.from_host(a, "float32").graph_on(s)


def test_from_host_without_copy_uses_a_read_only_map_in_place(tmp_path: Any) -> None:
    # copy=False on the cpu backend: a C-contiguous array of the tensor's dtype is the
    # tensor's memory (a memory map stays a map); another dtype or layout is copied as usual
    s = deviceops.device("cpu").new_stream()
    np.save(tmp_path / "w.npy", np.arange(12, dtype=np.float32).reshape(3, 4))
    m = np.load(tmp_path / "w.npy", mmap_mode="r")
    t = api.from_host(m, "float32", copy=False).sync_on(s)
    assert np.shares_memory(t.array, m) and type(t.array) is np.ndarray
    np.testing.assert_array_equal(to_np(api.dup(t).sync_on(s)), np.arange(12).reshape(3, 4))
    assert not np.shares_memory(api.from_host(m, "float16", copy=False).sync_on(s).array, m)
    assert not np.shares_memory(api.from_host(m.T, "float32", copy=False).sync_on(s).array, m)
    assert not np.shares_memory(api.from_host(m, "float32").sync_on(s).array, m)
