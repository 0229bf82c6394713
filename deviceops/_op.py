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

from ._async import await_op as _await_op
from ._context import ExecutionContext, enqueue_lock, guard, refuse_nested
from ._errors import SchedulingError

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


_policy_fn: Any = None


def _current_policy() -> SchedulingPolicy:
    global _policy_fn
    if _policy_fn is None:  # bound on first use: scheduling imports this module
        from .scheduling import current_policy

        _policy_fn = current_policy
    return _policy_fn()


_DeviceFuture: Any = None


def _future_cls() -> Any:
    global _DeviceFuture
    if _DeviceFuture is None:
        from ._future import DeviceFuture

        _DeviceFuture = DeviceFuture
    return _DeviceFuture


def _run(op: DeviceOp[T], stream: Stream, policy: SchedulingPolicy | None, what: str) -> T:
    """Execute ``op`` as a top-level op on ``stream`` (the common path of every entry point)."""
    if guard.active is not None:
        op._consume()
        refuse_nested(f"{what} on {op._describe()}")
    ctx = ExecutionContext(stream, policy)
    with enqueue_lock:
        guard.active = op
        try:
            return op._exec(ctx)
        finally:
            guard.active = None


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

    __slots__ = ("__weakref__", "_ran_on", "_state")
    _state: int
    _ran_on: int

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

    def _adopt(self) -> DeviceOp[T]:
        """Mark this op as consumed by a combinator (which now owns the warning)."""
        if self._state != _FRESH:
            what = "executed" if self._state == _DONE else "used by another op"
            raise SchedulingError(
                f"{self._describe()} was already {what}; a DeviceOp runs once. "
                "Use op.shared() to give its output to several consumers.",
                op=self._describe(),
            )
        self._state = _OWNED
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
        """Execute on a stream of the default policy and block until done."""
        policy = _current_policy()
        stream = policy.next_stream()
        out = _run(self, stream, policy, "sync()")
        stream.synchronize()
        return out

    def sync_on(self, stream: Stream) -> T:
        """Execute on ``stream`` and block until it is done."""
        out = _run(self, stream, None, "sync_on()")
        stream.synchronize()
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
        return _future_cls()._pending(out, stream, stream.record_event())

    def __await__(self) -> Generator[Any, None, T]:
        return _await_op(self).__await__()

    def graph(self) -> CudaGraph[T]:
        """Capture this op into a CUDA graph on a stream of the default policy."""
        from .graphs import capture

        return capture(self, None)

    def graph_on(self, stream: Stream) -> CudaGraph[T]:
        """Capture this op into a CUDA graph on ``stream``."""
        from .graphs import capture

        return capture(self, stream)

    # -- combinators --------------------------------------------------------------------
    def then(self, fn: Callable[[T], DeviceOp[U]]) -> DeviceOp[U]:
        """Bind: ``fn(output)`` returns the next op, run after this one on the same stream."""
        return _Then(self._adopt(), fn)

    def map(self, fn: Callable[[T], U]) -> DeviceOp[U]:
        """Transform the output handle on the host (no device work)."""
        return _Map(self._adopt(), fn)

    def inspect(self, fn: Callable[[T], object]) -> DeviceOp[T]:
        """Call ``fn(output)`` when enqueued (e.g. to log) and pass the output on."""
        return _Inspect(self._adopt(), fn)

    def shared(self) -> SharedOp[T]:
        """An op that executes this one at most once; every consumer gets the same output."""
        return SharedOp(self._adopt())

    def zip(self, *others: DeviceOp[Any]) -> DeviceOp[tuple[Any, ...]]:
        """``deviceops.zip(self, *others)``."""
        return zip(self, *others)

    def to_dot(self) -> str:
        """The DAG in Graphviz dot; executed ops are labelled with their stream."""
        from ._dot import to_dot

        return to_dot(self)


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
    __slots__ = ("_fn", "_next", "_src")

    def __init__(self, src: DeviceOp[Any], fn: Callable[[Any], DeviceOp[U]]) -> None:
        super().__init__()
        self._src = src
        self._fn = fn
        self._next: DeviceOp[U] | None = None

    def _execute(self, ctx: ExecutionContext) -> U:
        # a.then(f1).then(f2)...: nested through _src. Walk the chain instead of
        # recursing through it, so its length is not bounded by Python's stack.
        chain: list[_Then[Any]] = [self]
        src = self._src
        while type(src) is _Then and src._state == _OWNED:
            src._state = _DONE
            src._ran_on = ctx.stream.id
            chain.append(src)
            src = src._src
        out: Any = src._exec(ctx)
        for node in reversed(chain):
            nxt = node._fn(out)
            if not isinstance(nxt, DeviceOp):
                raise TypeError(
                    f"then: closure {_fn_name(node._fn)} returned {type(nxt).__name__}, not a "
                    "DeviceOp; use .map() for a host-side transform"
                )
            node._next = nxt
            out = nxt._exec(ctx)
        return out

    def _children(self) -> tuple[DeviceOp[Any], ...]:
        return (self._src,) if self._next is None else (self._src, self._next)

    def _describe(self) -> str:
        return f"then({_fn_name(self._fn)})"


