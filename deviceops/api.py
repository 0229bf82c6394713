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

import ml_dtypes
import numpy as np

from . import _hooks
from ._context import ExecutionContext
from ._device import Device
from ._device import device as _device
from ._dtypes import bfloat16, float32, is_floating, normalize_dtype
from ._errors import CaptureError, DTypeError, ShapeError
from ._launch import launch
from ._op import DeviceOp, _drive
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
    """A DeviceOp whose work is one function of the execution context.

    With ``dep`` (a DeviceOp producing the tensor argument), ``fn(ctx, value)``
    runs after ``dep`` executed on the same stream (iteratively: see ``_drive``).
    """

    __slots__ = ("_dep", "_fn", "_name")
    _iterative = True

    def __init__(self, name: str, fn: Callable[..., Any], dep: DeviceOp[Any] | None = None) -> None:
        super().__init__()
        self._name = name
        self._fn = fn
        self._dep = dep

    def _execute(self, ctx: ExecutionContext) -> Any:
        if self._dep is None:
            return self._fn(ctx)
        return _drive(self, ctx)

    def _deps(self, ctx: ExecutionContext) -> tuple[DeviceOp[Any], ...]:
        return () if self._dep is None else (self._dep,)

    def _finish(self, ctx: ExecutionContext, vals: list[Any]) -> Any:
        if self._dep is None:
            return self._fn(ctx)
        return self._fn(ctx, vals[0])

    def _children(self) -> tuple[DeviceOp[Any], ...]:
        return () if self._dep is None else (self._dep,)

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


def _real(op: str, what: str, x: Any, *, finite: bool = True) -> float | int:
    """A real number argument (int or float, NumPy scalars too; not bool, str, None)."""
    if isinstance(x, bool | np.bool_) or not isinstance(x, int | float | np.integer | np.floating):
        raise TypeError(f"{op}: {what} must be a real number (int or float), got "
                        f"{type(x).__name__} {x!r}")
    if finite and not math.isfinite(x):
        raise ValueError(f"{op}: {what} must be finite, got {x!r}")
    return int(x) if isinstance(x, int | np.integer) else float(x)


def _count(op: str, what: str, n: Any) -> int:
    """A non-negative int argument (a size or a count)."""
    if isinstance(n, bool | np.bool_) or not isinstance(n, int | np.integer):
        raise TypeError(f"{op}: {what} must be an int, got {type(n).__name__} {n!r}")
    if n < 0:
        raise ShapeError(f"{op}: {what} must be >= 0, got {n}", op=op)
    return int(n)


def _fits(op: str, what: str, v: float | int, dt: np.dtype[Any]) -> None:
    """Refuse a value ``dt`` cannot hold (NaN/inf/fractions/out of range for integers)."""
    if is_floating(dt):
        top = float(ml_dtypes.finfo(dt).max)
        if math.isfinite(v) and abs(v) > top:
            raise ValueError(f"{op}: {what} {v!r} overflows {dt} (max {top:g}); "
                             "use a wider dtype such as float32")
        return
    info = np.iinfo(dt)
    if not math.isfinite(v) or v != math.floor(v) or not info.min <= v <= info.max:
        raise ValueError(f"{op}: {what} {v!r} cannot be held by {dt} (integers in "
                         f"[{info.min}, {info.max}]); give an integer in range or a floating dtype")


def empty(shape: Shape, dtype: Any = float32) -> DeviceOp[Tensor]:
    """A new tensor with unspecified contents (allocation only)."""
    shp, dt = normalize_shape(shape, "empty"), normalize_dtype(dtype, op="empty")
    return _ApiOp("empty", lambda ctx: allocate(ctx.stream, shp, dt, "empty"))


def full(shape: Shape, fill_value: float | int, dtype: Any = float32) -> DeviceOp[Tensor]:
    """A new tensor filled with ``fill_value``.

    Raises:
        TypeError: ``fill_value`` is not a real number (``None``, a string, a bool).
        ValueError: ``dtype`` cannot hold it (NaN, inf, a fraction or out of range for
            an integer dtype; a finite value beyond a float dtype's range).
    """
    return _full("full", shape, fill_value, dtype)


def _full(name: str, shape: Shape, fill_value: Any, dtype: Any) -> DeviceOp[Tensor]:
    shp, dt = normalize_shape(shape, name), normalize_dtype(dtype, op=name)
    v = _real(name, "fill_value", fill_value, finite=False)
    _fits(name, "fill_value", v, dt)

    def make(xp: Any, a: Any) -> None:
        a.fill(v)

    return _ApiOp(name, lambda ctx: _produce(ctx, name, shp, dt, make))


def zeros(shape: Shape, dtype: Any = float32) -> DeviceOp[Tensor]:
    """A new tensor of zeros."""
    return _full("zeros", shape, 0, dtype)


def ones(shape: Shape, dtype: Any = float32) -> DeviceOp[Tensor]:
    """A new tensor of ones."""
    return _full("ones", shape, 1, dtype)


