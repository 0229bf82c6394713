"""GEMM as a DeviceOp: ``gemm`` and ``matmul``, plus the kernel-op plumbing they share.

| launcher                                                       | computes                                   |
|----------------------------------------------------------------|--------------------------------------------|
| ``gemm(a, b, out=None, *, bias, activation, alpha, beta, tf32, trans_b)`` | ``out = act(alpha a @ b + beta out + bias)`` |
| ``matmul(a, b, out=None, *, trans_b)``                         | ``out = a @ b``                            |

Shapes, dtypes and the epilogue follow :mod:`._gemm` (``a`` ``(*batch, M, K)``, ``b``
``(K, N)`` or ``(*batch, K, N)``, float32/float16/bfloat16, float32 accumulation). The
``cpu`` backend runs :func:`._gemm.gemm_reference`; the ``cuda`` backend runs
:func:`._gemm.gemm_cuda` (raw PTX, no cuBLAS) on the executing stream.

**Workspace.** Some problem shapes run faster with split-K, which needs a device workspace
(:func:`._gemm.gemm_workspace_nbytes`; flash attention's decode path has one too). Each
stream keeps one workspace that kernel ops share (work on one stream is ordered, so they
never overlap); it grows, outside graph capture, to the largest size an op on that stream
has needed. Memory cannot be allocated inside a capture, so an op captured on a stream whose
workspace is too small raises :class:`~deviceops.CaptureError`; the fix is to run the same
op once on that stream before capturing (a warm-up, as with any CUDA-graph capture), or to
call :func:`reserve_workspace` first. Both backends keep the same books, so a capture that
would fail on a GPU fails the same way on the ``cpu`` backend.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from deviceops._context import ExecutionContext, enqueue_lock
from deviceops._dtypes import float32
from deviceops._errors import CaptureError, DeviceError, DTypeError, ShapeError
from deviceops._launch import launch
from deviceops._stream import Stream
from deviceops._tensor import Partition, Tensor, allocate, check_device

from ._gemm import ACTIVATIONS, gemm_check, gemm_cuda, gemm_reference, gemm_workspace_nbytes
from ._launch import KernelOp, as_tensor, contiguous, is_deferred
from ._plan import cached, static_key

__all__ = ["gemm", "matmul", "reserve_workspace"]

# -- per-stream workspace --------------------------------------------------------------------

_WS_ATTR = "_deviceops_kernel_workspace"
_WS_GRANULE = 64 * 1024


def _cached_workspace(stream: Stream) -> Tensor | None:
    ws: Tensor | None = getattr(stream, _WS_ATTR, None)
    return ws


def _grow_workspace(stream: Stream, nbytes: int, op: str) -> Tensor:
    n = -(-int(nbytes) // _WS_GRANULE) * _WS_GRANULE
    ws = allocate(stream, (n // 4,), float32, op)
    # Kept on the stream object itself (a reference cycle the collector frees with the
    # stream): a global map would keep every stream alive through the tensor's storage.
    setattr(stream, _WS_ATTR, ws)
    return ws


def workspace_for(stream: Stream, nbytes: int, op: str) -> Tensor | None:
    """The workspace of ``stream``, at least ``nbytes`` long (``None`` when ``nbytes`` is 0).

    Grows it outside graph capture. Include the returned tensor in the launch's writes so
    that a graph replaying the op on another stream is ordered against this stream's use.

    Raises:
        CaptureError: ``stream`` is being captured and its workspace is too small.
    """
    if nbytes <= 0:
        return None
    ws = _cached_workspace(stream)
    if ws is not None and ws.nbytes >= nbytes:
        return ws
    if stream.capture is not None:
        have = 0 if ws is None else ws.nbytes
        raise CaptureError(
            f"{op} needs {nbytes} bytes of device workspace on {stream!r}, which has {have} "
            f"reserved, and memory cannot be allocated inside a graph capture (capturing "
            f"{stream.capture.op_name}). Fix: before capturing, run the same op once on this "
            f"stream (a warm-up), or call deviceops.kernels.reserve_workspace(stream, {nbytes}).",
            op=op,
            device=str(stream.device),
        )
    return _grow_workspace(stream, nbytes, op)


def reserve_workspace(stream: Stream, nbytes: int) -> None:
    """Make ``stream``'s kernel workspace at least ``nbytes`` long (allocating now).

    Call it before capturing a graph that contains ``gemm``/``flash_attention`` calls
    whose workspace was not needed on that stream before (the ``CaptureError`` raised
    otherwise names the size). Running the ops once on the stream does the same.

    Args:
        stream: the stream the ops will be captured (or run) on.
        nbytes: workspace size in bytes.

    Raises:
        CaptureError: ``stream`` is being captured.
    """
    with enqueue_lock:
        ws = _cached_workspace(stream)
        if ws is not None and ws.nbytes >= nbytes:
            return
        if stream.capture is not None:
            raise CaptureError(
                f"reserve_workspace: {stream!r} is being captured; reserve before capturing",
                op="reserve_workspace",
                device=str(stream.device),
            )
        _grow_workspace(stream, nbytes, "reserve_workspace")


# -- kernel-op builder -----------------------------------------------------------------------

Check = Callable[[Mapping[str, Tensor | None]], tuple[tuple[int, ...], np.dtype[Any]]]
Body = Callable[[ExecutionContext, dict[str, Tensor]], None]


def same_device(name: str, ts: Mapping[str, Tensor | None]) -> None:
    """Raise :class:`~deviceops.DeviceError` if the given tensors live on different devices."""
    given = [(k, t) for k, t in ts.items() if t is not None]
    if not given:
        return
    k0, t0 = given[0]
    for k, t in given[1:]:
        if t.device is not t0.device:
            raise DeviceError(f"{name}: {k} is on {t.device} but {k0} is on {t0.device}", op=name)


def checked(name: str, ts: Mapping[str, Tensor | None], check: Callable[[Any], Any]) -> Any:
    """Every given tensor C-contiguous and on one device, then ``check(ts)``'s result."""
    for k, t in ts.items():
        if t is not None:
            contiguous(t, name, k)
    same_device(name, ts)
    return check(ts)


