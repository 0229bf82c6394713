"""The combinators' ops: ``value``, ``then``, ``map``, ``inspect``, ``shared``, ``zip``, ``unzip``.

:class:`~deviceops.DeviceOp`'s methods (``then``, ``map``, ``inspect``, ``shared``,
``zip``) build these; ``value``, ``zip`` and ``unzip`` are also module functions.
Closures run when the op is *enqueued*, not when the device finishes. The ops that
nest (``then``, ``map``, ``inspect``, ``shared``, ``unzip``) are ``_iterative``:
:func:`~deviceops._op._drive` walks them without recursion.
"""

from __future__ import annotations

import builtins
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ._context import ExecutionContext
from ._errors import DeviceError, SchedulingError
from ._op import _DONE, _FRESH, _OWNED, DeviceOp, _drive, _fn_name, _walk
from ._placement import placement
from ._tensor import Partition, Tensor

if TYPE_CHECKING:
    from collections.abc import Callable, Generator

    from ._device import Device
    from ._stream import Stream

__all__ = ["SharedOp", "unzip", "value", "zip"]

T = TypeVar("T")
U = TypeVar("U")

_bzip = builtins.zip


class _Value(DeviceOp[T]):
    __slots__ = ("_value",)

    def __init__(self, v: T) -> None:
        super().__init__()
        self._value = v

    def _execute(self, ctx: ExecutionContext) -> T:
        return self._value

    def _inputs(self) -> tuple[Tensor, ...]:
        v: Any = self._value
        if isinstance(v, Partition):
            return (v.tensor,)
        return (v,) if isinstance(v, Tensor) else ()

    def _describe(self) -> str:
        return f"value({type(self._value).__name__})"


def value(x: T) -> DeviceOp[T]:
    """An op that produces ``x`` without device work."""
    return _Value(x)


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
    __slots__ = ("_ops", "_places", "_streams")

    def __init__(self, ops: tuple[DeviceOp[Any], ...]) -> None:
        super().__init__()
        self._ops = ops
        self._streams: list[int] = []
        self._places: list[Device | None] | None = None  # each branch's placement, once asked

    def _placements(self) -> list[Device | None]:
        """Each branch's device (:func:`placement`; walked once, the branches' DAGs are fixed)."""
        places = self._places
        if places is None:
            places = self._places = [placement(op) for op in self._ops]
        return places

    def _execute(self, ctx: ExecutionContext) -> tuple[Any, ...]:
        ops = self._ops
        home = ctx.stream
        if len(ops) <= 1:
            return tuple(op._exec(ctx) for op in ops)
        if _multi(ctx):  # each branch on its data's device (else the next in turn)
            policy: Any = ctx.policy
            on = getattr(policy, "stream_on", None)
            if on is None:
                streams = [home, *(policy.stream_for(op) for op in ops[1:])]
            else:  # one placement walk a branch
                places = self._placements()
                streams = [home if places[0] in (None, home.device) else on(places[0], ops[0]._describe())]
                streams += [on(d, op._describe()) for d, op in _bzip(places[1:], ops[1:])]
        else:
            streams = [home]
            for _ in ops[1:]:
                s = ctx.policy.next_stream()
                streams.append(home if s.device is not home.device else s)
        others = {s.id: s for s in streams if s is not home}
        if others:
            fork = home.record_event()
            for s in others.values():
                s.wait_event(fork)
        marks = [(s, s.seq) for s in others.values()]
        outs: list[Any] = []
        try:
            if len({s.device for s in streams}) > 1:
                outs = _interleaved(ops, streams, ctx)
            else:
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

    def _pin(self) -> tuple[Device | None, bool]:
        # branches on one device place the zip there; branches on several devices place
        # nothing (each branch is placed on its own when the zip runs)
        try:
            devs = set(self._placements())
        except DeviceError:
            return (None, True)  # the branch is refused when it runs, naming itself
        devs.discard(None)
        return (devs.pop() if len(devs) == 1 else None, True)

    def _describe(self) -> str:
        return f"zip[{len(self._ops)}]"


def _interleaved(ops: tuple[DeviceOp[Any], ...], streams: list[Stream], ctx: ExecutionContext
                 ) -> list[Any]:
    """Execute branches on streams of several devices, one finished op of each in turn.

    Executed one after the other, the second device would idle while the host enqueues the
    whole first branch; stepping the branches' walks in turn starts every device at once.
    Branches that are not plain iterative ops (a nested ``zip``, ``shared``) run whole.
    """
    outs: list[Any] = [None] * len(ops)
    walks: list[tuple[int, Generator[None, None, Any]]] = []
    try:
        for i, (op, s) in enumerate(_bzip(ops, streams)):
            bctx = ctx if s is ctx.stream else ctx.on(s)
            if op._iterative and type(op)._exec is DeviceOp._exec and op._state != _DONE:
                op._state = _DONE
                op._ran_on = s.id
                walks.append((i, _walk(op, op._deps(bctx), bctx)))
            else:
                outs[i] = op._exec(bctx)
        while walks:
            for w in list(walks):
                try:
                    next(w[1])
                except StopIteration as done:
                    outs[w[0]] = done.value
                    walks.remove(w)
    finally:
        for _, g in walks:  # a branch raised: the others stop where they are
            g.close()
    return outs


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