def arange(start: float, stop: float | None = None, step: float = 1, dtype: Any = None) -> DeviceOp[Tensor]:
    """Evenly spaced values in ``[start, stop)``, as :func:`numpy.arange`."""
    if stop is None:
        start, stop = 0, start
    start = _real("arange", "start", start)
    stop = _real("arange", "stop", stop)
    step = _real("arange", "step", step)
    if step == 0:
        raise ShapeError("arange: step must not be zero", op="arange")
    n = max(0, math.ceil((stop - start) / step))
    if dtype is None:
        dtype = "int64" if all(isinstance(x, int) for x in (start, stop, step)) else float32
    dt = normalize_dtype(dtype, op="arange")
    if n:
        _fits("arange", "start", start, dt)
        _fits("arange", "last value", start + step * (n - 1), dt)
    s0, st = start, step

    def make(xp: Any, a: Any) -> None:
        a[...] = (s0 + st * xp.arange(n, dtype=np.float64)).astype(dt)

    return _ApiOp("arange", lambda ctx: _produce(ctx, "arange", (n,), dt, make))


def linspace(start: float, stop: float, num: int = 50, dtype: Any = float32, *, endpoint: bool = True) -> DeviceOp[Tensor]:
    """``num`` evenly spaced values from ``start`` to ``stop``, as :func:`numpy.linspace`."""
    start = _real("linspace", "start", start)
    stop = _real("linspace", "stop", stop)
    num = _count("linspace", "num", num)
    if not isinstance(endpoint, bool | np.bool_):
        raise TypeError(f"linspace: endpoint must be a bool, got {type(endpoint).__name__} {endpoint!r}")
    dt = normalize_dtype(dtype, op="linspace")
    if num and is_floating(dt):
        _fits("linspace", "start", start, dt)
        _fits("linspace", "stop", stop, dt)

    def make(xp: Any, a: Any) -> None:
        a[...] = xp.linspace(start, stop, num, endpoint=endpoint, dtype=np.float64).astype(dt)

    return _ApiOp("linspace", lambda ctx: _produce(ctx, "linspace", (num,), dt, make))


def eye(n: int, m: int | None = None, dtype: Any = float32, *, k: int = 0) -> DeviceOp[Tensor]:
    """A 2-D tensor with ones on diagonal ``k``, as :func:`numpy.eye`."""
    n = _count("eye", "n", n)
    m = n if m is None else _count("eye", "m", m)
    if isinstance(k, bool | np.bool_) or not isinstance(k, int | np.integer):
        raise TypeError(f"eye: k (the diagonal) must be an int, got {type(k).__name__} {k!r}")
    k = int(k)
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
    if seed is not None and (isinstance(seed, bool | np.bool_) or not isinstance(seed, int | np.integer)
                             or seed < 0):
        raise ValueError(f"{name}: seed must be None or an int >= 0, got {type(seed).__name__} {seed!r}")
    sd = _fresh_seed() if seed is None else int(seed)

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
        snap = np.array(host, dtype=dt, order="C", copy=True)  # keeps 0-d shapes (ascontiguousarray makes them 1-d)
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


def _tensor_arg(x: Any, op: str, name: str = "t") -> Tensor:
    if isinstance(x, Tensor):
        return x
    raise TypeError(f"{op}: argument {name!r} must be a Tensor, got {type(x).__name__}"
                    + ("; pass the tensor (execute the op producing it first)"
                       if isinstance(x, DeviceOp) else ""))


def _tensor_or_op(x: Any, op: str, name: str = "t") -> Tensor | DeviceOp[Tensor]:
    """A Tensor, or a DeviceOp producing one (adopted: it runs first, on the same stream)."""
    if isinstance(x, Tensor):
        return x
    if isinstance(x, DeviceOp):
        return x._adopt(op)
    raise TypeError(f"{op}: argument {name!r} must be a Tensor or a DeviceOp producing one, "
                    f"got {type(x).__name__}")


def _with_arg(op: str, arg: Tensor | DeviceOp[Tensor], run: Callable[[ExecutionContext, Tensor], Any]
              ) -> DeviceOp[Any]:
    """An op running ``run(ctx, tensor)``; a DeviceOp ``arg`` executes first (iteratively)."""
    if isinstance(arg, Tensor):
        return _ApiOp(op, lambda ctx: run(ctx, arg))

    def after(ctx: ExecutionContext, t: Any) -> Any:
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: the DeviceOp argument produced {type(t).__name__}, not a Tensor")
        return run(ctx, t)

    return _ApiOp(op, after, arg)


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
    producing a tensor (it runs first, on the same stream).
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

    return _with_arg("memcpy", src_arg, run)


def to_host(t: Tensor | DeviceOp[Tensor]) -> DeviceOp[np.ndarray]:
    """A NumPy copy of ``t`` (page-locked on cuda, copied without blocking the host).

    ``t`` may be a DeviceOp producing a tensor: it runs first, on the same stream.
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

    return _with_arg("to_host", arg, run)


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

    return _ApiOp("to_device", run)


_hooks.install(to_host=to_host)  # Tensor.to_host()