def check_out(name: str, out: Tensor | None, shape: tuple[int, ...], dtype: np.dtype[Any],
              why: str) -> None:
    """Validate a caller-provided output against the expected shape and dtype."""
    if out is None:
        return
    if out.shape != shape:
        raise ShapeError(f"{name}: out has shape {out.shape}, expected {shape} ({why})", op=name)
    if out.dtype != dtype:
        raise DTypeError(f"{name}: out has dtype {out.dtype}, expected {dtype} ({why})", op=name)


OPTIONAL_ARGS = ("out", "bias", "kv_len", "block_table")


def require_tensors(name: str, args: Mapping[str, Any], optional: tuple[str, ...] = OPTIONAL_ARGS
                    ) -> None:
    """Refuse, at construction, a tensor argument that is ``None`` (unless optional: named
    in ``optional``, ``out`` or ``*_out``) or not a Tensor/Partition/DeviceOp.

    Raises:
        TypeError: naming the kernel and the argument. DeviceOp arguments are then
            consumed (the error is the report: no "never executed" warning).
    """
    for k, v in args.items():
        if v is None:
            if k in optional or k == "out" or k.endswith("_out"):
                continue
        elif is_deferred(v) or isinstance(v, Tensor | Partition):
            continue
        for o in args.values():
            if is_deferred(o):
                o._consume()
        as_tensor(v, name, k)  # raises the TypeError naming the argument


def build_op(name: str, args: dict[str, Any], check: Check, body: Body,
             optional: tuple[str, ...] = OPTIONAL_ARGS) -> KernelOp:
    """A KernelOp for a kernel whose output argument is ``args["out"]``.

    Arguments given as Tensors/Partitions are validated by ``check`` now, DeviceOp
    arguments once they have executed (still before anything of this op is launched).
    ``check`` also validates every tensor's layout and returns the output's shape and
    dtype; when ``out`` is ``None`` it is allocated (refused inside graph capture).
    ``body(ctx, tensors)`` launches. The op produces ``out`` in the form given.
    Every argument not named in ``optional`` is required: ``None`` or a value that is
    not a Tensor/Partition/DeviceOp raises ``TypeError`` naming it, at construction.

    When every argument is a Tensor (or ``None``), the check's result is looked up in the
    plan cache (:mod:`._plan`) first, and the op launches without re-deriving anything.
    """
    keys = tuple(args)
    vals = tuple(args.values())
    i_out = keys.index("out")
    if not plain_args(name, args, optional):
        return _general_op(name, keys, vals, i_out, check, body)
    given = {k: v for k, v in args.items() if v is not None}
    oshape, odt = cached(static_key(check), vals, lambda: checked(name, args, check))
    first = next(iter(given.values()))
    dev = first._storage.device
    out0 = vals[i_out]

    def run(ctx: ExecutionContext, *vs: Any) -> Any:
        stream = ctx.stream
        if stream.device is not dev:
            check_device(first, stream, name)
        if out0 is not None:
            body(ctx, given)
            return out0
        out_t = allocate(stream, oshape, odt, name)
        body(ctx, {**given, "out": out_t})
        return out_t

    return KernelOp.plain(name, run, vals)


