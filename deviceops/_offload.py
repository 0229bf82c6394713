"""Keeping kernel compilation off the event loop's thread.

The first launch of a kernel variant on a GPU compiles it (NVRTC, 1-6 s for the GEMM and
attention kernels) unless CuPy's on-disk cache already holds it. An ``await op`` enqueues
the op on the loop's thread, so a compile there would freeze every other task of the loop
(a 1 ms ticker stalled 2.9 s on a fresh machine). Two measures:

* **ahead of time**: ``python -m deviceops.precompile`` compiles the common kernels for the
  present GPU into CuPy's cache (``scripts/demo.sh`` runs it); loading a model captures its
  graphs, compiling what it uses;
* **off the loop** (this module): ``await op`` enqueues an op it has not yet seen complete
  without a compile ("cold") in a worker thread (``anyio.to_thread``, asyncio and trio),
  so the loop keeps running while the op compiles; once an op's enqueue (in the thread)
  compiled nothing, its key is "warm" and later awaits of it enqueue inline, with no thread
  hop. The key (:meth:`DeviceOp._compile_key`) is the kernel's plan for a kernel launcher
  (one per launcher, static parameters and tensor signatures), else the op's type and name.

Nothing changes where nothing compiles: until the process has a CUDA stream or has loaded a
program (the cpu backend compiles nothing) every await enqueues inline. An inline enqueue that compiles after
all (a composite op whose key was warm reaching a new kernel) is noticed: its key turns cold
again and :func:`stats` counts it (``inline_compiles``).

The compile count is :data:`deviceops._backend.program_loads` (every
:meth:`Backend.load_program`). Context variables (the policy of ``deviceops.using``) follow
the op into the thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from ._backend import program_loads

if TYPE_CHECKING:
    from ._future import DeviceFuture
    from ._op import DeviceOp

__all__ = ["cold", "mark", "schedule_off_loop", "stats"]

_WARM_MAX = 4096
_warm: OrderedDict[Any, None] = OrderedDict()
# [awaits enqueued in a thread, inline enqueues that compiled anyway]
_counts = [0, 0]


def cold(op: DeviceOp[Any]) -> Any:
    """``None`` if ``op`` may be enqueued on the loop's thread, else its compile key.

    Cheap when nothing compiles in the process (one list read).
    """
    if not program_loads[1]:
        return None
    try:
        key = op._compile_key()
        if key in _warm:
            return None
    except Exception:  # an unhashable or failing key: treat as cold
        return _Unkeyed
    return key


class _Unkeyed:
    """The key of an op whose own key could not be computed (never marked warm)."""


def mark(key: Any, compiled: bool) -> None:
    """Record the outcome of an enqueue of an op with ``key``: warm if nothing compiled."""
    if key is None or key is _Unkeyed:
        return
    if compiled:
        _warm.pop(key, None)
        return
    _warm[key] = None
    if len(_warm) > _WARM_MAX:
        _warm.popitem(last=False)


def note_inline(op: DeviceOp[Any], before: int) -> None:
    """After an inline enqueue (a warm key): if it compiled anyway, make the key cold again."""
    if program_loads[0] != before:
        _counts[1] += 1
        with contextlib.suppress(Exception):
            mark(op._compile_key(), True)


async def schedule_off_loop(op: DeviceOp[Any], key: Any) -> DeviceFuture[Any]:
    """``op.schedule()`` in a worker thread (the loop keeps running); marks ``key`` warm when
    that enqueue compiled nothing. Cancelling the awaiting task returns at once: an enqueue
    the thread has begun completes there (its work runs to completion, unawaited); one it has
    not begun never happens (the op is spent, as when cancelled before admission)."""
    import anyio.to_thread

    lock = threading.Lock()
    state = [False, False]  # [the thread started the enqueue, the await was cancelled first]

    def enqueue() -> tuple[DeviceFuture[Any] | None, bool]:
        with lock:
            if state[1]:  # cancelled before the thread got to it: nothing is enqueued
                return None, False
            state[0] = True
        before = program_loads[0]
        fut = op.schedule()
        return fut, program_loads[0] != before

    _counts[0] += 1
    try:
        fut, compiled = await anyio.to_thread.run_sync(enqueue, abandon_on_cancel=True)
    except BaseException:
        with lock:  # cancelled (or the loop went away) before the enqueue began: it never
            if not state[0]:  # will; the op is spent, as when cancelled in admission
                state[1] = True
                op._consume()
        raise
    assert fut is not None
    mark(key, compiled)
    return fut


def stats() -> dict[str, int]:
    """``{"offloaded": awaits enqueued in a thread, "inline_compiles": inline enqueues that
    compiled anyway, "warm": keys known warm}``."""
    return {"offloaded": _counts[0], "inline_compiles": _counts[1], "warm": len(_warm)}


def reset() -> None:
    """Forget every warm key (tests)."""
    _warm.clear()
