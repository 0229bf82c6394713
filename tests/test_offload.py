"""Compiles stay off the event loop (issue 35, item 2): ``await op`` enqueues an op that has
not yet completed one enqueue without a compile in a worker thread, so the loop keeps
ticking while NVRTC works (:mod:`deviceops._offload`).

The cpu backend compiles nothing, so these tests stand in a fake compile: an op whose
enqueue sleeps and counts a program load the first time, as ``load_program`` does, with the
process marked as having a compiling backend. A control (the same op where no backend
compiles: enqueued inline) shows that the ticker measurement does catch a stall.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, ClassVar

import anyio
import pytest

import deviceops
from deviceops import _offload
from deviceops._backend import count_program_load, program_loads
from deviceops._context import ExecutionContext
from deviceops.scheduling import SingleStream

COMPILE_S = 0.4


class Compiling(deviceops.DeviceOp[Any]):
    """Enqueuing it "compiles" (sleeps COMPILE_S, counts a program load) the first time its
    kernel name is seen in the test, as a fresh kernel variant would; returns its stream."""

    compiled: ClassVar[set[str]] = set()

    def __init__(self, kernel: str) -> None:
        super().__init__()
        self.kernel = kernel

    def _describe(self) -> str:
        return f"Compiling({self.kernel})"

    def _execute(self, ctx: ExecutionContext) -> Any:
        if self.kernel not in Compiling.compiled:
            time.sleep(COMPILE_S)
            count_program_load()
            Compiling.compiled.add(self.kernel)
        return ctx.stream


@pytest.fixture
def compiling_backend() -> Iterator[None]:
    """The process counts as having a backend that compiles (as once CUDA is in use)."""
    saved = list(program_loads)
    program_loads[1] = 1
    _offload.reset()
    Compiling.compiled.clear()
    try:
        yield
    finally:
        program_loads[:] = saved
        _offload.reset()


async def _await_with_ticker(op: deviceops.DeviceOp[Any]) -> tuple[Any, float]:
    """``await op`` while a 1 ms ticker runs; returns the result and the ticker's worst gap."""
    gaps: list[float] = []
    done = anyio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await anyio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.sleep(0.02)
        result = await op
        done.set()
    return result, max(gaps)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_compile_during_await_does_not_stall_the_loop(compiling_backend: None,
                                                        backend: str) -> None:
    before = _offload.stats()
    _, worst = anyio.run(_await_with_ticker, Compiling("gemm_a"), backend=backend)
    assert worst < COMPILE_S / 2, f"the loop stalled {worst * 1e3:.0f} ms during a compile"
    after = _offload.stats()
    assert after["offloaded"] == before["offloaded"] + 1
    # the first enqueue compiled, so the key is not warm yet: the next await goes to a
    # thread again, compiles nothing, and makes it warm; the third enqueues inline
    anyio.run(_await_with_ticker, Compiling("gemm_a"), backend=backend)
    assert _offload.stats()["offloaded"] == before["offloaded"] + 2
    anyio.run(_await_with_ticker, Compiling("gemm_a"), backend=backend)
    assert _offload.stats()["offloaded"] == before["offloaded"] + 2


def test_control_an_inline_compile_stalls_the_ticker() -> None:
    """Where no backend compiles (the cpu backend alone) awaits enqueue inline: the same fake
    compile then stalls the ticker, so the measurement above can fail."""
    saved = list(program_loads)
    program_loads[1] = 0
    Compiling.compiled.clear()
    try:
        _, worst = anyio.run(_await_with_ticker, Compiling("gemm_b"))
    finally:
        program_loads[:] = saved
    assert worst >= COMPILE_S * 0.9


def test_a_warm_key_that_compiles_inline_turns_cold(compiling_backend: None) -> None:
    async def main() -> None:
        await Compiling("k")  # thread, compiles
        await Compiling("k")  # thread, nothing compiled: warm
        n = _offload.stats()["offloaded"]
        Compiling.compiled.clear()  # a new variant behind the same key (e.g. a composite op)
        await Compiling("k")  # inline (warm), compiles: noticed
        assert _offload.stats()["offloaded"] == n
        assert _offload.stats()["inline_compiles"] >= 1
        await Compiling("k")  # cold again: a thread
        assert _offload.stats()["offloaded"] == n + 1

    anyio.run(main)


def test_the_policy_follows_the_op_into_the_thread(compiling_backend: None) -> None:
    stream = deviceops.device("cpu").new_stream()

    async def main() -> Any:
        with deviceops.using(SingleStream(stream)):
            return await Compiling("policy")

    assert anyio.run(main) is stream
    assert _offload.stats()["offloaded"] >= 1


def test_nothing_is_offloaded_without_a_compiling_backend() -> None:
    """The cpu-only process: every await enqueues inline (no thread hop on the hot path)."""
    if deviceops.cuda_available():
        pytest.skip("a CUDA backend exists in this process")
    saved = list(program_loads)
    program_loads[1] = 0
    try:
        n = _offload.stats()["offloaded"]

        async def main() -> None:
            for _ in range(5):
                await deviceops.api.zeros((4,))

        anyio.run(main)
        assert _offload.stats()["offloaded"] == n
    finally:
        program_loads[:] = saved


def test_a_cancel_before_the_thread_starts_spends_the_op(compiling_backend: None,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The awaiting task is cancelled while its enqueue waits for a worker thread that never
    comes (a busy pool, a loop that ends): nothing is enqueued and the op is spent, with no
    "never executed" warning; an enqueue the thread began would run to completion."""
    import gc
    import warnings

    import anyio.to_thread

    async def never(fn: Any, *args: Any, **kw: Any) -> Any:
        await anyio.sleep_forever()

    monkeypatch.setattr(anyio.to_thread, "run_sync", never)
    ran: list[int] = []

    class Once(Compiling):
        def _execute(self, ctx: ExecutionContext) -> Any:
            ran.append(1)
            return super()._execute(ctx)

    async def main() -> None:
        with anyio.move_on_after(0.05):
            await Once("cancelled")

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", RuntimeWarning)
        anyio.run(main)
        gc.collect()
    assert not ran
    assert not [w for w in seen if "never executed" in str(w.message)]