def plain_args(name: str, args: Mapping[str, Any], optional: tuple[str, ...]) -> bool:
    """True if every argument is a Tensor or an allowed ``None`` (the plan-cache fast path).

    Raises:
        TypeError: a required argument is ``None`` or of a wrong kind (see
            :func:`require_tensors`).
    """
    for k, v in args.items():
        if v is None:
            if k in optional or k == "out" or k.endswith("_out"):
                continue
        elif type(v) is Tensor:
            continue
        require_tensors(name, args, optional)  # raises for a bad argument
        return False
    return True


def _general_op(name: str, keys: tuple[str, ...], vals: tuple[Any, ...], i_out: int,
                check: Check, body: Body) -> KernelOp:
    """build_op with Partition or DeviceOp arguments (checked once their values are known)."""

    def tensors(vs: tuple[Any, ...]) -> dict[str, Tensor | None]:
        return {k: None if v is None else as_tensor(v, name, k) for k, v in zip(keys, vs, strict=True)}

    def full_check(ts: Mapping[str, Tensor | None]) -> tuple[tuple[int, ...], np.dtype[Any]]:
        out: tuple[tuple[int, ...], np.dtype[Any]] = checked(name, ts, check)
        return out

    early = None if any(is_deferred(v) for v in vals) else full_check(tensors(vals))

    def run(ctx: ExecutionContext, *vs: Any) -> Any:
        ts = tensors(vs)
        oshape, odt = early if early is not None else full_check(ts)
        stream = ctx.stream
        for t in ts.values():
            if t is not None:
                check_device(t, stream, name)
        out_v = vs[i_out]
        if out_v is None:
            out_v = ts["out"] = allocate(stream, oshape, odt, name)
        body(ctx, {k: t for k, t in ts.items() if t is not None})
        return out_v

    return KernelOp(name, run, vals)


def noop(*_: Any) -> None:
    """A launch function that does nothing (the other backend's half of a launch)."""


# -- gemm ------------------------------------------------------------------------------------


def _gemm_op(name: str, a: Any, b: Any, out: Any, bias: Any, activation: str | None,
             alpha: float, beta: float, tf32: bool, trans_b: bool = False) -> KernelOp:
    if activation not in ACTIVATIONS:
        known = ", ".join(repr(k) for k in ACTIVATIONS)
        raise ValueError(f"{name}: unknown activation {activation!r}; use one of {known}")
    alpha, beta, tf32, trans_b = float(alpha), float(beta), bool(tf32), bool(trans_b)
    if not (math.isfinite(alpha) and math.isfinite(beta)):
        raise ValueError(f"{name}: alpha {alpha} and beta {beta} must be finite")
    if beta != 0.0 and out is None:
        raise ValueError(f"{name}: beta={beta} reads the previous output; pass out=")

    def check(ts: Mapping[str, Tensor | None]) -> tuple[tuple[int, ...], np.dtype[Any]]:
        at, bt, ot, bias_t = ts["a"], ts["b"], ts["out"], ts["bias"]
        assert at is not None and bt is not None
        res = gemm_check(
            at.shape, at.dtype, bt.shape, bt.dtype,
            out_shape=None if ot is None else ot.shape,
            out_dtype=None if ot is None else ot.dtype,
            bias_shape=None if bias_t is None else bias_t.shape,
            bias_dtype=None if bias_t is None else bias_t.dtype,
            activation=activation, op=name, trans_b=trans_b,
        )  # fmt: skip
        if ot is not None:
            for k, t in (("a", at), ("b", bt), ("bias", bias_t)):
                if t is not None and t._storage is ot._storage:
                    raise ShapeError(f"{name}: out {ot.shape} shares memory with {k} {t.shape}; "
                                     "write to a separate tensor", op=name)
        return res

    def body(ctx: ExecutionContext, ts: dict[str, Tensor]) -> None:
        at, bt, ot = ts["a"], ts["b"], ts["out"]
        bias_t = ts.get("bias")
        stream = ctx.stream
        ws = workspace_for(stream, gemm_workspace_nbytes(at.shape, bt.shape, at.dtype, trans_b), name)
        reads = [at, bt] + ([bias_t] if bias_t is not None else []) + ([ot] if beta != 0.0 else [])
        writes = [ot] + ([ws] if ws is not None else [])
        aa, ba, oa = at.array, bt.array, ot.array
        biasa = None if bias_t is None else bias_t.array

        def cpu() -> None:
            oa[...] = gemm_reference(aa, ba, bias=biasa, activation=activation, alpha=alpha,
                                     beta=beta, c=oa if beta != 0.0 else None, tf32=tf32,
                                     trans_b=trans_b)

        def cuda(native: Any) -> None:
            gemm_cuda(aa, ba, oa, bias=biasa, activation=activation, alpha=alpha, beta=beta,
                      tf32=tf32, trans_b=trans_b, workspace=None if ws is None else ws.array,
                      stream=native)

        launch(ctx, name, reads, writes, cpu, cuda)

    return build_op(name, {"a": a, "b": b, "out": out, "bias": bias}, check, body)


