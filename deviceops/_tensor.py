"""Tensor, Partition and allocation.

A :class:`Tensor` is an array (CuPy or NumPy) on one device plus a shared
:class:`~deviceops._storage.Storage` record of who touched its memory last
(the hazard record: see :mod:`deviceops._storage`). Views (``reshape``,
``partition``) share the storage, so hazards follow memory, not Python objects.
:func:`allocate` makes a new tensor owned by a stream (reusing a spare array of
the stream where the backend keeps them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _hooks
from ._dtypes import normalize_dtype
from ._errors import DeviceError, DTypeError, ShapeError
from ._storage import (
    SPARE_MAX_BYTES,
    Storage,
    _parked,
    parked_count,
    sweep,
)

if TYPE_CHECKING:
    from ._device import Device
    from ._op import DeviceOp
    from ._stream import Stream

# Storage, sweep and parked_count are re-exported: the hazard record's users import them
# from here
__all__ = ["Partition", "Storage", "Tensor", "parked_count", "sweep"]


# signature -> a small int (Tensor.signature_id); bounded: past the bound, new signatures
# get none (their kernel checks are then not cached), so the table cannot grow without end
_SIG_IDS: dict[tuple[Any, ...], int] = {}
_SIG_IDS_MAX = 1 << 20


class Tensor:
    """An n-dimensional array on one device, tracked for cross-stream safety.

    Tensors come out of DeviceOps (``deviceops.api``, kernels); their data is
    valid once the producing stream reaches that point (``sync()``/``await``
    guarantee it). ``.array`` is the underlying CuPy/NumPy array: reading it
    directly bypasses stream ordering, so do that only after synchronizing.

    Example:
        >>> t = api.ones((2, 3)).sync()
        >>> t.shape, str(t.dtype)
        ((2, 3), 'float32')
    """

    __slots__ = ("__weakref__", "_array", "_sig", "_sig_id", "_storage")

    def __init__(self, array: Any, device: Device | None = None, *, _storage: Storage | None = None) -> None:
        self._array = array
        self._sig: tuple[tuple[int, ...], np.dtype[Any], Device, bool] | None = None
        self._sig_id = -1  # the signature's interned number (see signature_id), -1: not yet
        self._storage = _storage if _storage is not None else Storage(
            array, _check_array(array, device), None)

    # -- properties -------------------------------------------------------------
    @property
    def array(self) -> Any:
        """The CuPy (cuda) or NumPy (cpu) array holding the data."""
        return self._array

    def signature(self) -> tuple[tuple[int, ...], np.dtype[Any], Device, bool]:
        """``(shape, dtype, device, C-contiguous)``, computed once (a tensor's array never
        changes): what a kernel's argument checks depend on, and part of its plan-cache key."""
        sig = self._sig
        if sig is None:
            a = self._array
            sig = self._sig = (tuple(a.shape), np.dtype(a.dtype), self._storage.device,
                               bool(a.flags.c_contiguous))
        return sig

    def signature_id(self) -> int:
        """A small int naming :meth:`signature` (equal ints: equal signatures), or ``-2``
        when the process has seen more than ``2**20`` distinct signatures (then: none)."""
        sid = self._sig_id
        if sid == -1:
            sig = self.signature()
            sid = _SIG_IDS.get(sig, -1)
            if sid == -1:
                sid = len(_SIG_IDS) if len(_SIG_IDS) < _SIG_IDS_MAX else -2
                if sid >= 0:
                    _SIG_IDS[sig] = sid
            self._sig_id = sid
        return sid

    @property
    def shape(self) -> tuple[int, ...]:
        sig = self._sig
        return (sig if sig is not None else self.signature())[0]

    @property
    def dtype(self) -> np.dtype[Any]:
        sig = self._sig
        return (sig if sig is not None else self.signature())[1]

    @property
    def device(self) -> Device:
        return self._storage.device

    @property
    def ndim(self) -> int:
        return int(self._array.ndim)

    @property
    def size(self) -> int:
        return int(self._array.size)

    @property
    def nbytes(self) -> int:
        return int(self._array.nbytes)

    def __repr__(self) -> str:
        return f"Tensor(shape={self.shape}, dtype={self.dtype}, device={self.device})"

    def __len__(self) -> int:
        return int(self._array.shape[0])

    @property
    def is_contiguous(self) -> bool:
        """True if the data is C-contiguous (computed once: a tensor's layout never changes)."""
        sig = self._sig
        return (sig if sig is not None else self.signature())[3]

    # -- views ------------------------------------------------------------------
    def reshape(self, *shape: int | Sequence[int]) -> Tensor:
        """A view with a new shape (same storage, same hazard record).

        Raises:
            ShapeError: the element count differs or the tensor is not contiguous.
        """
        new = _shape_arg(shape)
        neg = [s for s in new if s < 0]
        if neg:
            known = math.prod(s for s in new if s >= 0)
            if neg != [-1] or known == 0 or self.size % known:
                raise ShapeError(
                    f"reshape: cannot view {self.shape} ({self.size} elements) as {new}; at most "
                    "one dimension may be -1 (inferred), and the others must divide the size",
                    op="reshape")
            new = tuple(self.size // known if s == -1 else s for s in new)
        if math.prod(new) != self.size:
            raise ShapeError(f"reshape: cannot view {self.shape} ({self.size} elements) as {new}; "
                             "the element count must stay the same", op="reshape")
        if not self._array.flags.c_contiguous:
            raise ShapeError(f"reshape: tensor of shape {self.shape} is not contiguous", op="reshape")
        return Tensor(self._array.reshape(new), self.device, _storage=self._storage)

    def __getitem__(self, key: int | slice) -> Tensor:
        """A view along the leading dim: ``t[i]`` (one row) or ``t[a:b]`` (rows ``a..b-1``).

        The view shares the storage and its hazard record, so work on a view is
        ordered against work on the whole tensor (conservatively). Only a plain
        index or a step-1 slice of the leading dim is supported: the view of a
        C-contiguous tensor stays C-contiguous.

        Raises:
            TypeError: another kind of key (a tuple, a stepped slice, an array).
            IndexError: an index out of range.
        """
        if self.ndim == 0:
            raise TypeError("Tensor index: a 0-d tensor has no leading dim to index")
        n = int(self._array.shape[0])
        if isinstance(key, slice):
            if key.step not in (None, 1):
                raise TypeError(f"Tensor index: slice step {key.step} is not supported (views "
                                "along the leading dim take step 1)")
            a, b, _ = key.indices(n)
            return Tensor(self._array[a:max(a, b)], self.device, _storage=self._storage)
        if isinstance(key, bool) or not isinstance(key, int | np.integer):
            raise TypeError(f"Tensor index: {key!r} is not supported; use t[i] or t[a:b] on the "
                            "leading dim")
        i = int(key)
        if not -n <= i < n:
            raise IndexError(f"Tensor index {i} is out of range for a leading dim of {n}")
        return Tensor(self._array[i % n], self.device, _storage=self._storage)

    def partition(self, tile_shape: Sequence[int] | int) -> Partition:
        """Split into tiles of ``tile_shape``; a kernel writing it launches one block per tile."""
        if type(tile_shape) is tuple and all(type(t) is int for t in tile_shape):
            # the common form (a tuple of ints; 256.0 == 256 must not hit): validated tilings
            # are remembered
            key = (self.shape, tile_shape)
            grid = _grids.get(key)
            if grid is not None:
                p = Partition.__new__(Partition)
                p.tensor, p.tile_shape, p.grid = self, tile_shape, grid
                return p
        if isinstance(tile_shape, int | np.integer) and not isinstance(tile_shape, bool):
            tile_shape = (int(tile_shape),)
        if not isinstance(tile_shape, tuple | list):
            raise ShapeError(f"partition: tile shape {tile_shape!r} is not a tuple of ints, e.g. "
                             f"{tuple(1 for _ in self.shape)}", op="partition")
        return Partition(self, tuple(tile_shape))  # validated there

    def to_host(self) -> DeviceOp[np.ndarray]:
        """A DeviceOp giving a NumPy copy of the data (valid once its stream reaches it)."""
        op: DeviceOp[np.ndarray] = _hooks.to_host(self)  # installed by deviceops.api
        return op

    # -- interop ----------------------------------------------------------------
    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """Refused: a Tensor is not converted to NumPy implicitly (as CuPy refuses it).

        An implicit conversion would block on the device and copy, silently; and without
        this method ``numpy.asarray(t)`` built an object array of 0-d Tensors.

        Raises:
            TypeError: always; the message names ``api.to_host``.
        """
        raise TypeError(
            f"a deviceops Tensor ({self.shape} {self.dtype} on {self.device}) is not converted "
            "to a NumPy array implicitly: copy it to the host explicitly with "
            "api.to_host(t).sync() (or `await api.to_host(t)`, or t.to_host().sync())")

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return self._array.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> Any:
        return self._array.__dlpack_device__()

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        iface = getattr(self._array, "__cuda_array_interface__", None)
        if iface is None:  # a NumPy array (cpu backend) has none
            raise AttributeError(f"a {self.device.kind}-backend Tensor has no "
                                 "__cuda_array_interface__")
        return dict(iface)

    @classmethod
    def from_dlpack(cls, obj: Any) -> Tensor:
        """Wrap (zero-copy) any DLPack producer: a CuPy array, a torch tensor, a NumPy array.

        CUDA memory becomes a cuda tensor, host memory a cpu tensor. The producer
        must have finished writing it (synchronize it first).
        """
        if not hasattr(obj, "__dlpack__"):
            raise TypeError(f"Tensor.from_dlpack: {type(obj).__name__} is not a DLPack producer "
                            "(it has no __dlpack__); for host data use api.from_host(data)")
        dev_type = obj.__dlpack_device__()[0] if hasattr(obj, "__dlpack_device__") else 1
        if int(dev_type) == 1:  # kDLCPU
            try:
                arr = np.from_dlpack(obj)
            except (TypeError, BufferError, RuntimeError) as exc:  # e.g. bfloat16/bool via NumPy
                raise DTypeError(f"Tensor.from_dlpack: NumPy cannot import this "
                                 f"{type(obj).__name__}: {exc}", op="from_dlpack") from exc
            return cls(arr)
        from ._device import backend

        return cls(backend("cuda").from_dlpack(obj))


# (tensor shape, tile shape) -> grid of tilings validated before: Tensor.partition skips the
# checks for them (bounded; a tuple of the same ints always validates the same way)
_grids: dict[tuple[tuple[int, ...], tuple[Any, ...]], tuple[int, ...]] = {}


class Partition:
    """A tensor seen as a grid of tiles of ``tile_shape``.

    A kernel that writes a Partition launches one block per tile; ``grid`` is
    the number of tiles along each dimension (the last tile may be partial).

    Attributes:
        tensor: the partitioned tensor.
        tile_shape: the shape of one tile.
        grid: tiles along each dimension.
    """

    __slots__ = ("grid", "tensor", "tile_shape")

    def __init__(self, tensor: Tensor, tile_shape: tuple[int, ...]) -> None:
        if not isinstance(tensor, Tensor):
            raise TypeError(f"Partition: tensor must be a Tensor, got {type(tensor).__name__}")
        if not isinstance(tile_shape, tuple | list):
            raise ShapeError(f"partition: tile shape {tile_shape!r} is not a tuple of ints",
                             op="partition")
        tiles = tuple(_dim(t, "partition", tile_shape) for t in tile_shape)
        shape = tensor.shape
        if len(tiles) != len(shape) or any(t < 1 for t in tiles):
            raise ShapeError(
                f"partition: tile shape {tiles} does not fit tensor shape {shape}; "
                f"give {len(shape)} positive tile sizes",
                op="partition",
            )
        self.tensor = tensor
        self.tile_shape = tiles
        self.grid = tuple(-(-n // t) for n, t in zip(shape, tiles, strict=True))
        if type(tile_shape) is tuple and all(type(t) is int for t in tile_shape) and \
                len(_grids) < 4096:
            _grids[(shape, tile_shape)] = self.grid  # (shape, tiles as given) -> grid

    def unpartition(self) -> Tensor:
        """The whole tensor again."""
        return self.tensor

    def __repr__(self) -> str:
        return f"Partition(tensor={self.tensor!r}, tile_shape={self.tile_shape}, grid={self.grid})"


def _check_array(array: Any, device: Device | None) -> Device:
    """Validate a user-given array for ``Tensor(array)``; return its device."""
    from ._device import Device
    from ._device import device as _dev
    from ._dtypes import SUPPORTED

    if isinstance(array, np.ndarray):
        kind = "cpu"
    elif type(array).__module__.split(".")[0] == "cupy":
        kind = "cuda"
    else:
        raise TypeError(f"Tensor: array must be a NumPy (cpu) or CuPy (cuda) array, got "
                        f"{type(array).__name__}; build tensors with deviceops.api (e.g. "
                        "api.from_host(data)) or Tensor.from_dlpack(obj)")
    if array.dtype not in SUPPORTED:
        names = ", ".join(str(d) for d in SUPPORTED)
        raise DTypeError(f"Tensor: dtype {array.dtype} is not supported; use one of {names} "
                         "(convert it first, e.g. array.astype('float32'))", op="Tensor")
    if device is not None and not isinstance(device, Device):
        raise TypeError(f"Tensor: device must be a deviceops.Device, got {type(device).__name__}")
    actual = _dev("cpu") if kind == "cpu" else _dev(int(array.device.id))
    if device is not None and device is not actual:
        raise DeviceError(f"Tensor: the array lives on {actual}, not on the device given ({device})",
                          op="Tensor", device=str(device))
    return actual


def _dim(s: Any, op: str, shape: Any) -> int:
    if isinstance(s, bool) or not isinstance(s, int | np.integer):
        what = "tile shape" if op == "partition" else "shape"
        raise ShapeError(f"{op}: {what} {shape!r} has a {type(s).__name__} dimension {s!r}; "
                         "dimensions must be ints", op=op)
    return int(s)


def _shape_arg(shape: tuple[Any, ...]) -> tuple[int, ...]:
    if len(shape) == 1 and not isinstance(shape[0], int | np.integer):
        if not isinstance(shape[0], tuple | list):
            raise ShapeError(f"reshape: shape {shape[0]!r} is not an int or a tuple of ints",
                             op="reshape")
        shape = tuple(shape[0])
    return tuple(_dim(s, "reshape", shape) for s in shape)


def host_data_hint(x: Any, op: str = "") -> str:
    """``"; ..."`` naming ``api.from_host`` when ``x`` looks like host data (a NumPy array,
    a list, a number), else ``""``: the tail of a "must be a Tensor" error of ``op``."""
    if isinstance(x, np.ndarray | np.generic | list | tuple | int | float | complex) or (
            hasattr(x, "__array__") or hasattr(x, "__array_interface__")):
        if op == "to_host":
            return "; it is host data already (to_host copies a device Tensor to the host)"
        return ("; host data goes to the device with deviceops.api.from_host(x) (a DeviceOp "
                "that runs first), e.g. kernels.add(api.from_host(a), api.from_host(b))")
    return ""


def normalize_shape(shape: int | Sequence[int], op: str) -> tuple[int, ...]:
    """A shape as a tuple of non-negative ints (``ShapeError`` otherwise).

    Only ints (Python or NumPy) are dimensions: strings, floats, bools and
    ``None`` are refused rather than coerced.
    """
    if isinstance(shape, bool):
        raise ShapeError(f"{op}: shape {shape!r} is a bool; give an int or a tuple of ints", op=op)
    if isinstance(shape, int | np.integer):
        tup: tuple[Any, ...] = (shape,)
    elif isinstance(shape, tuple | list):
        tup = tuple(shape)
    else:
        raise ShapeError(f"{op}: shape {shape!r} ({type(shape).__name__}) is not an int or a "
                         "tuple of ints, e.g. (2, 3)", op=op)
    out = tuple(_dim(s, op, shape) for s in tup)
    if any(s < 0 for s in out):
        raise ShapeError(f"{op}: shape {out} has a negative dimension", op=op)
    return out


def allocate(stream: Stream, shape: tuple[int, ...], dtype: Any, op: str) -> Tensor:
    """A new uninitialised tensor on ``stream``'s device, owned by ``stream``.

    Raises:
        CaptureError: ``stream`` is being captured into a graph (unless the capture lets
            ops allocate: :attr:`deviceops._capture.CaptureState.allocates`).
    """
    if stream.capture is not None and not stream.capture.allocates:
        from ._errors import CaptureError

        raise CaptureError(
            f"{op} allocates a tensor of shape {shape} inside a graph capture "
            f"(capturing {stream.capture.op_name}); allocate it before capturing and pass it "
            "in (e.g. out=...), then capture only the ops that write into it.",
            op=op,
            device=str(stream.device),
        )
    dt = normalize_dtype(dtype, op=op)
    key = None
    if stream.backend.spare_arrays and type(shape) is tuple:
        key = (shape, id(dt))
        got = take_spare(stream, key)
        if got is not None:
            return got
    elif _parked:
        sweep()
    arr = _empty(stream, shape, dt, op)
    if key is not None and arr.nbytes > SPARE_MAX_BYTES:
        key = None
    return Tensor(arr, stream.device, _storage=Storage(arr, stream.device, stream, key))


def take_spare(stream: Stream, key: tuple[tuple[int, ...], int]) -> Tensor | None:
    """A spare array of ``stream`` for ``key`` = ``(shape, id(dtype))`` as a new tensor, or
    ``None`` when there is none (or ``stream`` is capturing): then call :func:`allocate`.

    The allocation fast path of an op whose output's shape and dtype are known from its
    plan; it releases parked memory first, as :func:`allocate` does.
    """
    if _parked:
        sweep()
    got = stream.spare.get(key)
    if not got or stream.capture is not None:
        return None
    arr = got.pop()
    dev = stream.device
    return Tensor(arr, dev, _storage=Storage(arr, dev, stream, key))


def adopt_host(stream: Stream, arr: np.ndarray, op: str) -> Tensor:
    """A tensor of ``stream`` (a backend with ``host_resident`` arrays: the cpu backend)
    whose memory is ``arr`` itself (a fresh host
    array no one else holds: :func:`deviceops.api.from_host`'s snapshot), instead of a new
    array the snapshot would be copied into.

    Raises:
        CaptureError: ``stream`` is being captured (as :func:`allocate`).
        ValueError: ``stream`` is not the cpu backend's.
    """
    if not stream.backend.host_resident:
        raise ValueError(f"{op}: adopt_host needs a stream of a backend whose arrays are host "
                         f"arrays (the cpu backend's), got {stream.device}")
    if stream.capture is not None:
        allocate(stream, tuple(arr.shape), arr.dtype, op)  # raises the capture error
    return Tensor(arr, stream.device, _storage=Storage(arr, stream.device, stream, None))


def _empty(stream: Stream, shape: tuple[int, ...], dt: np.dtype[Any], op: str) -> Any:
    """``backend.empty``; on out-of-memory, once more after dropping the stream's spares."""
    from ._errors import OutOfMemoryError

    try:
        return stream.backend.empty(stream, shape, dt, op)
    except OutOfMemoryError:
        if not stream.spare:
            raise
        stream.spare.clear()
        return stream.backend.empty(stream, shape, dt, op)


def output_failure(out: Any) -> tuple[str, BaseException] | None:
    """``(producer, error)`` if ``out`` (a Tensor, or a tuple/list of them) holds a tensor
    whose producing device work failed (cpu backend), else ``None``. Cheap: on every sync."""
    t = type(out)
    if t is Tensor:
        return out._storage.fail[0]
    if t is tuple or t is list:
        for o in out:
            if type(o) is Tensor and o._storage.fail[0] is not None:
                return o._storage.fail[0]
    return None


def failed_output_error(what: str, failed: tuple[str, BaseException]) -> DeviceError:
    """The error raised for an output whose producer ``failed``."""
    from ._errors import LaunchError

    producer, exc = failed
    err = LaunchError(f"{what}: its output was produced by {producer}, which failed on the "
                      f"device: {type(exc).__name__}: {exc}", op=producer)
    err.__cause__ = exc
    return err


def check_device(t: Tensor, stream: Stream, op: str) -> None:
    """Raise if ``t`` lives on another device than ``stream``."""
    if t._storage.device is not stream.device:
        raise DeviceError(
            f"{op}: tensor {t.shape} {t.dtype} is on {t.device} but the op runs on "
            f"{stream.device}; copy it explicitly with api.to_device(t, {str(stream.device)!r})",
            op=op,
            device=str(stream.device),
        )
