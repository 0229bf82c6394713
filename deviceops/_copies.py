"""Copying DeviceOps of ``deviceops.api``: ``from_host``, ``dup``, ``convert``,
``memcpy``, ``to_host``, ``to_device``.

Each validates its arguments at once and returns a lazy DeviceOp; the copy is
enqueued on the stream the op is executed on (``to_device``: on a transfer stream
of the destination device when that is another device). ``deviceops.api``
re-exports them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _hooks
from ._api_op import _ApiOp, _produce, _tensor_arg, _tensor_or_op, _with_arg
from ._context import ExecutionContext
from ._device import Device
from ._device import device as _device
from ._dtypes import bfloat16, normalize_dtype
from ._errors import CaptureError, DTypeError, ShapeError
from ._launch import launch
from ._op import DeviceOp
from ._tensor import Tensor, adopt_host, allocate, check_device

__all__ = ["convert", "dup", "from_host", "memcpy", "to_device", "to_host"]


def from_host(array: Any, dtype: Any = None, *, copy: bool = True) -> DeviceOp[Tensor]:
    """A device tensor holding a copy of a host (NumPy-convertible) array.

    The host data is snapshotted when the op is enqueued, so later changes to
    ``array`` do not leak in.

    ``copy=False``: the caller promises ``array`` never changes while the tensor lives (a
    read-only memory map of a file written once: the weight cache's). On the cpu backend a
    C-contiguous array of the tensor's dtype then becomes the tensor's memory as it is
    (no copy: a memory-mapped file's pages are read when first used); anything else, and
    every other backend, copies as with ``copy=True``.
    """
    if isinstance(array, Tensor | DeviceOp):
        raise TypeError(f"from_host: array is a {type(array).__name__}, not host data; use "
                        "api.dup(t) to copy a tensor, or api.to_device(t, device) to move it")
    try:
        host = np.asarray(array)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"from_host: cannot make a NumPy array of {type(array).__name__}: {exc}; "
                        "pass a NumPy array or a (rectangular) nested list of numbers") from exc
    if dtype is None and host.dtype.kind not in "fiuV" and host.dtype != bfloat16:
        raise DTypeError(f"from_host: host data of dtype {host.dtype} is not numbers; pass "
                         "numbers, or give dtype=", op="from_host")
    dt = normalize_dtype(host.dtype if dtype is None else dtype, op="from_host")

    def run(ctx: ExecutionContext) -> Tensor:
        if (not copy and ctx.stream.backend.host_resident and host.dtype == dt
                and host.flags.c_contiguous and host.ndim):
            ct = adopt_host(ctx.stream, host.view(np.ndarray), "from_host")  # no memmap subclass
            launch(ctx, "from_host", (), (ct,), _nothing, _nothing_cuda)
            return ct
        snap = np.array(host, dtype=dt, order="C", copy=True)  # keeps 0-d shapes (ascontiguousarray makes them 1-d)
        if ctx.stream.backend.host_resident:
            # the snapshot is the tensor's memory: one host copy, not two (weights loading)
            ct = adopt_host(ctx.stream, snap, "from_host")
            launch(ctx, "from_host", (), (ct,), _nothing, _nothing_cuda)
            return ct
        t = allocate(ctx.stream, snap.shape, dt, "from_host")
        a = t.array
        upload = ctx.stream.backend.upload

        def cpu() -> None:
            a[...] = snap

        def cuda(s: Any) -> None:
            upload(a, snap, s)

        launch(ctx, "from_host", (), (t,), cpu, cuda)
        return t

    return _ApiOp("from_host", run)


def _nothing() -> None:
    """(the cpu half of an adopted snapshot's launch: the data is already there)"""


def _nothing_cuda(native: Any) -> None:
    raise RuntimeError("from_host: an adopted host snapshot has no CUDA half")


def dup(t: Tensor | DeviceOp[Tensor]) -> DeviceOp[Tensor]:
    """A new tensor with a copy of ``t``'s data (``t``: a Tensor or a DeviceOp producing one)."""
    arg = _tensor_or_op(t, "dup")

    def run(ctx: ExecutionContext, src: Tensor) -> Tensor:
        check_device(src, ctx.stream, "dup")
        s = src.array

        def make(xp: Any, a: Any) -> None:
            a[...] = s

        return _produce(ctx, "dup", src.shape, src.dtype, make, reads=(src,))

    return _with_arg("dup", arg, run)


def convert(t: Tensor | DeviceOp[Tensor], dtype: Any) -> DeviceOp[Tensor]:
    """A new tensor with ``t``'s values converted to ``dtype`` (``t``: a Tensor or a DeviceOp producing one)."""
    dt = normalize_dtype(dtype, op="convert")
    arg = _tensor_or_op(t, "convert")

    def run(ctx: ExecutionContext, src: Tensor) -> Tensor:
        check_device(src, ctx.stream, "convert")
        s = src.array

        def make(xp: Any, a: Any) -> None:
            a[...] = s.astype(dt)

        return _produce(ctx, "convert", src.shape, dt, make, reads=(src,))

    return _with_arg("convert", arg, run)


def _memcpy_check(d: Tensor, s: Tensor) -> None:
    if d.shape != s.shape:
        raise ShapeError(f"memcpy: dst shape {d.shape} != src shape {s.shape}", op="memcpy")
    if d.dtype != s.dtype:
        raise DTypeError(f"memcpy: dst dtype {d.dtype} != src dtype {s.dtype}; use api.convert", op="memcpy")


def memcpy(dst: Tensor, src: Tensor | DeviceOp[Tensor]) -> DeviceOp[Tensor]:
    """Overwrite ``dst`` with ``src`` (same shape and dtype); produces ``dst``.

    Allocates nothing, so it may be captured into a graph; it is how
    ``CudaGraph.update`` refreshes captured inputs. ``src`` may be a DeviceOp
    producing a tensor (it runs first, on the same stream). Given a tensor ``src``, the
    copy runs on its device under every policy (as :func:`to_host`).
    """
    if not isinstance(dst, Tensor) and isinstance(src, DeviceOp):
        src._consume()  # the error below is the report
    d = _tensor_arg(dst, "memcpy", "dst")
    src_arg = _tensor_or_op(src, "memcpy", "src")
    if isinstance(src_arg, Tensor):
        _memcpy_check(d, src_arg)

    def run(ctx: ExecutionContext, s: Tensor) -> Tensor:
        if src_arg is not s:
            _memcpy_check(d, s)
        check_device(d, ctx.stream, "memcpy")
        check_device(s, ctx.stream, "memcpy")
        da, sa = d.array, s.array
        copy = ctx.stream.backend.copy

        def cpu() -> None:
            np.copyto(da, sa)

        def cuda(native: Any) -> None:
            copy(da, sa, native)

        launch(ctx, "memcpy", (s,), (d,), cpu, cuda)
        return d

    op = _with_arg("memcpy", src_arg, run)
    assert isinstance(op, _ApiOp)
    op._tensors = (d, *op._tensors)
    if isinstance(src_arg, Tensor):  # a copy out of a tensor runs on its device
        op._src = src_arg.device
    return op


def to_host(t: Tensor | DeviceOp[Tensor]) -> DeviceOp[np.ndarray]:
    """A NumPy copy of ``t`` (page-locked on cuda, copied without blocking the host).

    A tensor's copy runs on a stream of the tensor's device under every policy (the
    policy's stream when it is there, else one of the policy's streams of that device,
    else the device's own stream), ordered after the tensor's writer: ``t.to_host().sync()``
    works wherever ``t`` lives. ``t`` may be a DeviceOp producing a tensor: it runs first,
    on the same stream (the policy's).
    """
    arg = _tensor_or_op(t, "to_host")

    def run(ctx: ExecutionContext, src: Tensor) -> np.ndarray:
        check_device(src, ctx.stream, "to_host")
        s = src.array
        if ctx.stream.capture is not None:  # both backends: host memory is allocated per call
            raise CaptureError("to_host allocates host memory inside a graph capture; "
                               "copy into a preallocated tensor with api.memcpy instead", op="to_host")
        backend = ctx.stream.backend
        out = backend.host_empty(src.shape, src.dtype)  # cuda: page-locked
        download = backend.download

        def cpu() -> None:
            np.copyto(out, s)

        def cuda(native: Any) -> None:
            download(s, out, native)

        launch(ctx, "to_host", (src,), (), cpu, cuda)
        return out

    op = _with_arg("to_host", arg, run)
    if isinstance(arg, Tensor):  # it runs on the tensor's device under every policy
        assert isinstance(op, _ApiOp)
        op._src = arg.device
    return op


_transfer_streams: dict[str, Any] = {}


def to_device(t: Tensor, device: Device | int | str) -> DeviceOp[Tensor]:
    """A copy of ``t`` on ``device`` (explicit cross-device transfer).

    Runs on the executing stream when it is on ``device``, else on a transfer
    stream of ``device`` joined back with events. Crossing between the cpu
    backend and CUDA synchronizes the source's last writer on the host first.
    """
    src = _tensor_arg(t, "to_device")
    if not isinstance(device, Device | int | str) or isinstance(device, bool):
        raise TypeError(f"to_device: device must be a Device, an int or a str such as 'cpu' or "
                        f"'cuda:0', got {type(device).__name__} {device!r}")
    dev = _device(device)

    def run(ctx: ExecutionContext) -> Tensor:
        home = ctx.stream
        if home.device is dev:
            stream = home
        else:
            key = str(dev)
            if key not in _transfer_streams:
                _transfer_streams[key] = dev.new_stream()
            stream = _transfer_streams[key]
            if stream.backend is home.backend:  # events order streams of one backend
                stream.wait_event(home.record_event())
            else:
                home.synchronize()
        w = src._storage.write
        if w is not None and w[0].backend is not dev.backend:
            w[0].synchronize()
        tctx = ctx if stream is home else ctx.on(stream)
        out = allocate(stream, src.shape, src.dtype, "to_device")
        sa, oa = src.array, out.array
        src_be, dst_be = src.device.backend, dev.backend
        same_backend = src_be is dst_be

        def cpu() -> None:  # the destination is host memory: the source as NumPy, copied
            np.copyto(oa, src_be.to_numpy(sa))

        def cuda(native: Any) -> None:
            if same_backend:
                dst_be.copy_peer(oa, dev, sa, src.device, native)
            else:  # from host memory
                dst_be.upload(oa, sa, native)

        reads = (src,) if same_backend else ()
        launch(tctx, "to_device", reads, (out,), cpu, cuda)
        if stream is not home:
            if stream.backend is home.backend:
                home.wait_event(stream.record_event())
            else:
                stream.synchronize()
        return out

    return _ApiOp("to_device", run, on=dev)


_hooks.install(to_host=to_host)  # Tensor.to_host()
