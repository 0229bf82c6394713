"""Engine cores (:mod:`deviceops.nn.serving.core`) and their clients, in one process.

On the cpu backend with the tiny random Llama of :mod:`tests.nn_tiny`: the protocol's
messages and arrays (pure); an :class:`EngineCore` and a :class:`CoreClient` in one asyncio
loop over an ``ipc://`` socket: tokens equal the in-process engine's, cancellation frees the
slot in the core, log-probabilities and refusals cross the wire, and a core that goes away
fails the client's requests, which rejoins the next core at the same address. The same
through ``serve``'s processes: ``tests/test_serve_processes.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from deviceops.nn.serving import cli as serve
from deviceops.nn.serving import protocol as P
from deviceops.nn.serving.core import EngineCore
from deviceops.nn.serving.core_client import CoreClient, CoreFailed, CoreStream, _Req, handshake

pytestmark = [pytest.mark.timeout(120)]

KW: dict[str, Any] = {"max_batch": 2, "max_seq": 96, "max_queue": None, "prefill_chunk": 32}


# -- the protocol ---------------------------------------------------------------------------
def test_arrays_round_trip_little_endian() -> None:
    xs = [0, 1, -1, 2**31 - 1, -(2**31), 49152]
    assert P.unpack_i32(P.pack_i32(xs)) == xs
    assert P.pack_i32([1]) == b"\x01\x00\x00\x00"
    big = [2**40, -(2**62), 7]
    assert P.unpack_i64(P.pack_i64(big)) == big
    assert P.pack_i64([1]) == b"\x01" + b"\x00" * 7


def test_messages_round_trip_and_malformed_ones_are_refused() -> None:
    sub = P.Submit(7, P.pack_i32([1, 2, 3]), 16, 0.7, 40, 0.9, 123, [5], True, 0.5, None,
                   {3: -1.5}, 2)
    assert P.decode_core(P.encode(sub)) == sub
    assert P.decode_core(P.encode(P.Cancel([1, 2]))) == P.Cancel([1, 2])
    step = P.Step(P.pack_i64([7]), P.pack_i32([2]), P.pack_i32([10, 11]),
                  [P.Finish(7, "stop")], [(7, 10, -0.25, [(10, -0.25), (4, -2.0)])],
                  list(range(14)), [0.0] * len(P.PHASE_NAMES))
    got = P.decode_front(P.encode(step))
    assert got == step and isinstance(got, P.Step)
    with pytest.raises(msgspec.DecodeError):
        P.decode_core(b"\xff\x00garbage")
    with pytest.raises(msgspec.ValidationError):  # a core message sent to a core
        P.decode_core(P.encode(P.Failed("x")))


# -- a core and a client in one loop -------------------------------------------------------
def _engine(path: str, device: str = "cpu", **kw: Any) -> Any:
    return serve._build_engine(path, device=device, dtype=None, fail_stop=True, **(KW | kw))


@contextlib.asynccontextmanager
async def _core(engine: Any, address: str) -> Any:
    core = EngineCore(engine, address)
    task = asyncio.ensure_future(core.serve())
    try:
        yield core
    finally:
        core.stop()
        await task


async def _client(address: str) -> CoreClient:
    info = await asyncio.to_thread(handshake, address, timeout_s=20)
    client = CoreClient(address, info, name="cpu")
    client.attach()
    return client


def _address(tmp_path: Path, name: str = "core") -> str:
    return f"ipc://{tmp_path}/{name}.sock"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # pyzmq's async sockets are asyncio's
async def test_tokens_through_a_core_equal_the_engine_in_process(
        tiny_gguf: str, tmp_path: Path, anyio_backend: str) -> None:
    prompts = [[1, 5, 9, 12], [3, 4], [7] * 20]
    ref = _engine(tiny_gguf)
    want = [await ref.generate(p, 12, ignore_eos=True) for p in prompts]
    want.append(await ref.generate(prompts[0], 9, temperature=0.8, seed=5, ignore_eos=True))
    engine = _engine(tiny_gguf)
    addr = _address(tmp_path)
    async with _core(engine, addr):
        client = await _client(addr)
        try:
            streams = [client.stream(p, 12, ignore_eos=True) for p in prompts]
            streams.append(client.stream(prompts[0], 9, temperature=0.8, seed=5,
                                         ignore_eos=True))
            assert client.in_flight == 4 and client.pending_tokens == (
                4 + 2 + 20 + 3 * 12 + 4 + 9)
            got = await asyncio.gather(*[_drain(s) for s in streams])
            assert got == want
            assert [s.finish_reason for s in streams] == ["length"] * 4
            assert client.in_flight == 0 and client.pending_tokens == 0
            st = client.stats()
            assert st.generated_tokens == 3 * 12 + 9 and st.running == 0
            assert client.model.decode([1, 5]) == ref.model.decode([1, 5])
            assert set(client.phases) == set(P.PHASE_NAMES)
            assert client.phases["wait"] > 0 and client.phases["send"] > 0
        finally:
            client.close()
    assert engine.stats().kv_blocks_in_use == 0


async def _drain(s: Any) -> list[int]:
    return [t async for t in s]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_cancel_frees_the_core_slot_and_logprobs_cross(
        tiny_gguf: str, tmp_path: Path, anyio_backend: str) -> None:
    engine = _engine(tiny_gguf, max_batch=1)
    addr = _address(tmp_path)
    async with _core(engine, addr):
        client = await _client(addr)
        try:
            long = client.stream([1, 2, 3], 80, ignore_eos=True)
            first = await long.__anext__()
            assert isinstance(first, int)
            queued = client.stream([4, 5], 3, ignore_eos=True, logprobs=2)
            long.cancel()
            assert long.finish_reason == "cancelled"
            toks = await _drain(queued)  # it had to wait for the one slot: freed by the cancel
            assert len(toks) == 3 and queued.finish_reason == "length"
            lps = queued.logprobs
            assert [lp.token for lp in lps if lp is not None] == toks
            assert all(lp is not None and len(lp.top) == 2 and lp.logprob <= 0 for lp in lps)
            for _ in range(50):
                if engine.stats().running == 0:
                    break
                await asyncio.sleep(0.01)
            assert engine.stats().running == 0 and engine.stats().cancelled == 1
        finally:
            client.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_refusals_before_sending_and_from_the_core(
        tiny_gguf: str, tmp_path: Path, anyio_backend: str) -> None:
    engine = _engine(tiny_gguf)
    addr = _address(tmp_path)
    async with _core(engine, addr):
        client = await _client(addr)
        try:
            with pytest.raises(ValueError, match="max_seq"):
                client.stream(list(range(1, 100)), 4)
            with pytest.raises(ValueError, match="temperature"):
                client.stream([1], 4, temperature=-1.0)
            with pytest.raises(ValueError, match="outside"):
                client.stream([10**6], 4)
            assert client.in_flight == 0
            # a submit the core refuses (sent past the client's checks): the stream ends with
            # the core's own error, as a ValueError, and nothing is left in flight
            req = _Req(4242, 200, 4)
            client._reqs[req.rid] = req
            client._send(P.Submit(req.rid, P.pack_i32([1] * 200), 4))
            with pytest.raises(ValueError, match="max_seq"):
                await _drain(CoreStream(client, req))
            assert client.in_flight == 0 and engine.stats().queued == 0
            assert len(await _drain(client.stream([1, 2], 4, ignore_eos=True))) == 4
        finally:
            client.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_core_that_goes_away_fails_its_requests_and_the_client_rejoins(
        tiny_gguf: str, tmp_path: Path, anyio_backend: str) -> None:
    addr = _address(tmp_path)
    engine = _engine(tiny_gguf)
    async with _core(engine, addr):
        client = await _client(addr)
        s = client.stream([1, 2, 3], 80, ignore_eos=True)
        await s.__anext__()
    # the core stopped (its socket closed): the request fails with CoreFailed
    with pytest.raises(CoreFailed, match="out of service"):
        await _drain(s)
    assert client.failure is not None and client.in_flight == 0
    with pytest.raises(CoreFailed):
        client.stream([1], 2)
    try:
        async with _core(_engine(tiny_gguf), addr):  # a new core at the same address
            for _ in range(300):
                if client.failure is None:
                    break
                await asyncio.sleep(0.02)
            assert client.failure is None and client.restarts == 1
            assert len(await _drain(client.stream([1, 2, 3], 5, ignore_eos=True))) == 5
    finally:
        client.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_core_on_a_tcp_wildcard_port_says_where_it_listens(
        tiny_gguf: str, anyio_backend: str) -> None:
    """What a Ray replica does: bind ``tcp://host:*`` and tell the front the port."""
    engine = _engine(tiny_gguf)
    core = EngineCore(engine, "tcp://127.0.0.1:*")
    task = asyncio.ensure_future(core.serve())
    try:
        addr = await asyncio.wait_for(core.wait_bound(), 10)
        assert addr.startswith("tcp://127.0.0.1:") and not addr.endswith(":*")
        assert int(addr.rsplit(":", 1)[1]) > 0 and core.bound == addr
        client = await _client(addr)
        try:
            assert len(await _drain(client.stream([1, 2], 3, ignore_eos=True))) == 3
        finally:
            client.close()
    finally:
        core.stop()
        await task


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_failed_step_ends_every_request_with_its_cause_and_the_core_gives_up(
        tiny_gguf: str, tmp_path: Path, anyio_backend: str) -> None:
    import deviceops

    engine = _engine(tiny_gguf)
    addr = _address(tmp_path)
    gave_up: list[int] = []
    core = EngineCore(engine, addr, on_failed=lambda: gave_up.append(1))
    task = asyncio.ensure_future(core.serve())
    client = await _client(addr)
    try:
        s = client.stream([1, 2, 3], 50, ignore_eos=True)
        await s.__anext__()

        def broken(*a: Any, **k: Any) -> Any:
            raise deviceops.DriverError("injected")

        engine.scheduler.submit_decode = broken  # the next step fails on the device
        with pytest.raises(CoreFailed) as info:
            await asyncio.wait_for(_drain(s), 10)
        assert str(info.value) == "engine core cpu failed: DriverError: injected"
        for _ in range(200):  # the Failed message follows: the client leaves routing
            if client.failure is not None:
                break
            await asyncio.sleep(0.01)
        assert client.failure is not None and "its engine failed" in str(client.failure)
        assert gave_up == [1]  # told once (the supervisor then restarts the process)
        with pytest.raises(CoreFailed):
            client.stream([1], 2)
        client._send(P.Submit(999, P.pack_i32([1, 2]), 2))  # a late submit: refused ...
        await asyncio.sleep(0.2)
        assert gave_up == [1]  # ... and the core does not give up twice
    finally:
        client.close()
        core.stop()
        await task


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_front_that_vanishes_does_not_stop_the_core(
        tiny_gguf: str, tmp_path: Path, anyio_backend: str) -> None:
    """A front that goes away without a Bye (killed): the core's messages to it are
    dropped, and the other fronts are served."""
    addr = _address(tmp_path)
    async with _core(_engine(tiny_gguf, max_batch=2), addr):
        gone, other = await _client(addr), await _client(addr)
        try:
            s = gone.stream([1, 2, 3], 40, ignore_eos=True)
            await s.__anext__()
            gone._teardown()  # its socket closes, no Bye: the core keeps sending to it
            got = await asyncio.wait_for(_drain(other.stream([4, 5], 6, ignore_eos=True)), 20)
            assert len(got) == 6
        finally:
            other.close()
            gone.close()


