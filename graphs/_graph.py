"""CudaGraph: capture a DeviceOp once, replay it with one call.

``op.graph()`` / ``op.graph_on(stream)``:

1. synchronizes the stream's device, so everything enqueued before the
   capture is complete and needs no ordering inside the graph;
2. starts a capture through the stream's backend (``Backend.begin_capture``;
   cuda: a *relaxed* stream capture; cpu: the stream records its tasks
   instead of running them) and enqueues ``op`` on it. Work the op forks
   onto other streams (a ``zip`` under a multi-stream policy) joins the capture
   through its events and is captured as parallel branches; every such
   stream is joined back before the capture ends;
3. refuses ops that allocate (:class:`~deviceops.CaptureError` names the op
   and the fix: allocate before capturing), and ``sync()``/``await`` inside
   the capture (:class:`~deviceops.NestedExecutionError`);
4. on any failure ends the capture, frees the partial graph, restores the
   streams and re-raises, so the library keeps working.

A launch is ordered, like any op, after other streams' conflicting use of the
tensors the graph touches, and the graph keeps those tensors alive.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, TypeVar

from deviceops import _hooks
from deviceops._capture import CaptureState
from deviceops._context import ExecutionContext, enqueue_lock, guard, refuse_nested
from deviceops._errors import CaptureError, SchedulingError
from deviceops._op import _OWNED, DeviceOp, _owned_error
from deviceops._storage import ordered

if TYPE_CHECKING:
    from deviceops._stream import Stream

__all__ = ["CudaGraph", "capture", "capture_locked"]

T = TypeVar("T")


class CudaGraph(Generic[T]):
    """A captured DeviceOp, replayable with one driver call per launch.

    Example:
        >>> x = api.zeros((8,)).sync(); one = api.ones((8,)).sync()
        >>> g = kernels.add(x, one, out=x).graph()   # x += 1 per replay
        >>> for _ in range(3):
        ...     g.launch()
        >>> g.synchronize()

    Attributes:
        stream: the stream it was captured on; ``launch()`` and ``update()`` use it.
    """

    def __init__(self, stream: Stream, output: T, native: Any, state: CaptureState) -> None:
        self.stream = stream
        self._output: Any = output
        self._taken = False
        self._native = native
        self._state = state
        self._reads = [st for st, w in state.storages.values() if not w]
        self._writes = [st for st, w in state.storages.values() if w]
        self.launches = 0

    def __repr__(self) -> str:
        size = self.stream.backend.graph_size(self._native, self._state.tasks)
        n = "?" if size is None else size
        return f"<CudaGraph of {self._state.op_name} on {self.stream!r}, {n} tasks, {self.launches} launches>"

    def take_output(self) -> T:
        """The captured op's output handle (the tensors each replay writes). Once only."""
        if self._taken:
            raise SchedulingError("take_output: the graph's output was already taken")
        self._taken = True
        return self._output

    def update(self, op: DeviceOp[Any]) -> Any:
        """Run ``op`` on the graph's stream now (e.g. ``api.memcpy(captured_input, new)``).

        Being on the same stream, it is ordered before the next ``launch()``.
        Returns the op's output.
        """
        return op.async_on(self.stream)

    def _replay(self, ctx: ExecutionContext) -> None:
        stream = ctx.stream
        if stream.device is not self.stream.device:
            raise SchedulingError(f"CudaGraph captured on {self.stream.device} cannot launch on {stream.device}")
        if stream.capture is not None:
            raise CaptureError("launching a CudaGraph inside another capture is not supported",
                               op=self._state.op_name)
        ordered(stream, self._reads, self._writes, stream.backend.replay, stream, self._native,
                self._state.tasks)
        self.launches += 1

    def launch(self) -> None:
        """Enqueue one replay on :attr:`stream` now; does not block."""
        refuse_nested("CudaGraph.launch()")
        with enqueue_lock:
            self._replay(ExecutionContext(self.stream, None))  # (the policy: resolved if asked)

    def launch_op(self) -> DeviceOp[T]:
        """A DeviceOp that replays the graph on the stream it executes on; produces the output."""
        return _LaunchOp(self)

    def synchronize(self) -> None:
        """Block until every replay enqueued on :attr:`stream` has finished."""
        self.stream.synchronize()


