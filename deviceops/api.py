"""Tensor-creating and copying DeviceOps.

Every function validates its arguments at once (raising ``ShapeError`` /
``DTypeError`` before anything is launched) and returns a lazy
:class:`~deviceops.DeviceOp`. The op runs on the stream it is executed on and
produces its tensor on that stream's device.

| function                          | produces                                  |
|-----------------------------------|-------------------------------------------|
| ``zeros/ones/full/empty(shape)``  | a new tensor                              |
| ``arange``, ``linspace``, ``eye`` | ranges and identity, as NumPy's           |
| ``rand``, ``randn``               | uniform [0, 1) / standard normal          |
| ``from_host(array)``              | a device copy of a host array             |
| ``dup(t)``, ``convert(t, dtype)`` | a copy, a dtype conversion                |
| ``memcpy(dst, src)``              | ``dst`` overwritten with ``src``          |
| ``to_host(t)``                    | a NumPy array                             |
| ``to_device(t, device)``          | a copy on another device                  |

Example:
    >>> x = api.arange(6, dtype="float32").map(lambda t: t.reshape(2, 3)).sync()
    >>> api.to_host(x).sync().tolist()
    [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._context import ExecutionContext
from ._device import Device
from ._device import device as _device
from ._dtypes import float32, is_floating, normalize_dtype
from ._errors import DTypeError, ShapeError
from ._launch import launch
from ._op import DeviceOp
from ._tensor import Tensor, allocate, check_device, normalize_shape

__all__ = [
    "arange",
    "convert",
    "dup",
    "empty",
    "eye",
    "from_host",
    "full",
    "linspace",
    "memcpy",
    "ones",
    "rand",
    "randn",
    "to_device",
    "to_host",
    "zeros",
]

Shape = int | Sequence[int]


class _ApiOp(DeviceOp[Any]):
    """A DeviceOp whose work is one function of the execution context."""

    __slots__ = ("_fn", "_name")

    def __init__(self, name: str, fn: Callable[[ExecutionContext], Any]) -> None:
        super().__init__()
        self._name = name
        self._fn = fn

    def _execute(self, ctx: ExecutionContext) -> Any:
        return self._fn(ctx)

    def _describe(self) -> str:
        return self._name


def _on(native: Any, fn: Callable[[], None]) -> None:
    with native:
        fn()


def _produce(ctx: ExecutionContext, name: str, shape: tuple[int, ...], dt: np.dtype[Any],
             make: Callable[[Any, Any], None], reads: Sequence[Tensor] = ()) -> Tensor:
    """Allocate a tensor and enqueue ``make(xp, out_array)`` to fill it."""
    t = allocate(ctx.stream, shape, dt, name)
    a = t.array
    xp = ctx.device.xp
    launch(ctx, name, reads, (t,), lambda: make(xp, a), lambda s: _on(s, lambda: make(xp, a)))
    return t


def empty(shape: Shape, dtype: Any = float32) -> DeviceOp[Tensor]:
    """A new tensor with unspecified contents (allocation only)."""
    shp, dt = normalize_shape(shape, "empty"), normalize_dtype(dtype, op="empty")
    return _ApiOp("empty", lambda ctx: allocate(ctx.stream, shp, dt, "empty"))


def full(shape: Shape, fill_value: float | int, dtype: Any = float32) -> DeviceOp[Tensor]:
    """A new tensor filled with ``fill_value``."""
    shp, dt = normalize_shape(shape, "full"), normalize_dtype(dtype, op="full")
    v = fill_value

    def make(xp: Any, a: Any) -> None:
        a.fill(v)

    return _ApiOp("full", lambda ctx: _produce(ctx, "full", shp, dt, make))


def zeros(shape: Shape, dtype: Any = float32) -> DeviceOp[Tensor]:
    """A new tensor of zeros."""
    op = full(shape, 0, dtype)
    op._name = "zeros"  # type: ignore[attr-defined]
    return op


def ones(shape: Shape, dtype: Any = float32) -> DeviceOp[Tensor]:
    """A new tensor of ones."""
    op = full(shape, 1, dtype)
    op._name = "ones"  # type: ignore[attr-defined]
    return op


def arange(start: float, stop: float | None = None, step: float = 1, dtype: Any = None) -> DeviceOp[Tensor]:
    """Evenly spaced values in ``[start, stop)``, as :func:`numpy.arange`."""
    if stop is None:
        start, stop = 0, start
    if step == 0:
        raise ShapeError("arange: step must not be zero", op="arange")
    n = max(0, math.ceil((stop - start) / step))
    if dtype is None:
        dtype = "int64" if all(float(x).is_integer() and isinstance(x, int) for x in (start, stop, step)) else float32
    dt = normalize_dtype(dtype, op="arange")
    s0, st = start, step

    def make(xp: Any, a: Any) -> None:
        a[...] = (s0 + st * xp.arange(n, dtype=np.float64)).astype(dt)

    return _ApiOp("arange", lambda ctx: _produce(ctx, "arange", (n,), dt, make))


def linspace(start: float, stop: float, num: int = 50, dtype: Any = float32, *, endpoint: bool = True) -> DeviceOp[Tensor]:
    """``num`` evenly spaced values from ``start`` to ``stop``, as :func:`numpy.linspace`."""
    if num < 0:
        raise ShapeError(f"linspace: num must be >= 0, got {num}", op="linspace")
    dt = normalize_dtype(dtype, op="linspace")

    def make(xp: Any, a: Any) -> None:
        a[...] = xp.linspace(start, stop, num, endpoint=endpoint, dtype=np.float64).astype(dt)

    return _ApiOp("linspace", lambda ctx: _produce(ctx, "linspace", (num,), dt, make))


def eye(n: int, m: int | None = None, dtype: Any = float32, *, k: int = 0) -> DeviceOp[Tensor]:
    """A 2-D tensor with ones on diagonal ``k``, as :func:`numpy.eye`."""
    m = n if m is None else m
    shp = normalize_shape((n, m), "eye")
    dt = normalize_dtype(dtype, op="eye")

    def make(xp: Any, a: Any) -> None:
        a[...] = xp.eye(n, m, k=k, dtype=np.float64).astype(dt)

    return _ApiOp("eye", lambda ctx: _produce(ctx, "eye", shp, dt, make))


_seed_lock = threading.Lock()
_seeds = np.random.SeedSequence()


def _fresh_seed() -> int:
    with _seed_lock:
        return int(_seeds.spawn(1)[0].generate_state(1)[0])


def _random(name: str, shape: Shape, dtype: Any, seed: int | None, normal: bool) -> DeviceOp[Tensor]:
    shp, dt = normalize_shape(shape, name), normalize_dtype(dtype, op=name)
    if not is_floating(dt):
        raise DTypeError(f"{name}: needs a floating dtype, got {dt}", op=name)
    sd = _fresh_seed() if seed is None else seed

    def make(xp: Any, a: Any) -> None:
        rng = xp.random.default_rng(sd)
        vals = rng.standard_normal(shp, dtype=np.float32) if normal else rng.random(shp, dtype=np.float32)
        a[...] = vals.astype(dt)

    return _ApiOp(name, lambda ctx: _produce(ctx, name, shp, dt, make))


def rand(shape: Shape, dtype: Any = float32, *, seed: int | None = None) -> DeviceOp[Tensor]:
    """Uniform random values in ``[0, 1)`` (fresh seed each call unless ``seed`` given)."""
    return _random("rand", shape, dtype, seed, normal=False)


def randn(shape: Shape, dtype: Any = float32, *, seed: int | None = None) -> DeviceOp[Tensor]:
    """Standard-normal random values (fresh seed each call unless ``seed`` given)."""
    return _random("randn", shape, dtype, seed, normal=True)


def from_host(array: Any, dtype: Any = None) -> DeviceOp[Tensor]:
    """A device tensor holding a copy of a host (NumPy-convertible) array.

    The host data is snapshotted when the op is enqueued, so later changes to
    ``array`` do not leak in.
    """
    host = np.asarray(array)
    dt = normalize_dtype(host.dtype if dtype is None else dtype, op="from_host")

    def run(ctx: ExecutionContext) -> Tensor:
        snap = np.array(host, dtype=dt, order="C", copy=True)  # keeps 0-d shapes (ascontiguousarray makes them 1-d)
        t = allocate(ctx.stream, snap.shape, dt, "from_host")
        a = t.array

        def cpu() -> None:
            a[...] = snap

        def cuda(s: Any) -> None:
            a.set(snap, stream=s)

        launch(ctx, "from_host", (), (t,), cpu, cuda)
        return t

    return _ApiOp("from_host", run)


def _tensor_arg(x: Any, op: str) -> Tensor:
    if isinstance(x, Tensor):
        return x
    raise TypeError(f"{op}: expected a Tensor, got {type(x).__name__}")


def _tensor_or_op(x: Any, op: str) -> Tensor | DeviceOp[Tensor]:
    """A Tensor, or a DeviceOp producing one (adopted: it runs first, on the same stream)."""
    if isinstance(x, Tensor):
        return x
    if isinstance(x, DeviceOp):
        return x._adopt()
    raise TypeError(f"{op}: expected a Tensor or a DeviceOp producing one, got {type(x).__name__}")


def _resolved(x: Tensor | DeviceOp[Tensor], ctx: ExecutionContext, op: str) -> Tensor:
    t = x._exec(ctx) if isinstance(x, DeviceOp) else x
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: the DeviceOp argument produced {type(t).__name__}, not a Tensor")
    return t


def dup(t: Tensor | DeviceOp[Tensor]) -> DeviceOp[Tensor]:
    """A new tensor with a copy of ``t``'s data (``t``: a Tensor or a DeviceOp producing one)."""
    arg = _tensor_or_op(t, "dup")

    def run(ctx: ExecutionContext) -> Tensor:
        src = _resolved(arg, ctx, "dup")
        check_device(src, ctx.stream, "dup")
        s = src.array

        def make(xp: Any, a: Any) -> None:
            a[...] = s

        return _produce(ctx, "dup", src.shape, src.dtype, make, reads=(src,))

    return _ApiOp("dup", run)


