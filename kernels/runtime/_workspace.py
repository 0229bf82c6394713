"""The per-stream kernel workspace: device scratch that kernel ops on one stream share.

Some problem shapes run faster with a workspace: GEMM's split-K partial sums
(:func:`deviceops.kernels.gemm.gemm_workspace_nbytes`), flash attention's split-KV decode
(:func:`deviceops.kernels.attention.attention_workspace_nbytes`). Each stream keeps one workspace that
kernel ops share (work on one stream is ordered, so they never overlap); it grows, outside
graph capture, to the largest size an op on that stream has needed. Memory cannot be
allocated inside a capture, so an op captured on a stream whose workspace is too small
raises :class:`~deviceops.CaptureError`; the fix is to run the same op once on that stream
before capturing (a warm-up, as with any CUDA-graph capture), or to call
:func:`reserve_workspace` first. Both backends keep the same books, so a capture that would
fail on a GPU fails the same way on the ``cpu`` backend.
"""

from __future__ import annotations

from deviceops.extend import CaptureError, Stream, Tensor, allocate, enqueue_lock, float32

__all__ = ["reserve_workspace", "workspace_for"]

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
