"""Allocation on a GPU: spare arrays are reused on their stream only when unreferenced."""

from __future__ import annotations

import numpy as np
import pytest

import deviceops
from deviceops import api, kernels
from deviceops._tensor import allocate

pytestmark = pytest.mark.gpu
F32 = np.dtype("float32")


def _ptr(t: deviceops.Tensor) -> int:
    return int(t.array.data.ptr)


def test_a_dropped_allocation_is_handed_out_again_on_its_stream() -> None:
    s = deviceops.device(0).new_stream()
    t = allocate(s, (1000,), F32, "t")
    p = _ptr(t)
    del t
    assert _ptr(allocate(s, (1000,), F32, "t")) == p


def test_not_while_the_user_holds_the_array_or_a_view() -> None:
    s = deviceops.device(0).new_stream()
    t = allocate(s, (1000,), F32, "t")
    p, arr = _ptr(t), t.array
    del t
    u = allocate(s, (1000,), F32, "t")
    assert _ptr(u) != p and int(arr.data.ptr) == p
    v = u.reshape(10, 100)
    pu = _ptr(u)
    del u
    assert _ptr(allocate(s, (1000,), F32, "t")) != pu and _ptr(v) == pu


def test_not_on_another_stream() -> None:
    dev = deviceops.device(0)
    s1, s2 = dev.new_stream(), dev.new_stream()
    t = allocate(s1, (1000,), F32, "t")
    p = _ptr(t)
    del t
    assert _ptr(allocate(s2, (1000,), F32, "t")) != p


def test_allocating_ops_stay_correct_with_reuse() -> None:
    s = deviceops.device(0).new_stream()
    x = api.from_host(np.arange(4096, dtype=np.float32)).sync_on(s)
    kept = []
    for i in range(50):
        y = kernels.add(x, x).async_on(s)
        z = kernels.mul(y, x).async_on(s)  # y dies after this op: its array is spare
        if i % 7 == 0:
            kept.append(z)
    for z in kept:
        np.testing.assert_array_equal(api.to_host(z).sync_on(s),
                                      2.0 * np.arange(4096, dtype=np.float32) ** 2)


def test_elementwise_memo_holds_no_user_tensor() -> None:
    """The elementwise last-launch plans (one per kernel and device) keep pointers and the packed
    launch, never a storage: dropping the output frees it (issue 12 item 4)."""
    import gc
    import weakref

    s = deviceops.device(0).new_stream()
    x = api.ones((1024,)).sync_on(s)
    for form in ("flat", "partition"):
        z = api.zeros((1024,)).sync_on(s)
        arg = z if form == "flat" else z.partition((256,))
        for _ in range(3):  # the 2nd and 3rd calls take the memo path
            kernels.saxpy(arg, 1.0, x).sync_on(s)
        np.testing.assert_array_equal(api.to_host(z).sync_on(s), 3.0)
        ref = weakref.ref(z._storage)
        del z, arg
        gc.collect()
        assert ref() is None, f"{form}: the memo keeps the output alive"