def test_the_supervisor_restarts_a_failed_core_but_not_a_stopped_or_unloadable_one(
        tmp_path: Path) -> None:
    """CoreProcess's rule, with stand-in processes exiting with a given status."""
    import subprocess
    import sys
    import time

    from deviceops.nn.serving import core as core_mod
    from deviceops.nn.serving.core import CoreSpec
    from deviceops.nn.serving.core_process import CoreProcess

    class Stand(CoreProcess):
        def __init__(self, statuses: list[int]) -> None:
            super().__init__(CoreSpec("x"), "ipc://unused", reason_file=str(tmp_path / "why"),
                             max_restarts=2)
            self.statuses, self.starts = statuses, 0

        def start(self) -> None:  # as CoreProcess.start, with a process that just exits
            code = self.statuses[min(self.starts, len(self.statuses) - 1)]
            self.starts += 1
            self.proc = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
            if self._thread is None:
                import threading

                self._thread = threading.Thread(target=self._supervise, daemon=True)
                self._thread.start()

    def run(statuses: list[int], want_starts: int) -> Stand:
        p = Stand(statuses)
        p.start()
        deadline = time.monotonic() + 20
        while p.dead is None:
            assert time.monotonic() < deadline, (statuses, p.starts)
            time.sleep(0.02)
        assert p.starts == want_starts, (statuses, p.starts)
        return p

    # a failed engine (EXIT_FAILED) is restarted; then a clean stop (0) ends it
    p = run([core_mod.EXIT_FAILED, core_mod.EXIT_FAILED, 0], 3)
    assert p.restarts == 2 and "stopped" in (p.dead or "")
    # a model that cannot load (EXIT_LOAD) is never restarted
    p = run([core_mod.EXIT_LOAD], 1)
    assert p.restarts == 0 and p.dead
    # a core that keeps failing is given up after max_restarts within the window
    p = run([core_mod.EXIT_FAILED], 3)
    assert "times within" in (p.dead or "")


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_malformed_messages_are_dropped_both_ways(
        tiny_gguf: str, tmp_path: Path, anyio_backend: str) -> None:
    addr = _address(tmp_path)
    async with _core(_engine(tiny_gguf), addr) as core:
        client = await _client(addr)
        try:
            assert len(await _drain(client.stream([1, 2], 2, ignore_eos=True))) == 2
            client._sock.send(b"\xc1 not msgpack")  # to the core
            for ident in list(core._fronts):  # to the client
                core._sock.send_multipart([ident, b"\xc1 not msgpack"])
            await asyncio.sleep(0.05)
            # both keep going
            assert len(await asyncio.wait_for(
                _drain(client.stream([3, 4], 3, ignore_eos=True)), 10)) == 3
            assert client.failure is None
        finally:
            client.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_client_checks_the_kv_budget_and_reports_empty_stats_before_a_step(
        tiny_gguf: str, tmp_path: Path, anyio_backend: str) -> None:
    addr = _address(tmp_path)
    async with _core(_engine(tiny_gguf), addr):
        info = await asyncio.to_thread(handshake, addr, timeout_s=20)
    # a pool of 2 blocks of 16 positions: 32 positions fit, 33 do not (no core needed)
    client = CoreClient(_address(tmp_path, "nobody"), info | {"kv_blocks_total": 2,
                                                              "kv_block_size": 16},
                        name="cpu")
    st = client.stats()
    assert (st.queued, st.running, st.steps, st.generated_tokens, st.kv_blocks_in_use,
            st.max_batch) == (0, 0, 0, 0, 0, KW["max_batch"])
    try:
        client.stream([1] * 10, 22).cancel()  # 32 positions: 2 blocks
        with pytest.raises(ValueError, match="KV blocks"):
            client.stream([1] * 10, 23)  # 33 positions: 3 blocks
    finally:
        client.close()