def convert(t: Tensor | DeviceOp[Tensor], dtype: Any) -> DeviceOp[Tensor]:
    """A new tensor with ``t``'s values converted to ``dtype`` (``t``: a Tensor or a DeviceOp producing one)."""
    dt = normalize_dtype(dtype, op="convert")
    arg = _tensor_or_op(t, "convert")

    def run(ctx: ExecutionContext) -> Tensor:
        src = _resolved(arg, ctx, "convert")
        check_device(src, ctx.stream, "convert")
        s = src.array

        def make(xp: Any, a: Any) -> None:
            a[...] = s.astype(dt)

        return _produce(ctx, "convert", src.shape, dt, make, reads=(src,))

    return _ApiOp("convert", run)


def _memcpy_check(d: Tensor, s: Tensor) -> None:
    if d.shape != s.shape:
        raise ShapeError(f"memcpy: dst shape {d.shape} != src shape {s.shape}", op="memcpy")
    if d.dtype != s.dtype:
        raise DTypeError(f"memcpy: dst dtype {d.dtype} != src dtype {s.dtype}; use api.convert", op="memcpy")


def memcpy(dst: Tensor, src: Tensor | DeviceOp[Tensor]) -> DeviceOp[Tensor]:
    """Overwrite ``dst`` with ``src`` (same shape and dtype); produces ``dst``.

    Allocates nothing, so it may be captured into a graph; it is how
    ``CudaGraph.update`` refreshes captured inputs. ``src`` may be a DeviceOp
    producing a tensor (it runs first, on the same stream).
    """
    d = _tensor_arg(dst, "memcpy")
    src_arg = _tensor_or_op(src, "memcpy")
    if isinstance(src_arg, Tensor):
        _memcpy_check(d, src_arg)

    def run(ctx: ExecutionContext) -> Tensor:
        s = _resolved(src_arg, ctx, "memcpy")
        if src_arg is not s:
            _memcpy_check(d, s)
        check_device(d, ctx.stream, "memcpy")
        check_device(s, ctx.stream, "memcpy")
        da, sa = d.array, s.array

        def cpu() -> None:
            np.copyto(da, sa)

        def cuda(native: Any) -> None:
            if da.flags.c_contiguous and sa.flags.c_contiguous:
                import cupy

                cupy.cuda.runtime.memcpyAsync(da.data.ptr, sa.data.ptr, da.nbytes,
                                              cupy.cuda.runtime.memcpyDeviceToDevice, native.ptr)
            else:
                _on(native, lambda: da.__setitem__(Ellipsis, sa))

        launch(ctx, "memcpy", (s,), (d,), cpu, cuda)
        return d

    return _ApiOp("memcpy", run)


