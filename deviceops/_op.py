"""DeviceOp: a lazy, single-use description of device work, and its combinators.

Constructing a DeviceOp runs nothing. It runs when executed, once:

| call                      | stream chosen by | blocks?                                        |
|---------------------------|------------------|------------------------------------------------|
| ``await op``              | default policy   | suspends the task only                         |
| ``op.sync()``             | default policy   | yes                                            |
| ``op.sync_on(stream)``    | the caller       | yes                                            |
| ``op.async_on(stream)``   | the caller       | no; output not yet safe to read                |
| ``op.schedule(policy)``   | the policy       | no; returns an awaitable ``DeviceFuture``      |
| ``op.graph()``            | default policy   | captures once; ``CudaGraph.launch()`` replays  |

Combinators build bigger ops: ``then`` (bind: the closure gets the output and
returns the next op, same stream), ``map`` (host transform), ``inspect``,
``shared`` (execute at most once, many consumers), ``zip``/``unzip``, ``value``.
Closures run when the op is *enqueued*, not when the device finishes. Their ops
live in :mod:`deviceops._combinators`; this module holds the base class, the
execution entry points and the iterative driver.

Like a coroutine, an op is consumed by execution: executing it twice raises
:class:`~deviceops.SchedulingError` (use ``shared()`` for several consumers),
and an op garbage-collected without ever being executed or composed emits a
``RuntimeWarning``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from . import _hooks
from ._context import ExecutionContext, enqueue_lock, guard, refuse_nested
from ._errors import DeviceError, SchedulingError
from ._tensor import failed_output_error, output_failure

if TYPE_CHECKING:
    from ._device import Device
    from ._future import DeviceFuture
    from ._stream import Stream
    from ._tensor import Tensor
    from .graphs import CudaGraph
    from .scheduling import SchedulingPolicy

__all__ = ["DeviceOp", "unzip", "value", "zip"]

T = TypeVar("T")
U = TypeVar("U")

_FRESH, _OWNED, _DONE = 0, 1, 2


def _current_policy() -> SchedulingPolicy:
    policy: SchedulingPolicy = _hooks.current_policy()  # installed by deviceops.scheduling
    return policy


_DeviceFuture: Any = None


def _future_cls() -> Any:
    global _DeviceFuture
    if _DeviceFuture is None:
        from ._future import DeviceFuture

        _DeviceFuture = DeviceFuture
    return _DeviceFuture


def _owned_error(op: DeviceOp[Any], what: str) -> SchedulingError:
    owner = _owner_name(getattr(op, "_owner", None))
    return SchedulingError(
        f"{what} on {op._describe()}: it was already passed to {owner}, which will execute it; "
        "a DeviceOp runs once. Execute the combinator instead, or use op.shared() to give the "
        "output to several consumers.",
        op=op._describe(),
    )


def _owner_name(by: Any) -> str:
    if by is None:
        return "another op"
    if isinstance(by, tuple):
        kind, fn = by
        return f"{kind}({_fn_name(fn)})"
    if isinstance(by, DeviceOp):
        return by._describe()
    return str(by)


def _run(op: DeviceOp[T], stream: Stream, policy: SchedulingPolicy | None, what: str) -> T:
    """Execute ``op`` as a top-level op on ``stream`` (the common path of every entry point)."""
    if guard.active is not None:
        op._consume()
        refuse_nested(f"{what} on {op._describe()}")
    if op._state == _OWNED and not op._multi_use:
        raise _owned_error(op, what)
    ctx = ExecutionContext(stream, policy)
    with enqueue_lock:
        guard.active = op
        seq0 = stream.seq
        try:
            if policy is not None and policy.auto_graph and stream.capture is None:
                got = _hooks.auto_graph(op, ctx)  # a repeated DAG: its graph replayed
                if got is not _hooks.MISS:
                    return got
            return op._exec(ctx)
        except BaseException:
            stream.absorb_after(seq0)  # the op raised: device failures of its partial work are its own
            raise
        finally:
            guard.active = None


def _check_output(out: Any, op: DeviceOp[Any]) -> None:
    """Raise if ``out`` holds a tensor whose producing device work failed (cpu backend)."""
    failed = output_failure(out)
    if failed is not None:
        raise failed_output_error(op._describe(), failed)


def _begin(op: DeviceOp[Any], ctx: ExecutionContext, sid: int) -> tuple[DeviceOp[Any], ...]:
    """Mark an ``_iterative`` op executed on stream ``sid``; return the ops it needs first.

    A second execution of a single-use op goes through ``_exec``, which raises the
    "already executed" error.
    """
    if op._state == _DONE and not op._multi_use:
        op._exec(ctx)
    op._state = _DONE
    op._ran_on = sid
    return op._deps(ctx)


def _drive(root: DeviceOp[T], ctx: ExecutionContext) -> T:
    """Execute ``root`` (already marked executed) and its argument DAG without recursion.

    Ops that are ``_iterative`` say which ops they need first (``_deps``, executed
    in order on ``ctx``) and how to finish with their values (``_finish``). Their
    dependencies are walked with an explicit stack, so a DAG nested 100,000 deep
    through kernel arguments, ``map``/``inspect``/``then`` chains or ``shared``
    does not hit Python's recursion limit. Other ops (``zip``) execute as usual.
    A ``_tail`` op's ``_finish`` returns the op to execute in its place (``then``).
    """
    deps = root._deps(ctx)
    if not deps:
        return root._finish(ctx, [])
    if len(deps) == 1 and not deps[0]._iterative:  # the common shallow case: no stack
        try:
            v = deps[0]._exec(ctx)
        except BaseException as exc:
            root._failed(exc)
            raise
        out: Any = root._finish(ctx, [v])
        return out._exec(ctx) if root._tail else out
    walk = _walk(root, deps, ctx)
    try:
        while True:
            next(walk)
    except StopIteration as done:
        return done.value


def _walk(root: DeviceOp[T], deps: tuple[DeviceOp[Any], ...], ctx: ExecutionContext
          ) -> Generator[None, None, T]:
    """The stack walk of :func:`_drive` (``root`` marked executed, ``deps`` its dependencies),
    as a generator that yields after each op it finishes; returns ``root``'s output.

    :func:`_drive` runs it through; a ``zip`` whose branches run on several devices steps its
    branches' walks in turn, so that every device gets work from the first op on.
    """
    if not deps:
        out0: Any = root._finish(ctx, [])
        return out0._exec(ctx) if root._tail else out0
    sid = ctx.stream.id
    stack: list[list[Any]] = [[root, deps, []]]  # frames: [op, its deps, their values so far]
    try:
        while True:
            fr = stack[-1]
            vals = fr[2]
            deps = fr[1]
            i = len(vals)
            if i < len(deps):
                k = deps[i]
                if k._iterative:
                    kd = _begin(k, ctx, sid)
                    if kd:
                        stack.append([k, kd, []])
                        continue
                    vals.append(k._finish(ctx, []))  # (an op without deps is not a tail)
                else:
                    vals.append(k._exec(ctx))
                continue
            stack.pop()
            node = fr[0]
            out = node._finish(ctx, vals)
            yield
            if node._tail:  # execute the returned op in node's place
                nxt = out
                if nxt._iterative:
                    kd = _begin(nxt, ctx, sid)
                    if kd:
                        stack.append([nxt, kd, []])
                        continue
                    out = nxt._finish(ctx, [])
                else:
                    out = nxt._exec(ctx)
            if not stack:
                return out
            stack[-1][2].append(out)
    except GeneratorExit:  # closed by a zip whose other branch failed: not this walk's failure
        raise
    except BaseException as exc:
        for fr in stack:
            fr[0]._failed(exc)
        raise


class DeviceOp(Generic[T]):
    """A lazy description of device work producing a ``T``. See the module table.

    Subclasses implement :meth:`_execute`, which enqueues work on ``ctx.stream``
    and returns the output handle (valid once the stream reaches that point).

    Example:
        >>> z = api.zeros((16, 16))
        >>> y = z.then(lambda t: kernels.add(t, t))
        >>> y.sync().shape
        (16, 16)
    """

    __slots__ = ("__weakref__", "_owner", "_ran_on", "_state")
    _state: int
    _ran_on: int
    # Iterative execution (see _drive): ops that set _iterative implement _deps and
    # _finish; _tail: _finish returns an op to execute in this op's place (then).
    _iterative = False
    _tail = False
    _multi_use = False

    def __init__(self) -> None:
        self._state = _FRESH
        self._ran_on = 0

    # -- to implement -------------------------------------------------------------
    def _execute(self, ctx: ExecutionContext) -> T:
        """Enqueue this op's work on ``ctx.stream`` and return its output handle."""
        raise NotImplementedError(f"{type(self).__name__} does not implement _execute")

    def _children(self) -> tuple[DeviceOp[Any], ...]:
        """Ops this op executes (for ``to_dot``)."""
        return ()

    def _describe(self) -> str:
        return type(self).__name__

    def _compile_key(self) -> Any:
        """What identifies the programs executing this op may compile: ``await`` runs an
        op whose key it has not seen complete without a compile off the event loop's thread
        (:mod:`deviceops._offload`). Kernel launchers with a plan refine it per signature."""
        return (type(self), self._describe())

    def _deps(self, ctx: ExecutionContext) -> tuple[DeviceOp[Any], ...]:
        """(iterative ops) the ops to execute first, in order, on ``ctx``."""
        return ()

    def _finish(self, ctx: ExecutionContext, vals: list[Any]) -> T:
        """(iterative ops) the output, given the values of :meth:`_deps`."""
        return self._execute(ctx)

    def _source(self) -> Device | None:
        """The device of the tensor this op copies out of (``to_host``, ``memcpy``), where
        it runs under every policy; ``None`` for every other op."""
        return None

    def _inputs(self) -> tuple[Tensor, ...]:
        """The tensors this op was given directly (placement; see :mod:`._placement`)."""
        return ()

    def _pin(self) -> tuple[Device | None, bool]:
        """(a device this op runs on whatever its inputs, whether to stop the placement walk
        here): ``(None, False)`` unless the op says otherwise (``to_device``, ``zip``)."""
        return (None, False)

    def _failed(self, exc: BaseException) -> None:
        """(iterative ops) a dependency raised ``exc`` while this op was executing."""

    # -- internal execution -----------------------------------------------------------
    def _exec(self, ctx: ExecutionContext) -> T:
        if self._state == _DONE:
            raise SchedulingError(
                f"{self._describe()} was already executed; a DeviceOp runs once. "
                "Use op.shared() to give its output to several consumers.",
                op=self._describe(),
            )
        self._state = _DONE
        self._ran_on = ctx.stream.id
        return self._execute(ctx)

    def _adopt(self, by: Any = None) -> DeviceOp[T]:
        """Mark this op as consumed by a combinator (which now owns the warning).

        ``by`` names the consumer for error messages: a string, an op, or
        ``(kind, fn)``.
        """
        if self._state != _FRESH:
            if self._state == _DONE:
                what = "executed"
            else:
                what = f"passed to {_owner_name(getattr(self, '_owner', None))}"
            user = f" to {_owner_name(by)}" if by is not None else ""
            raise SchedulingError(
                f"cannot pass {self._describe()}{user}: it was already {what}; a DeviceOp "
                "runs once. Use op.shared() to give its output to several consumers.",
                op=self._describe(),
            )
        self._state = _OWNED
        if by is not None:
            self._owner = by
        return self

    def _consume(self) -> None:
        """Mark a fresh op as spent without running it (its use failed and was reported)."""
        if self._state == _FRESH:
            self._state = _OWNED

    def __del__(self) -> None:
        if getattr(self, "_state", _DONE) == _FRESH:
            warnings.warn(
                f"DeviceOp {self._describe()} was never executed; call .sync(), "
                "await it, or pass it to another op",
                RuntimeWarning,
                stacklevel=2,
            )

    def __repr__(self) -> str:
        state = ("fresh", "composed", "executed")[self._state]
        return f"<DeviceOp {self._describe()} ({state})>"

    # -- execution ------------------------------------------------------------------------
    def sync(self) -> T:
        """Execute on a stream of the default policy and block until done.

        Raises:
            DeviceError: enqueueing failed, or the device reported a failure of
                this op's work (or of an op whose output it consumed).
        """
        policy = _current_policy()
        stream = _stream_for(policy, self)
        out = _run(self, stream, policy, "sync()")
        _finish_sync(self, stream, out)
        return out

    def sync_on(self, stream: Stream) -> T:
        """Execute on ``stream`` and block until it is done."""
        out = _run(self, stream, None, "sync_on()")
        _finish_sync(self, stream, out)
        return out

    def async_on(self, stream: Stream) -> T:
        """Enqueue on ``stream`` and return at once; the output is not yet safe to read."""
        return _run(self, stream, None, "async_on()")

    def schedule(self, policy: SchedulingPolicy | None = None) -> DeviceFuture[T]:
        """Enqueue on a stream of ``policy`` (default policy if ``None``); return a future.

        Errors raised while enqueuing are stored in the future (``result()``
        and ``await`` raise them), as for :class:`concurrent.futures.Future`.
        """
        if policy is None:
            policy = _current_policy()
        if guard.active is not None:
            self._consume()
            refuse_nested(f"schedule() on {self._describe()}")
        stream = _stream_for(policy, self)
        try:
            out = _run(self, stream, policy, "schedule()")
        except Exception as exc:
            return _future_cls()._failed(exc, stream)
        ev = stream.record_event()
        fut = _future_cls()._pending(out, stream, ev)
        fut._op = self
        if policy.counts_enqueued:
            policy.enqueued(stream, ev)
        return fut

    def __await__(self) -> Generator[Any, None, T]:
        return _hooks.await_op(self).__await__()

    def graph(self) -> CudaGraph[T]:
        """Capture this op into a CUDA graph on a stream of the default policy."""
        return _hooks.capture(self, None)

    def graph_on(self, stream: Stream) -> CudaGraph[T]:
        """Capture this op into a CUDA graph on ``stream``."""
        return _hooks.capture(self, stream)

    # -- combinators --------------------------------------------------------------------
    def then(self, fn: Callable[[T], DeviceOp[U]]) -> DeviceOp[U]:
        """Bind: ``fn(output)`` returns the next op, run after this one on the same stream."""
        if not callable(fn):
            _not_callable("then", fn, "a function taking the output and returning the next DeviceOp")
        return _Then(self._adopt(("then", fn)), fn)

    def map(self, fn: Callable[[T], U]) -> DeviceOp[U]:
        """Transform the output handle on the host (no device work)."""
        if not callable(fn):
            _not_callable("map", fn, "a function taking the output and returning the new value")
        return _Map(self._adopt(("map", fn)), fn)

    def inspect(self, fn: Callable[[T], object]) -> DeviceOp[T]:
        """Call ``fn(output)`` when enqueued (e.g. to log) and pass the output on."""
        if not callable(fn):
            _not_callable("inspect", fn, "a function taking the output (its result is ignored)")
        return _Inspect(self._adopt(("inspect", fn)), fn)

    def shared(self) -> SharedOp[T]:
        """An op that executes this one at most once; every consumer gets the same output."""
        return SharedOp(self._adopt("shared()"))

    def zip(self, *others: DeviceOp[Any]) -> DeviceOp[tuple[Any, ...]]:
        """``deviceops.zip(self, *others)``."""
        return zip(self, *others)

    def to_dot(self) -> str:
        """The DAG in Graphviz dot; executed ops are labelled with their stream."""
        from ._dot import to_dot

        return to_dot(self)


