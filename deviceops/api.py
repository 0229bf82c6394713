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

The creating functions live here; the copies in ``deviceops._copies`` (re-exported),
and the DeviceOp behind them all in ``deviceops._api_op``.

Example:
    >>> x = api.arange(6, dtype="float32").map(lambda t: t.reshape(2, 3)).sync()
    >>> api.to_host(x).sync().tolist()
    [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from ._api_op import _ApiOp, _produce
from ._copies import convert, dup, from_host, memcpy, to_device, to_host  # (+ the to_host hook)
from ._dtypes import float32, is_floating, normalize_dtype
from ._errors import DTypeError, ShapeError
from ._op import DeviceOp
from ._tensor import Tensor, allocate, normalize_shape

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