def _policy() -> Any:
    from deviceops.scheduling import current_policy

    return current_policy()


class _LaunchOp(DeviceOp[Any]):
    __slots__ = ("_graph",)

    def __init__(self, graph: CudaGraph[Any]) -> None:
        super().__init__()
        self._graph = graph

    def _execute(self, ctx: ExecutionContext) -> Any:
        self._graph._replay(ctx)
        return self._graph._output

    def _pin(self) -> tuple[Any, bool]:
        return (self._graph.stream.device, True)  # a graph replays on the device it was captured on

    def _describe(self) -> str:
        return f"graph_launch({self._graph._state.op_name})"


def capture(op: DeviceOp[T], stream: Stream | None) -> CudaGraph[T]:
    """Capture ``op`` on ``stream`` (default: a stream of the current policy)."""
    refuse_nested(f"graph() of {op._describe()}")
    if op._state == _OWNED and not op._multi_use:
        raise _owned_error(op, "graph()")
    policy = None
    if stream is None:
        policy = _policy()
        try:
            stream = policy.stream_for(op)
        except BaseException:
            op._consume()
            raise
    if stream.capture is not None:
        raise CaptureError(f"{stream!r} is already capturing", op=op._describe())
    with enqueue_lock:
        prev = guard.active
        try:
            return capture_locked(op, stream, policy)
        finally:
            guard.active = prev


def capture_locked(op: DeviceOp[T], stream: Stream, policy: Any, *, allocates: bool = False
                   ) -> CudaGraph[T]:
    """The capture itself (``enqueue_lock`` held, ``stream`` not capturing); leaves
    ``guard.active`` at ``None``. ``allocates``: ops may allocate their outputs inside the
    capture (the graph keeps them: :mod:`._auto`)."""
    stream.device.synchronize()
    state = CaptureState(stream, op._describe())
    state.allocates = allocates
    ctx = ExecutionContext(stream, policy)
    backend = stream.backend
    stream.capture = state
    began = False
    guard.active = f"the graph capture of {op._describe()}"
    try:
        backend.begin_capture(stream)
        began = True
        out = op._exec(ctx)
        for member in state.members[1:]:
            stream.wait_event(member.record_event())
        native = backend.end_capture(stream)
        began = False
    except BaseException as exc:
        if began:
            backend.abort_capture(stream)
        exc.add_note(f"deviceops: raised while capturing {op._describe()} into a graph; "
                     "the capture was ended and the partial graph freed")
        raise
    finally:
        guard.active = None
        for member in state.members:
            member.capture = None
    return CudaGraph(stream, out, native, state)


def host_task(fn: Any, name: str = "host_func") -> DeviceOp[None]:
    """A DeviceOp that calls ``fn()`` on a host thread when its stream reaches it.

    Inside a graph it becomes a host node and fires on every replay. ``fn`` must
    not block on the device: executing a DeviceOp (``sync()``, ``sync_on()``,
    ``await``...) inside it raises :class:`~deviceops.NestedExecutionError`
    (waiting on its own stream would deadlock).
    """
    from deviceops._api_op import _ApiOp

    if not callable(fn):
        raise TypeError(f"host_task: fn must be callable, got {type(fn).__name__} {fn!r}")

    def run(ctx: ExecutionContext) -> None:
        where = f"host_task {name} on {ctx.stream!r}"

        def guarded() -> None:
            prev = guard.active
            guard.active = where
            try:
                fn()
            finally:
                guard.active = prev

        ctx.stream.launch_host_func(guarded)
        ctx.stream.bump()

    return _ApiOp(name, run)


_hooks.install(capture=capture)  # DeviceOp.graph() / graph_on()