def gemm(
    a: Any,
    b: Any,
    out: Any = None,
    *,
    bias: Any = None,
    activation: str | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    tf32: bool = False,
    trans_b: bool = False,
) -> KernelOp:
    """``out = act(alpha * a @ b + beta * out + bias)``; produces ``out`` in the form given.

    Args:
        a: ``(*batch, M, K)`` Tensor, Partition, or DeviceOp producing one; float32,
            float16 or bfloat16, C-contiguous.
        b: ``(K, N)`` (shared by every batch entry) or ``(*batch, K, N)``, same dtype;
            with ``trans_b=True``, ``(N, K)`` or ``(*batch, N, K)``.
        out: optional ``(*batch, M, N)`` output of the same dtype (Tensor or Partition;
            a Partition is returned as a Partition, its tiling does not change the GEMM's
            own). Allocated when ``None`` (not allowed inside graph capture). Must not
            share memory with ``a``, ``b`` or ``bias``.
        bias: optional ``(N,)`` vector added to every row.
        activation: ``None``, ``"relu"``, ``"gelu"`` (tanh approximation) or ``"silu"``.
        alpha: scale of ``a @ b``.
        beta: scale of the previous ``out`` (read only when ``beta != 0``; needs ``out``).
        tf32: float32 inputs on tensor cores with operands rounded to tf32.
        trans_b: ``b`` is given as ``(N, K)`` (how checkpoints store a Linear weight) and
            read as its transpose without a copy, on every path.

    Returns:
        A :class:`KernelOp` producing ``out``.

    Raises:
        ShapeError: shapes do not fit (the message names them); before any launch.
        DTypeError: unsupported or mismatched dtypes; before any launch.
        ValueError: unknown activation, or ``beta != 0`` without ``out``.
        CaptureError: inside a graph capture, ``out`` is ``None`` or the stream's
            workspace is too small (see the module docstring).

    Example:
        >>> y = kernels.gemm(x, w, bias=b, activation="gelu").sync()
    """
    return _gemm_op("gemm", a, b, out, bias, activation, alpha, beta, tf32, trans_b)


def matmul(a: Any, b: Any, out: Any = None, *, trans_b: bool = False) -> KernelOp:
    """``out = a @ b`` (float32 accumulation); produces ``out`` in the form given.

    Same shapes, dtypes and argument forms as :func:`gemm` without the epilogue.

    Args:
        a: ``(*batch, M, K)`` Tensor, Partition, or DeviceOp producing one.
        b: ``(K, N)`` or ``(*batch, K, N)``, same dtype; ``(N, K)`` / ``(*batch, N, K)``
            with ``trans_b=True`` (read as its transpose, no copy).
        out: optional ``(*batch, M, N)`` output; allocated when ``None``.
        trans_b: ``b`` is given transposed (a Linear weight as stored).

    Returns:
        A :class:`KernelOp` producing ``out``.
    """
    return _gemm_op("matmul", a, b, out, None, None, 1.0, 0.0, False, trans_b)
