"""Engine cores in their own processes (:mod:`deviceops.nn.serving.core`) behind the front.

Three levels, all on the cpu backend with the tiny random Llama of :mod:`tests.nn_tiny`:

* the protocol's messages and arrays (pure);
* an :class:`EngineCore` and a :class:`CoreClient` in one asyncio loop over an ``ipc://``
  socket: tokens equal the in-process engine's, cancellation frees the slot in the core,
  log-probabilities and refusals cross the wire, and a core that goes away fails the
  client's requests, which rejoins the next core at the same address;
* ``python -m deviceops.nn.serve --devices cpu:0,cpu:1`` as a user starts it: kill -9 of
  one core mid-stream fails only that core's requests, the survivors finish, the core is
  restarted and serves again with no KV blocks held; SIGTERM leaves no process behind; a
  model that cannot load makes ``serve`` exit non-zero with a one-line reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from deviceops.nn.serving import cli as serve
from deviceops.nn.serving import protocol as P
from deviceops.nn.serving.core import EngineCore
from deviceops.nn.serving.core_client import CoreClient, CoreFailed, CoreStream, _Req, handshake

from . import nn_tiny

pytestmark = [pytest.mark.timeout(120)]

KW: dict[str, Any] = {"max_batch": 2, "max_seq": 96, "max_queue": None, "prefill_chunk": 32}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = Path(tmp_path_factory.mktemp("tiny_cores")) / "tiny.gguf"
    nn_tiny.write_gguf(path, nn_tiny.hf_weights(1, tied=False), "F32")
    return str(path)


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


# -- serve, as a user starts it ------------------------------------------------------------
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_prompts_that_cannot_fit_are_refused_before_tokenising(tiny_gguf: str) -> None:
    """A prompt longer than max_seq times the longest vocabulary entry cannot fit: 400,
    naming the bound, without being tokenised (a huge text would hold the GIL)."""
    with _serve("--model", tiny_gguf, "--device", "cpu", "--max-seq", "64") as (_, url):
        r = httpx.post(url + "/v1/completions", json={"prompt": "ab " * 200_000,
                                                      "max_tokens": 2}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "characters" in err["message"] and "at most" in err["message"], err
        bound = int(re.search(r"at most (\d+)", err["message"]).group(1))  # type: ignore[union-attr]
        assert bound < 600_000  # the context's bound, not --max-prompt-chars' million
        ok = httpx.post(url + "/v1/completions", json={"prompt": "ab", "max_tokens": 2,
                                                       "ignore_eos": True}, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


@contextlib.contextmanager
def _serve(*args: str, env: dict[str, str] | None = None) -> Iterator[tuple[Any, str]]:
    import tempfile

    port = _port()
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed below; never a pipe: a chatty server must not block on it)
    proc = subprocess.Popen(
        [sys.executable, "-m", "deviceops.nn.serve", "--port", str(port), "--log-level",
         "warning", *args], env=os.environ | {"DEVICEOPS_DEVICE": "cpu"} | (env or {}),
        stdout=subprocess.DEVNULL, stderr=log)

    def said() -> str:
        log.seek(0)
        return log.read().decode(errors="replace")[-2000:]

    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"serve exited: {said()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "serve did not become healthy"
            time.sleep(0.1)
        try:
            yield proc, url
        except BaseException:
            print("serve's log:\n" + said(), file=sys.stderr)
            raise
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        if f.read().split(")")[-1].split()[0] == "Z":
            return False
    return True


def _sse(url: str, body: dict[str, Any], out: list[Any]) -> None:
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        out.append(r.status_code)
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                out.append(data if data == "[DONE]" else json.loads(data))


def test_kill_9_of_one_core_fails_only_its_streams_and_it_comes_back(tiny_gguf: str) -> None:
    import threading

    with _serve("--model", tiny_gguf, "--devices", "cpu:0,cpu:1", "--max-batch", "4",
                "--max-seq", "256", env={"DEVICEOPS_CORE_STEP_PAUSE_MS": "20"}) as (_, url):
        engines = httpx.get(url + "/health").json()["engines"]
        pids = {e["device"]: e["pid"] for e in engines}
        assert len(pids) == 2 and all(_alive(p) for p in pids.values())
        outs: list[list[Any]] = [[] for _ in range(4)]
        body = {"prompt": [1, 2, 3], "max_tokens": 60, "temperature": 0, "stream": True,
                "ignore_eos": True}
        threads = [threading.Thread(target=_sse, args=(url, body, o)) for o in outs]
        for t in threads:
            t.start()
            time.sleep(0.05)  # each request sees the load of those before it: 2 per core
        deadline = time.monotonic() + 20
        while sum(1 for o in outs if len(o) > 3) < 4:  # every stream under way
            assert time.monotonic() < deadline
            time.sleep(0.01)
        load = {e["device"]: e["running"] for e in httpx.get(url + "/health").json()["engines"]}
        assert load == {"cpu": 2, "cpu:1": 2}
        os.kill(pids["cpu:1"], signal.SIGKILL)
        for t in threads:
            t.join(60)
        failed = [o for o in outs if any(isinstance(e, dict) and "error" in e for e in o)]
        done = [o for o in outs if o not in failed]
        assert len(failed) == 2 and len(done) == 2
        for o in failed:
            err = next(e for e in o if isinstance(e, dict) and "error" in e)["error"]
            assert err["code"] == "device_failed" and "cpu:1" in err["message"]
            assert o[-1] == "[DONE]" and o[0] == 200
        for o in done:
            assert o[0] == 200 and o[-1] == "[DONE]"
            assert o[-2]["choices"][0]["finish_reason"] == "length"
        # the core is restarted and rejoins; nothing is left running or holding KV blocks
        deadline = time.monotonic() + 60
        while True:
            h = httpx.get(url + "/health").json()
            if h["status"] == "ok":
                break
            assert time.monotonic() < deadline, h
            time.sleep(0.1)
        back = {e["device"]: e for e in h["engines"]}
        assert back["cpu:1"]["restarts"] == 1 and back["cpu:1"]["pid"] != pids["cpu:1"]
        assert not _alive(pids["cpu:1"])
        r = httpx.post(url + "/v1/completions", json={
            "prompt": [1, 2], "max_tokens": 3, "temperature": 0, "ignore_eos": True}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        metrics = httpx.get(url + "/metrics").text
        blocks = [ln for ln in metrics.splitlines()
                  if ln.startswith("deviceops_kv_blocks_in_use")]
        assert blocks and all(float(ln.rsplit(" ", 1)[1]) == 0 for ln in blocks), blocks


def test_sigterm_stops_every_core_and_leaves_no_process(tiny_gguf: str) -> None:
    with _serve("--model", tiny_gguf, "--devices", "cpu:0,cpu:1",
                env={"DEVICEOPS_CORE_STEP_PAUSE_MS": "5"}) as (proc, url):
        pids = [e["pid"] for e in httpx.get(url + "/health").json()["engines"]]
        out: list[Any] = []
        import threading

        t = threading.Thread(target=_sse, args=(url, {
            "prompt": [1, 2], "max_tokens": 40, "stream": True, "ignore_eos": True,
            "temperature": 0}, out))
        t.start()
        while len(out) < 3:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        t.join(30)
        assert proc.wait(30) == 0
        assert out[-1] == "[DONE]" and out[-2]["choices"][0]["finish_reason"] == "length"
        time.sleep(0.2)
        assert [p for p in pids if _alive(p)] == []


def test_a_model_that_cannot_load_exits_non_zero_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF not really")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "deviceops.nn.serve", "--model", str(bad),
                        "--port", str(_port()), "--log-level", "warning"],
                       env=os.environ | {"DEVICEOPS_DEVICE": "cpu"}, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1, r.stderr[-800:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("serve: cannot start: no engine core started: "), r.stderr[-800:]
    assert time.monotonic() - t0 < 30
    r = subprocess.run([sys.executable, "-m", "deviceops.nn.serve", "--model", "nope"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown model 'nope'" in r.stderr


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
    return out


def test_api_servers_share_the_port_and_stop_together(tiny_gguf: str) -> None:
    """``--api-servers 2``: two front processes on one port, both serving (each counts its
    own requests in /metrics), both attached to the one core; SIGTERM stops every process."""
    with _serve("--model", tiny_gguf, "--device", "cpu", "--api-servers", "2") as (proc, url):
        kids = _children(proc.pid)
        assert len(kids) == 2  # one core, one more front
        pat = re.compile(r'deviceops_http_requests_total\{endpoint="completions",status="200"\} (\S+)')
        sent, seen = 0, set()
        deadline = time.monotonic() + 60
        while len(seen) < 2:  # until each front has served some (the second one starts late)
            assert time.monotonic() < deadline, seen
            for _ in range(8):  # a new connection each: the kernel spreads them over the fronts
                r = httpx.post(url + "/v1/completions", json={
                    "prompt": [1, 2], "max_tokens": 2, "ignore_eos": True}, timeout=30)
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
                sent += 1
            seen = set()
            for _ in range(40):
                m = pat.search(httpx.get(url + "/metrics").text)
                seen.add(float(m.group(1)) if m else 0.0)
            if len(seen) == 1 and seen == {sent / 2}:
                break  # an even split looks like one value
        assert len(seen) == 1 or sum(seen) == sent, (seen, sent)  # each counts its own
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        time.sleep(0.3)
        assert [p for p in kids if _alive(p)] == []
