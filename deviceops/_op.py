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
Closures run when the op is *enqueued*, not when the device finishes.

Like a coroutine, an op is consumed by execution: executing it twice raises
:class:`~deviceops.SchedulingError` (use ``shared()`` for several consumers),
and an op garbage-collected without ever being executed or composed emits a
``RuntimeWarning``.
"""

from __future__ import annotations

import builtins
import warnings
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

from . import _hooks
from ._context import ExecutionContext, enqueue_lock, guard, refuse_nested
from ._errors import DeviceError, SchedulingError
from ._tensor import failed_output_error, output_failure

if TYPE_CHECKING:
    from ._future import DeviceFuture
    from ._stream import Stream
    from .graphs import CudaGraph
    from .scheduling import SchedulingPolicy

__all__ = ["DeviceOp", "unzip", "value", "zip"]

T = TypeVar("T")
U = TypeVar("U")

_FRESH, _OWNED, _DONE = 0, 1, 2
_bzip = builtins.zip


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

    def _deps(self, ctx: ExecutionContext) -> tuple[DeviceOp[Any], ...]:
        """(iterative ops) the ops to execute first, in order, on ``ctx``."""
        return ()

    def _finish(self, ctx: ExecutionContext, vals: list[Any]) -> T:
        """(iterative ops) the output, given the values of :meth:`_deps`."""
        return self._execute(ctx)

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
        stream = policy.next_stream()
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
        stream = policy.next_stream()
        try:
            out = _run(self, stream, policy, "schedule()")
        except Exception as exc:
            return _future_cls()._failed(exc, stream)
        fut = _future_cls()._pending(out, stream, stream.record_event())
        fut._op = self
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


class _Value(DeviceOp[T]):
    __slots__ = ("_value",)

    def __init__(self, v: T) -> None:
        super().__init__()
        self._value = v

    def _execute(self, ctx: ExecutionContext) -> T:
        return self._value

    def _describe(self) -> str:
        return f"value({type(self._value).__name__})"


def value(x: T) -> DeviceOp[T]:
    """An op that produces ``x`` without device work."""
    return _Value(x)


def _fn_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)


class _Then(DeviceOp[U]):
    __slots__ = ("_fn", "_next", "_src", "_srcs")
    _iterative = True
    _tail = True

    def __init__(self, src: DeviceOp[Any], fn: Callable[[Any], DeviceOp[U]]) -> None:
        super().__init__()
        self._src = src
        self._srcs = (src,)
        self._fn = fn
        self._next: DeviceOp[U] | None = None

    def _execute(self, ctx: ExecutionContext) -> U:
        # a.then(f1).then(f2)...: nested through _src; _drive walks it without recursion.
        src = self._src
        if not src._iterative:  # shallow: no stack
            nxt: DeviceOp[U] = self._finish(ctx, [src._exec(ctx)])
            return nxt._exec(ctx)
        return _drive(self, ctx)

    def _deps(self, ctx: ExecutionContext) -> tuple[DeviceOp[Any], ...]:
        return self._srcs

    def _finish(self, ctx: ExecutionContext, vals: list[Any]) -> Any:
        nxt = self._fn(vals[0])
        if not isinstance(nxt, DeviceOp):
            raise TypeError(
                f"then: closure {_fn_name(self._fn)} returned {type(nxt).__name__}, not a "
                "DeviceOp; use .map() for a host-side transform"
            )
        self._next = nxt
        return nxt

    def _children(self) -> tuple[DeviceOp[Any], ...]:
        return (self._src,) if self._next is None else (self._src, self._next)

    def _describe(self) -> str:
        return f"then({_fn_name(self._fn)})"


class _Map(DeviceOp[U]):
    __slots__ = ("_fn", "_src", "_srcs")
    _iterative = True

    def __init__(self, src: DeviceOp[Any], fn: Callable[[Any], U]) -> None:
        super().__init__()
        self._src = src
        self._srcs = (src,)
        self._fn = fn

    def _execute(self, ctx: ExecutionContext) -> U:
        src = self._src
        if not src._iterative:  # shallow: no stack
            return self._fn(src._exec(ctx))
        return _drive(self, ctx)

    def _deps(self, ctx: ExecutionContext) -> tuple[DeviceOp[Any], ...]:
        return self._srcs

    def _finish(self, ctx: ExecutionContext, vals: list[Any]) -> U:
        return self._fn(vals[0])

    def _children(self) -> tuple[DeviceOp[Any], ...]:
        return (self._src,)

    def _describe(self) -> str:
        return f"map({_fn_name(self._fn)})"


class _Inspect(DeviceOp[T]):
    __slots__ = ("_fn", "_src", "_srcs")
    _iterative = True

    def __init__(self, src: DeviceOp[T], fn: Callable[[T], object]) -> None:
        super().__init__()
        self._src = src
        self._srcs = (src,)
        self._fn = fn

    def _execute(self, ctx: ExecutionContext) -> T:
        src = self._src
        if not src._iterative:  # shallow: no stack
            out = src._exec(ctx)
            self._fn(out)
            return out
        return _drive(self, ctx)

    def _deps(self, ctx: ExecutionContext) -> tuple[DeviceOp[Any], ...]:
        return self._srcs

    def _finish(self, ctx: ExecutionContext, vals: list[Any]) -> T:
        out: T = vals[0]
        self._fn(out)
        return out

    def _children(self) -> tuple[DeviceOp[Any], ...]:
        return (self._src,)

    def _describe(self) -> str:
        return f"inspect({_fn_name(self._fn)})"


class SharedOp(DeviceOp[T]):
    """Executes its source at most once; may be executed by any number of consumers.

    Every execution returns the same output. A consumer on another stream is
    ordered after the source's work (tensors by their hazard records, other
    outputs by an event), so it never sees a half-written result. An error
    raised by the source reaches every consumer: raised while enqueuing, it is
    re-raised to each; reported by the device (cpu backend), every later
    consumer's stream is failed with it too, and the output tensors remember it.
    """

    __slots__ = ("_error", "_latch", "_out", "_ran", "_src", "_where")
    _iterative = True
    _multi_use = True

    def __init__(self, src: DeviceOp[T]) -> None:
        super().__init__()
        self._src = src
        self._ran = False
        self._out: Any = None
        self._error: BaseException | None = None
        self._where: tuple[Stream, int] | None = None
        self._latch: Any = None

    def _adopt(self, by: Any = None) -> DeviceOp[T]:
        if self._state == _FRESH:
            self._state = _OWNED
        return self

    def _exec(self, ctx: ExecutionContext) -> T:
        self._state = _DONE
        return _drive(self, ctx)

    def _deps(self, ctx: ExecutionContext) -> tuple[DeviceOp[Any], ...]:
        if self._ran:
            return ()
        self._ran = True
        self._ran_on = ctx.stream.id
        return (self._src,)

    def _failed(self, exc: BaseException) -> None:
        if self._error is None and self._where is None:
            self._error = exc

    def _finish(self, ctx: ExecutionContext, vals: list[Any]) -> T:
        stream = ctx.stream
        if vals:  # the first execution
            self._out = vals[0]
            self._where = (stream, stream.seq)
            if stream.capture is None:
                self._latch = stream.latch_error()  # None where the backend latches nothing
            return self._out
        if self._error is not None:
            raise self._error
        if self._where is not None:
            stream.wait_for(*self._where)
            if self._latch is not None and stream.capture is None:
                stream.check_latch(self._latch, self._describe())
        return self._out

    def shared(self) -> SharedOp[T]:
        return self

    def _children(self) -> tuple[DeviceOp[Any], ...]:
        return (self._src,)

    def _describe(self) -> str:
        return f"shared({self._src._describe()})"


class _Zip(DeviceOp[tuple[Any, ...]]):
    __slots__ = ("_ops", "_streams")

    def __init__(self, ops: tuple[DeviceOp[Any], ...]) -> None:
        super().__init__()
        self._ops = ops
        self._streams: list[int] = []

    def _execute(self, ctx: ExecutionContext) -> tuple[Any, ...]:
        ops = self._ops
        home = ctx.stream
        if len(ops) <= 1:
            return tuple(op._exec(ctx) for op in ops)
        streams = [home]
        for _ in ops[1:]:
            s = ctx.policy.next_stream()
            streams.append(home if s.device is not home.device and not _multi(ctx) else s)
        others = {s.id: s for s in streams if s is not home}
        if others:
            fork = home.record_event()
            for s in others.values():
                s.wait_event(fork)
        marks = [(s, s.seq) for s in others.values()]
        outs = []
        try:
            for op, s in _bzip(ops, streams):
                outs.append(op._exec(ctx if s is home else ctx.on(s)))
        except BaseException:
            for s, q in marks:  # the zip raised: its branches' device failures are its own
                s.absorb_after(q)
            raise
        finally:
            # Join every branch back, also when one failed to enqueue: the
            # home stream must not run ahead of work already on the others.
            # A failure the device reports on a branch reaches the home stream
            # through this wait (cpu: the event carries the branch's error).
            for s in others.values():
                ev = s.record_event()
                ev.hand_over_error()  # the join takes the branch's error (cpu)
                home.wait_event(ev)
        self._streams = [s.id for s in streams]
        return tuple(outs)

    def _children(self) -> tuple[DeviceOp[Any], ...]:
        return self._ops

    def _describe(self) -> str:
        return f"zip[{len(self._ops)}]"


def _multi(ctx: ExecutionContext) -> bool:
    return bool(getattr(ctx.policy, "spans_devices", False))


def zip(*ops: DeviceOp[Any]) -> DeviceOp[tuple[Any, ...]]:
    """An op producing the tuple of the outputs of ``ops``.

    Branches run on streams drawn from the executing context's policy, forked
    from and joined back to its stream with events, so independent branches
    overlap on the device; under ``SingleStream`` they run in order. A failure
    on any branch (raised while enqueuing, or reported by the device) reaches
    the join and the caller.
    """
    try:
        seen: set[int] = set()
        for i, op in enumerate(ops):
            if not isinstance(op, DeviceOp):
                raise TypeError(f"zip: argument {i} is {type(op).__name__}, not a DeviceOp; wrap "
                                "plain values with deviceops.value(x)")
            if id(op) in seen and not op._multi_use:
                raise SchedulingError(f"zip: argument {i} ({op._describe()}) is passed twice; a "
                                      "DeviceOp runs once. Use op.shared() to pass it several "
                                      "times.", op=op._describe())
            seen.add(id(op))
            if op._state != _FRESH and not op._multi_use:
                op._adopt("zip")  # raises, naming its first use
    except BaseException:
        for op in ops:  # refused: the error is the report (no "never executed" warnings)
            if isinstance(op, DeviceOp):
                op._consume()
        raise
    return _Zip(tuple(op._adopt("zip") for op in ops))


class _Index(DeviceOp[Any]):
    __slots__ = ("_i", "_n", "_src", "_srcs")
    _iterative = True

    def __init__(self, src: SharedOp[Any], i: int, n: int) -> None:
        super().__init__()
        self._src = src
        self._srcs = (src,)
        self._i = i
        self._n = n

    def _execute(self, ctx: ExecutionContext) -> Any:
        return _drive(self, ctx)

    def _deps(self, ctx: ExecutionContext) -> tuple[DeviceOp[Any], ...]:
        return self._srcs

    def _finish(self, ctx: ExecutionContext, vals: list[Any]) -> Any:
        out = vals[0]
        if not isinstance(out, tuple | list) or len(out) != self._n:
            got = f"{type(out).__name__} of length {len(out)}" if isinstance(out, tuple | list) else type(out).__name__
            raise TypeError(f"unzip: expected a tuple of {self._n} outputs, got {got}")
        return out[self._i]

    def _children(self) -> tuple[DeviceOp[Any], ...]:
        return (self._src,)

    def _describe(self) -> str:
        return f"unzip[{self._i}/{self._n}]"


def unzip(op: DeviceOp[tuple[Any, ...]], n: int) -> tuple[DeviceOp[Any], ...]:
    """Split an op producing an ``n``-tuple into ``n`` ops; the source executes once."""
    if not isinstance(op, DeviceOp):
        raise TypeError(f"unzip: op must be a DeviceOp producing a tuple, got {type(op).__name__}")
    if isinstance(n, bool) or not isinstance(n, int | np.integer):
        raise TypeError(f"unzip: n must be an int (the tuple's length), got {type(n).__name__} {n!r}")
    if n < 1:
        raise ValueError(f"unzip: n must be >= 1 (the tuple's length), got {n}")
    src = op.shared()
    return tuple(_Index(src, i, int(n)) for i in range(n))