def _stream_for(policy: SchedulingPolicy, op: DeviceOp[Any]) -> Stream:
    """The policy's stream for ``op`` (placing policies look at its data); a refusal
    consumes the op (the error is the report). A copy out of a tensor (``op._source()``)
    runs on the source's device whatever the policy: on the policy's stream when it is
    there, else on one of the policy's streams of that device, else on the device's own
    stream."""
    src = op._source()
    if src is not None:
        return _source_stream(policy, op, src)
    try:
        return policy.stream_for(op)
    except BaseException:
        op._consume()
        raise


def _source_stream(policy: SchedulingPolicy, op: DeviceOp[Any], src: Device) -> Stream:
    try:
        stream = policy.stream_for(op)
    except DeviceError:  # a placing policy that does not cover the source's device
        stream = None
    if stream is not None and stream.device is src:
        return stream
    on = getattr(policy, "stream_on", None)
    if on is not None:
        with contextlib.suppress(DeviceError):
            picked: Stream = on(src)
            return picked
    return src.own_stream()


def _finish_sync(op: DeviceOp[Any], stream: Stream, out: Any) -> None:
    try:
        stream.synchronize()
    except DeviceError as exc:
        exc.add_note(f"deviceops: raised by the device work of {op._describe()} (or of work it "
                     f"waited for) on {stream!r}")
        raise
    _check_output(out, op)


def _not_callable(what: str, fn: Any, expected: str) -> None:
    raise TypeError(f"{what}: fn must be callable ({expected}), got {type(fn).__name__} "
                    f"{fn!r}; pass a function or lambda")


def _fn_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)


# The combinators' ops live in _combinators (which imports DeviceOp from here): imported
# last, once DeviceOp exists; DeviceOp's combinator methods use them.
from ._combinators import (  # noqa: E402
    SharedOp,
    _Inspect,
    _Map,
    _Then,
    unzip,
    value,
    zip,
)
