"""State of one graph capture in progress (backend-neutral part).

While a stream captures, every stream that waits on one of its events joins
the capture (as in CUDA). The capture remembers every tensor storage its work
touched, so that the finished graph keeps them alive and its launches are
ordered against other streams' use of them, and (cpu backend) the tasks to
replay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._stream import Stream
    from ._tensor import Storage

__all__ = ["CaptureState"]


class CaptureState:
    """Book-keeping of a capture: member streams, recorded tasks, touched storages."""

    def __init__(self, origin: Stream, op_name: str) -> None:
        self.origin = origin
        self.op_name = op_name
        self.members: list[Stream] = [origin]
        self.tasks: list[tuple[Callable[[], None], str]] = []
        self.storages: dict[int, tuple[Storage, bool]] = {}
        self.keepalive: list[Any] = []
        # ops may allocate their outputs during this capture: the graph keeps what they
        # allocate (it touches it) for its life (automatic graphs of repeated DAGs)
        self.allocates = False

    def join(self, stream: Stream) -> None:
        """Add ``stream`` to the capture (it waited on a captured event)."""
        stream.capture = self
        self.members.append(stream)

    def record_task(self, stream: Stream, fn: Callable[[], None], name: str) -> None:
        """cpu backend: keep ``fn`` for replay instead of running it."""
        self.tasks.append((fn, name))

    def note(self, storage: Storage, write: bool) -> None:
        """Remember that captured work reads (or writes) ``storage``."""
        prev = self.storages.get(id(storage))
        if prev is None or (write and not prev[1]):
            self.storages[id(storage)] = (storage, write or (prev is not None and prev[1]))
