"""DeviceFuture: the handle ``op.schedule()`` returns.

It follows :class:`concurrent.futures.Future` / :class:`asyncio.Future`
conventions: ``done()``, ``result(timeout)``, ``exception(timeout)``,
``add_done_callback(fn)``, and it is awaitable from asyncio and trio (from any
event loop: each ``await`` registers its own wake-up). An error raised while the
op was being enqueued is stored and re-raised by ``result()``/``await``; an
error the device reports is raised as a :class:`~deviceops.DeviceError`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from . import _hooks
from ._errors import DeviceError
from ._tensor import failed_output_error, output_failure

if TYPE_CHECKING:
    from ._stream import Event, Stream

__all__ = ["DeviceFuture"]

T = TypeVar("T")


class DeviceFuture(Generic[T]):
    """The pending output of a scheduled DeviceOp.

    Example:
        >>> fut = api.ones((4,)).schedule()
        >>> fut.result().shape
        (4,)
    """

    __slots__ = ("_event", "_exc", "_op", "_out", "stream")

    def __init__(self) -> None:
        self._out: Any = None
        self._exc: BaseException | None = None
        self._event: Event | None = None
        self._op: Any = None  # the scheduled op (named in a device error's note)
        self.stream: Stream | None = None

    @classmethod
    def _pending(cls, out: T, stream: Stream, event: Event) -> DeviceFuture[T]:
        f: DeviceFuture[T] = cls()
        f._out, f._event, f.stream = out, event, stream
        return f

    @classmethod
    def _failed(cls, exc: BaseException, stream: Stream | None) -> DeviceFuture[T]:
        f: DeviceFuture[T] = cls()
        f._exc, f.stream = exc, stream
        return f

    def __repr__(self) -> str:
        state = "failed" if self._exc is not None else ("done" if self.done() else "pending")
        return f"<DeviceFuture {state} on {self.stream!r}>"

    def done(self) -> bool:
        """True once the device finished the work (or enqueueing failed). Never blocks."""
        if self._exc is not None:
            return True
        assert self._event is not None
        try:
            return self._event.query()
        except Exception:
            return True

    def result(self, timeout: float | None = None) -> T:
        """Wait (blocking the thread) for the output.

        Raises:
            TimeoutError: not done within ``timeout`` seconds.
            DeviceError: the device reported a failure; or the error raised
                while the op was being enqueued.
        """
        if self._exc is not None:
            raise self._exc
        assert self._event is not None
        if timeout is not None:
            self._wait_until(time.monotonic() + timeout)
        try:
            self._event.synchronize()
        except DeviceError as exc:
            if self._op is not None:
                exc.add_note(f"deviceops: raised by the device work of {self._op._describe()} "
                             f"(or of work it waited for) on {self.stream!r}")
                self._op = None  # noted once
            raise
        failed = output_failure(self._out)
        if failed is not None:
            raise failed_output_error(f"DeviceFuture on {self.stream!r}", failed)
        return self._out

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error ``result()`` would raise, or ``None``."""
        try:
            self.result(timeout)
        except TimeoutError:
            raise
        except BaseException as exc:
            return exc
        return None

    def _wait_until(self, deadline: float) -> None:
        assert self._event is not None
        if self._event.query():
            return
        done = threading.Event()
        self._event.when_complete(done.set)
        if not done.wait(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"DeviceFuture on {self.stream!r} not done in time")

    def add_done_callback(self, fn: Callable[[DeviceFuture[T]], object]) -> None:
        """Call ``fn(self)`` once done: at once if it is, else from a deviceops thread.

        ``fn`` must not block; hand results to an event loop thread-safely.
        """
        if self.done():
            fn(self)
            return
        assert self._event is not None

        def call() -> None:
            fn(self)

        self._event.when_complete(call)

    def __await__(self) -> Generator[Any, None, T]:
        return _hooks.await_future(self).__await__()
