"""saxpy / add / mul against NumPy on odd shapes, every dtype, every argument form."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import deviceops
from deviceops import api, kernels

from .conftest import to_np

DTYPES = ["float32", "float16", "bfloat16", "int32", "int64"]
SHAPES = [(1,), (7,), (1023,), (1025,), (3, 5), (17, 129), (2, 3, 37), (4099,)]


def npdt(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def rand(shape: tuple[int, ...], dtype: str, rng: np.random.Generator) -> np.ndarray:
    if dtype.startswith("int"):
        return rng.integers(-1000, 1000, shape).astype(dtype)
    return rng.standard_normal(shape).astype(npdt(dtype))


def tol(dtype: str) -> float:
    return {"float32": 1e-6, "float16": 2e-3, "bfloat16": 1.6e-2}.get(dtype, 0.0)


def check(got: np.ndarray, ref: np.ndarray, dtype: str) -> None:
    g, r = got.astype(np.float64), ref.astype(np.float64)
    assert not np.isnan(g).any()
    if tol(dtype) == 0:
        np.testing.assert_array_equal(g, r)
    else:
        np.testing.assert_allclose(g, r, rtol=tol(dtype), atol=tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_saxpy(shape: tuple[int, ...], dtype: str) -> None:
    rng = np.random.default_rng()
    zh, xh = rand(shape, dtype, rng), rand(shape, dtype, rng)
    a = 1.75
    z = api.from_host(zh).sync()
    x = api.from_host(xh).sync()
    out = kernels.saxpy(z, a, x).sync()
    assert out is z
    if dtype.startswith("int"):
        ref = (np.float64(np.float32(a)) * xh.astype(np.float64) + zh).astype(dtype)
    else:
        ref = np.float32(a) * xh.astype(np.float32) + zh.astype(np.float32)
    check(to_np(z), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["add", "mul"])
def test_add_mul(name: str, dtype: str) -> None:
    rng = np.random.default_rng()
    for shape in SHAPES:
        xh, yh = rand(shape, dtype, rng), rand(shape, dtype, rng)
        x, y = api.from_host(xh).sync(), api.from_host(yh).sync()
        fn = getattr(kernels, name)
        out = fn(x, y).sync()
        ref = (xh.astype(np.float64) + yh.astype(np.float64)) if name == "add" else (
            xh.astype(np.float64) * yh.astype(np.float64))
        check(to_np(out), ref if dtype.startswith("int") else ref.astype(npdt(dtype)), dtype)
        # out= given, poisoned first
        o = api.full(shape, -12345, dtype).sync()
        assert fn(x, y, out=o).sync() is o
        check(to_np(o), ref if dtype.startswith("int") else ref.astype(npdt(dtype)), dtype)


def test_saxpy_issue_example_verbatim() -> None:
    stream = deviceops.default_device().new_stream()
    z = api.zeros((16, 16)).sync_on(stream)
    x = api.ones((16, 16)).sync_on(stream)
    kernels.saxpy(z.partition((4, 4)), 2.0, x).sync_on(stream)   # z is now all 2.0
    np.testing.assert_array_equal(to_np(z), np.full((16, 16), 2.0, np.float32))


@pytest.mark.parametrize("tile", [(4, 4), (1, 7), (16, 1), (5, 3), (33, 65)])
def test_partition_sets_grid_and_covers_everything(tile: tuple[int, int]) -> None:
    z = api.full((37, 61), -1.0).sync()
    x = api.ones((37, 61)).sync()
    p = z.partition(tile)
    assert p.grid == (-(-37 // tile[0]), -(-61 // tile[1]))
    out = kernels.saxpy(p, 3.0, x).sync()
    assert out is p
    np.testing.assert_array_equal(to_np(z), 2.0)


def test_deviceop_arguments_run_first_and_form_is_kept(stream: deviceops.Stream) -> None:
    out = kernels.saxpy(api.zeros((8, 8)), 2.0, api.ones((8, 8))).sync_on(stream)
    assert isinstance(out, deviceops.Tensor)
    np.testing.assert_array_equal(to_np(out), 2.0)
    part = kernels.saxpy(api.zeros((8, 8)).map(lambda t: t.partition((2, 4))), 1.0,
                         api.ones((8, 8))).sync_on(stream)
    assert isinstance(part, deviceops.Partition) and part.grid == (4, 2)
    s = kernels.add(api.ones((3,)), api.ones((3,)), out=api.zeros((3,))).sync_on(stream)
    np.testing.assert_array_equal(to_np(s), 2.0)


def test_mismatch_raises_before_launch() -> None:
    a = api.zeros((4, 4)).sync()
    b = api.zeros((4, 5)).sync()
    c = api.zeros((4, 4), "float16").sync()
    with pytest.raises(deviceops.ShapeError, match=r"saxpy: z shape \(4, 4\) != x shape \(4, 5\)"):
        kernels.saxpy(a, 1.0, b)
    with pytest.raises(deviceops.DTypeError, match="add: x dtype float32 != y dtype float16"):
        kernels.add(a, c)
    with pytest.raises(deviceops.ShapeError, match="out shape"):
        kernels.mul(a, a, out=b)
    with pytest.raises(deviceops.ShapeError, match="not C-contiguous"):
        kernels.add(deviceops.Tensor(a.array.T), deviceops.Tensor(a.array.T))
    # deferred arguments are checked at execution, before the kernel launches
    op = kernels.add(api.zeros((2,)), api.zeros((3,)))
    with pytest.raises(deviceops.ShapeError, match=r"\(2,\) != y shape \(3,\)"):
        op.sync()


def test_wrong_device_is_refused() -> None:
    if not deviceops.cuda_available():
        pytest.skip("needs a CUDA GPU to have two backends")
    cpu_t = api.ones((4,)).sync_on(deviceops.device("cpu").new_stream())
    with pytest.raises(deviceops.DeviceError, match=r"api\.to_device"):
        kernels.add(cpu_t, cpu_t).sync_on(deviceops.device(0).new_stream())


def test_repeated_launches_reuse_plan_and_stay_correct(stream: deviceops.Stream) -> None:
    """The launch-plan memo: identical repeats are correct; new tensors never hit a stale plan."""
    rng = np.random.default_rng()
    for _ in range(3):
        zh = rng.integers(-50, 50, 513).astype(np.float32)
        xh = rng.integers(-3, 3, 513).astype(np.float32)
        z = api.from_host(zh).sync_on(stream)
        x = api.from_host(xh).sync_on(stream)
        for _ in range(7):
            kernels.saxpy(z, 2.0, x).async_on(stream)
        kernels.saxpy(z, -1.0, x).async_on(stream)  # a different scalar: a different plan
        np.testing.assert_array_equal(to_np(z), zh + 13.0 * xh)
        out = api.empty((513,)).sync_on(stream)
        for _ in range(2):
            kernels.add(z, x, out=out).async_on(stream)
        np.testing.assert_array_equal(to_np(out), zh + 14.0 * xh)
        # the partition form (the README's idiom) is memoized with its tiling
        for tile in ((128,), (128,), (256,), (100,)):
            zp = kernels.saxpy(z.partition(tile), 1.0, x).async_on(stream)
            assert isinstance(zp, deviceops.Partition) and zp.tile_shape == tile
        kernels.saxpy(z, 1.0, x).async_on(stream)  # the plain form after the tiled ones
        np.testing.assert_array_equal(to_np(z), zh + 18.0 * xh)
        for tile in ((64,), (64,), (512,)):
            kernels.add(z, x, out=out.partition(tile)).async_on(stream)
        np.testing.assert_array_equal(to_np(out), zh + 19.0 * xh)
        # allocating add/mul repeated on the same inputs (the allocation memo): fresh outputs
        outs = [kernels.add(z, x).async_on(stream) for _ in range(3)]
        outs += [kernels.mul(z, x).async_on(stream) for _ in range(2)]
        assert len({id(o) for o in outs}) == 5
        for o in outs[:3]:
            np.testing.assert_array_equal(to_np(o), zh + 19.0 * xh)
        for o in outs[3:]:
            np.testing.assert_array_equal(to_np(o), (zh + 18.0 * xh) * xh)
        del z, x, out  # the next round's tensors may reuse these ids