def to_host(t: Tensor | DeviceOp[Tensor]) -> DeviceOp[np.ndarray]:
    """A NumPy copy of ``t`` (page-locked on cuda, copied without blocking the host).

    ``t`` may be a DeviceOp producing a tensor: it runs first, on the same stream.
    """
    arg = _tensor_or_op(t, "to_host")

    def run(ctx: ExecutionContext) -> np.ndarray:
        src = _resolved(arg, ctx, "to_host")
        check_device(src, ctx.stream, "to_host")
        s = src.array
        if ctx.device.is_cpu:
            out = np.empty(src.shape, src.dtype)
            launch(ctx, "to_host", (src,), (), lambda: np.copyto(out, s), lambda n: None)
            return out
        if ctx.stream.capture is not None:
            from ._errors import CaptureError

            raise CaptureError("to_host allocates host memory inside a graph capture; "
                               "copy into a preallocated tensor with api.memcpy instead", op="to_host")
        import cupyx

        pinned = cupyx.empty_pinned(src.shape, src.dtype)
        contiguous = s if s.flags.c_contiguous else None

        def cuda(native: Any) -> None:
            a = contiguous if contiguous is not None else _on_get(native, s)
            a.get(stream=native, out=pinned, blocking=False)

        launch(ctx, "to_host", (src,), (), lambda: None, cuda)
        return pinned

    return _ApiOp("to_host", run)