class _Map(DeviceOp[U]):
    __slots__ = ("_fn", "_src")

    def __init__(self, src: DeviceOp[Any], fn: Callable[[Any], U]) -> None:
        super().__init__()
        self._src = src
        self._fn = fn

    def _execute(self, ctx: ExecutionContext) -> U:
        return self._fn(self._src._exec(ctx))

    def _children(self) -> tuple[DeviceOp[Any], ...]:
        return (self._src,)

    def _describe(self) -> str:
        return f"map({_fn_name(self._fn)})"


class _Inspect(DeviceOp[T]):
    __slots__ = ("_fn", "_src")

    def __init__(self, src: DeviceOp[T], fn: Callable[[T], object]) -> None:
        super().__init__()
        self._src = src
        self._fn = fn

    def _execute(self, ctx: ExecutionContext) -> T:
        out = self._src._exec(ctx)
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
    raised by the source reaches every consumer.
    """

    __slots__ = ("_error", "_out", "_ran", "_src", "_where")

    def __init__(self, src: DeviceOp[T]) -> None:
        super().__init__()
        self._src = src
        self._ran = False
        self._out: Any = None
        self._error: BaseException | None = None
        self._where: tuple[Stream, int] | None = None

    def _adopt(self) -> DeviceOp[T]:
        if self._state == _FRESH:
            self._state = _OWNED
        return self

    def _exec(self, ctx: ExecutionContext) -> T:
        self._state = _DONE
        if not self._ran:
            self._ran = True
            self._ran_on = ctx.stream.id
            try:
                self._out = self._src._exec(ctx)
            except BaseException as exc:
                self._error = exc
                raise
            self._where = (ctx.stream, ctx.stream.seq)
            return self._out
        if self._error is not None:
            raise self._error
        if self._where is not None:
            ctx.stream.wait_for(*self._where)
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
        outs = [op._exec(ctx if s is home else ctx.on(s)) for op, s in _bzip(ops, streams)]
        for s in others.values():
            home.wait_event(s.record_event())
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
    overlap on the device; under ``SingleStream`` they run in order.
    """
    for op in ops:
        if not isinstance(op, DeviceOp):
            raise TypeError(f"zip: expected DeviceOps, got {type(op).__name__}")
    return _Zip(tuple(op._adopt() for op in ops))


class _Index(DeviceOp[Any]):
    __slots__ = ("_i", "_n", "_src")

    def __init__(self, src: SharedOp[Any], i: int, n: int) -> None:
        super().__init__()
        self._src = src
        self._i = i
        self._n = n

    def _execute(self, ctx: ExecutionContext) -> Any:
        out = self._src._exec(ctx)
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
    if n < 1:
        raise ValueError(f"unzip: n must be >= 1, got {n}")
    src = op.shared()
    return tuple(_Index(src, i, n) for i in range(n))
