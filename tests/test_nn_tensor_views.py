"""Tensor views along the leading dim (``t[i]``, ``t[a:b]``), which deviceops.nn uses for
cache rows and per-row state: shared storage, hazard tracking across streams, errors."""

from __future__ import annotations

import numpy as np
import pytest

import deviceops
from deviceops import api, kernels

from .conftest import to_np


def test_views_share_storage(stream: deviceops.Stream) -> None:
    t = api.from_host(np.arange(24, dtype=np.float32).reshape(4, 6)).sync_on(stream)
    row, rows, tail = t[2], t[1:3], t[-1]
    assert row.shape == (6,) and rows.shape == (2, 6) and tail.shape == (6,)
    assert rows.is_contiguous and t[3:1].shape == (0, 6) and t[:].shape == (4, 6)
    kernels.add(rows, rows, out=rows).sync_on(stream)  # rows 1, 2 doubled in place
    want = np.arange(24, dtype=np.float32).reshape(4, 6)
    want[1:3] *= 2
    np.testing.assert_array_equal(to_np(t), want)
    np.testing.assert_array_equal(to_np(row), want[2])
    assert t[1:3][0].shape == (6,)  # views of views


def test_view_writes_are_ordered_across_streams(dev: deviceops.Device) -> None:
    """A view written on one stream, the whole tensor read on another: the read waits."""
    a, b = dev.new_stream(), dev.new_stream()
    t = api.zeros((3, 4096)).sync_on(a)
    big = api.ones((3, 4096)).sync_on(a)
    for _ in range(3):  # queue work on stream a, then write row 1 last
        kernels.add(big, big, out=big).async_on(a)
    api.memcpy(t[1], big[1]).async_on(a)
    got = api.to_host(t).sync_on(b)
    np.testing.assert_array_equal(got[1], np.full(4096, 8.0, np.float32))
    np.testing.assert_array_equal(got[0], 0.0)


def test_view_errors(stream: deviceops.Stream) -> None:
    t = api.zeros((4, 2)).sync_on(stream)
    with pytest.raises(TypeError, match="step"):
        t[::2]
    with pytest.raises(TypeError, match="not supported"):
        t[0, 1]  # type: ignore[index]
    with pytest.raises(IndexError, match="out of range"):
        t[4]
    with pytest.raises(TypeError, match="0-d"):
        api.zeros(()).sync_on(stream)[0]