def _on_get(native: Any, s: Any) -> Any:
    with native:
        return s.copy()


_transfer_streams: dict[str, Any] = {}


def to_device(t: Tensor, device: Device | int | str) -> DeviceOp[Tensor]:
    """A copy of ``t`` on ``device`` (explicit cross-device transfer).

    Runs on the executing stream when it is on ``device``, else on a transfer
    stream of ``device`` joined back with events. Crossing between the cpu
    backend and CUDA synchronizes the source's last writer on the host first.
    """
    src = _tensor_arg(t, "to_device")
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
            if stream.device.is_cpu == home.device.is_cpu:
                stream.wait_event(home.record_event())
            else:
                home.synchronize()
        w = src._storage.write
        if w is not None and w[0].device.is_cpu != dev.is_cpu:
            w[0].synchronize()
        tctx = ctx if stream is home else ctx.on(stream)
        out = allocate(stream, src.shape, src.dtype, "to_device")
        sa, oa = src.array, out.array

        def cpu() -> None:
            if src.device.is_cpu:
                np.copyto(oa, sa)
            else:
                np.copyto(oa, sa.get())

        def cuda(native: Any) -> None:
            import cupy

            if src.device.is_cpu:
                oa.set(sa if sa.flags.c_contiguous else np.ascontiguousarray(sa), stream=native)
            else:
                c = sa if sa.flags.c_contiguous else None
                if c is None:
                    raise ShapeError("to_device: source must be contiguous", op="to_device")
                cupy.cuda.runtime.memcpyPeerAsync(oa.data.ptr, dev.index, c.data.ptr,
                                                  src.device.index, c.nbytes, native.ptr)

        reads = (src,) if src.device.is_cpu == dev.is_cpu else ()
        launch(tctx, "to_device", reads, (out,), cpu, cuda)
        if stream is not home:
            if stream.device.is_cpu == home.device.is_cpu:
                home.wait_event(stream.record_event())
            else:
                stream.synchronize()
        return out

    return _ApiOp("to_device", run)
