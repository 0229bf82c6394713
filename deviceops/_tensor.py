"""Tensor, Partition and the per-storage hazard record.

A :class:`Tensor` is an array (CuPy or NumPy) on one device plus a shared
:class:`Storage` record of who touched its memory last:

* ``write``: ``(stream, seq)`` of the last op that wrote it;
* ``reads``: ``{stream: seq}`` of ops that read it since.

:func:`before_access` makes the executing stream wait on exactly the events
that order it after conflicting work on other streams (read-after-write,
write-after-read, write-after-write); :func:`after_access` updates the record.
Views (``reshape``, ``partition``) share the storage, so hazards follow memory,
not Python objects.

When a tensor's last reference goes while a stream other than the one it was
allocated on may still use it, its memory is parked (:func:`sweep` releases it
once those streams are past the use), so the allocator cannot hand it out
again too early — CuPy's pool reuses freed blocks on the allocating stream
immediately.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ._dtypes import normalize_dtype
from ._errors import DeviceError, ShapeError

if TYPE_CHECKING:
    from ._device import Device
    from ._op import DeviceOp
    from ._stream import Stream

__all__ = ["Partition", "Storage", "Tensor"]


class Storage:
    """The memory behind one or more tensor views, and its hazard record."""

    __slots__ = ("__weakref__", "alloc_stream", "base", "device", "reads", "write")

    def __init__(self, base: Any, device: Device, alloc_stream: Stream | None) -> None:
        self.base = base
        self.device = device
        self.alloc_stream = alloc_stream
        self.write: tuple[Stream, int] | None = None
        self.reads: dict[Stream, int] = {}

    def pending(self) -> list[tuple[Stream, int]]:
        """Accesses by streams other than the allocating one."""
        out = [(s, q) for s, q in self.reads.items() if s is not self.alloc_stream]
        w = self.write
        if w is not None and w[0] is not self.alloc_stream:
            out.append(w)
        return out

    def __del__(self) -> None:
        if self.alloc_stream is None:
            return
        try:
            uses = self.pending()
        except Exception:
            return
        if uses:
            _parked.append((self.base, uses))


# (array kept alive, [(stream, seq) that must complete first])
_parked: list[tuple[Any, list[tuple[Stream, int]]]] = []


def sweep() -> None:
    """Release parked memory whose cross-stream uses have completed."""
    if not _parked:
        return
    keep = []
    for base, uses in _parked:
        left = []
        for s, q in uses:
            ev = s._last_event
            if ev is None or ev.seq < q or ev.capture is not None:
                if s.capture is not None:
                    left.append((s, q))
                    continue
                ev = s.record_event()
            if not ev.query():
                left.append((s, q))
        if left:
            keep.append((base, left))
    _parked[:] = keep


def parked_count() -> int:
    """Number of parked allocations (for tests and diagnostics)."""
    return len(_parked)


def before_access(stream: Stream, reads: Sequence[Storage], writes: Sequence[Storage]) -> None:
    """Order ``stream`` after conflicting earlier work on other streams."""
    for st in reads:
        w = st.write
        if w is not None and w[0] is not stream:
            stream.wait_for(w[0], w[1])
    for st in writes:
        w = st.write
        if w is not None and w[0] is not stream:
            stream.wait_for(w[0], w[1])
        for s, q in st.reads.items():
            if s is not stream:
                stream.wait_for(s, q)


def after_access(stream: Stream, seq: int, reads: Sequence[Storage], writes: Sequence[Storage]) -> None:
    """Record that op ``seq`` of ``stream`` read ``reads`` and wrote ``writes``."""
    for st in reads:
        st.reads[stream] = seq
    for st in writes:
        st.write = (stream, seq)
        if st.reads:
            st.reads = {}
    cap = stream.capture
    if cap is not None:
        for st in reads:
            cap.note(st, False)
        for st in writes:
            cap.note(st, True)


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

    __slots__ = ("__weakref__", "_array", "_contig", "_storage")

    def __init__(self, array: Any, device: Device | None = None, *, _storage: Storage | None = None) -> None:
        if device is None:
            from ._device import device as _dev

            device = _dev("cpu") if isinstance(array, np.ndarray) else _dev(int(array.device.id))
        self._array = array
        self._contig: bool | None = None
        self._storage = _storage if _storage is not None else Storage(array, device, None)

    # -- properties -------------------------------------------------------------
    @property
    def array(self) -> Any:
        """The CuPy (cuda) or NumPy (cpu) array holding the data."""
        return self._array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._array.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        return np.dtype(self._array.dtype)

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
        c = self._contig
        if c is None:
            c = self._contig = bool(self._array.flags.c_contiguous)
        return c

    # -- views ------------------------------------------------------------------
    def reshape(self, *shape: int | Sequence[int]) -> Tensor:
        """A view with a new shape (same storage, same hazard record).

        Raises:
            ShapeError: the element count differs or the tensor is not contiguous.
        """
        new = _shape_arg(shape)
        if math.prod(new) != self.size and -1 not in new:
            raise ShapeError(f"reshape: cannot view {self.shape} ({self.size} elements) as {new}", op="reshape")
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

    def partition(self, tile_shape: Sequence[int]) -> Partition:
        """Split into tiles of ``tile_shape``; a kernel writing it launches one block per tile."""
        return Partition(self, tuple(tile_shape))

    def to_host(self) -> DeviceOp[np.ndarray]:
        """A DeviceOp giving a NumPy copy of the data (valid once its stream reaches it)."""
        from .api import to_host

        return to_host(self)

    # -- interop ----------------------------------------------------------------
    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return self._array.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> Any:
        return self._array.__dlpack_device__()

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        if self.device.is_cpu:
            raise AttributeError("a cpu-backend Tensor has no __cuda_array_interface__")
        return dict(self._array.__cuda_array_interface__)

    @classmethod
    def from_dlpack(cls, obj: Any) -> Tensor:
        """Wrap (zero-copy) any DLPack producer: a CuPy array, a torch tensor, a NumPy array.

        CUDA memory becomes a cuda tensor, host memory a cpu tensor. The producer
        must have finished writing it (synchronize it first).
        """
        dev_type = obj.__dlpack_device__()[0] if hasattr(obj, "__dlpack_device__") else 1
        if int(dev_type) == 1:  # kDLCPU
            return cls(np.from_dlpack(obj))
        import cupy

        return cls(cupy.from_dlpack(obj))


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
        if len(tile_shape) != tensor.ndim or any(int(t) < 1 for t in tile_shape):
            raise ShapeError(
                f"partition: tile shape {tile_shape} does not fit tensor shape {tensor.shape}; "
                f"give {tensor.ndim} positive tile sizes",
                op="partition",
            )
        self.tensor = tensor
        self.tile_shape = tuple(int(t) for t in tile_shape)
        self.grid = tuple(-(-n // t) for n, t in zip(tensor.shape, self.tile_shape, strict=True))

    def unpartition(self) -> Tensor:
        """The whole tensor again."""
        return self.tensor

    def __repr__(self) -> str:
        return f"Partition(tensor={self.tensor!r}, tile_shape={self.tile_shape}, grid={self.grid})"


def _shape_arg(shape: tuple[Any, ...]) -> tuple[int, ...]:
    if len(shape) == 1 and not isinstance(shape[0], int):
        shape = tuple(shape[0])
    return tuple(int(s) for s in shape)


def normalize_shape(shape: int | Sequence[int], op: str) -> tuple[int, ...]:
    """A shape as a tuple of non-negative ints (``ShapeError`` otherwise)."""
    tup = (shape,) if isinstance(shape, int | np.integer) else tuple(shape)
    try:
        out = tuple(int(s) for s in tup)
    except (TypeError, ValueError) as exc:
        raise ShapeError(f"{op}: shape {shape!r} is not a sequence of ints", op=op) from exc
    if any(s < 0 for s in out):
        raise ShapeError(f"{op}: shape {out} has a negative dimension", op=op)
    return out


def allocate(stream: Stream, shape: tuple[int, ...], dtype: Any, op: str) -> Tensor:
    """A new uninitialised tensor on ``stream``'s device, owned by ``stream``.

    Raises:
        CaptureError: ``stream`` is being captured into a graph.
    """
    if stream.capture is not None:
        from ._errors import CaptureError

        raise CaptureError(
            f"{op} allocates a tensor of shape {shape} inside a graph capture "
            f"(capturing {stream.capture.op_name}); allocate it before capturing and pass it "
            "in (e.g. out=...), then capture only the ops that write into it.",
            op=op,
            device=str(stream.device),
        )
    sweep()
    dt = normalize_dtype(dtype, op=op)
    dev = stream.device
    arr = np.empty(shape, dt) if dev.is_cpu else _cuda_empty(stream, shape, dt)
    return Tensor(arr, dev, _storage=Storage(arr, dev, stream))


def _cuda_empty(stream: Any, shape: tuple[int, ...], dt: np.dtype[Any]) -> Any:
    import cupy

    from ._cuda_backend import cuda_errors

    with cuda_errors("allocate", str(stream.device)), cupy.cuda.Device(stream.device.index), stream.native:
        return cupy.empty(shape, dt)


def check_device(t: Tensor, stream: Stream, op: str) -> None:
    """Raise if ``t`` lives on another device than ``stream``."""
    if t._storage.device is not stream.device:
        raise DeviceError(
            f"{op}: tensor {t.shape} {t.dtype} is on {t.device} but the op runs on "
            f"{stream.device}; copy it explicitly with api.to_device(t, {str(stream.device)!r})",
            op=op,
            device=str(stream.device),
        )
