"""Data-parallel serving (``serve --devices``): one engine per device behind the router.

The tiny random Llama of :mod:`tests.nn_tiny` (a GGUF with a tokenizer and chat template)
is loaded once per device by the server's own loader (:func:`serve.load_engines`) on the
cpu backend's emulated devices ``cpu`` and ``cpu:1`` (each with its own streams and
memory). The app runs in-process: its lifespan is entered directly and requests go
through httpx's ASGI transport in the same event loop, so a test decides exactly which
requests sit in which engine's queue (a request queued with ``engine.stream`` and never
iterated holds its load until cancelled). The GPU variant at the end serves the same
model on ``cuda:0`` and ``cuda:1``.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

import deviceops
from deviceops.nn.serving import cli as serve
from deviceops.nn.serving.core_process import CoreRouter
from deviceops.nn.serving.engine import Engine, EngineFailed
from deviceops.nn.serving.http import create_app
from deviceops.nn.serving.router import Replica, Router

from . import nn_tiny
from .test_engine import Toy, _prompt
from .test_serve_http import ToyLM, sse_events

pytestmark = [pytest.mark.timeout(60)]

KW: dict[str, Any] = {"max_batch": 2, "max_seq": 96, "prefill_chunk": 32}
PROMPT = "the cat in the hat"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = Path(tmp_path_factory.mktemp("tiny_serve")) / "tiny.gguf"
    nn_tiny.write_gguf(path, nn_tiny.hf_weights(1, tied=False), "F32")
    return str(path)


def devices_app(path: str, devices: Sequence[str] = ("cpu", "cpu:1"), **kw: Any) -> Any:
    args = KW | kw
    return create_app(lambda: serve.load_engines(path, devices=list(devices), **args),
                      model_name="tiny")


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[httpx.AsyncClient]:
    """Run ``app``'s lifespan (the model loads in a worker thread) and a client for it."""
    async with app.router.lifespan_context(app):
        with anyio.fail_after(30):
            while app.state.serve.router is None:
                assert app.state.serve.load_error is None, app.state.serve.load_error
                await anyio.sleep(0.005)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://tiny",
                                     timeout=30) as c:
            yield c


def engines(app: Any) -> list[Engine]:
    router: Router = app.state.serve.router
    out = [r.engine for r in router.replicas if r.engine is not None]
    assert len(out) == len(router.replicas)
    return out


async def wait_for(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while not cond():
            await anyio.sleep(0.002)
    assert cond(), what


def body(**kw: Any) -> dict[str, Any]:
    """A completion request of fixed length (``ignore_eos``), greedy unless told."""
    return {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True} | kw


# -- the router ---------------------------------------------------------------------------
def test_routing_goes_to_the_least_loaded_engine(tiny_gguf: str) -> None:
    app = devices_app(tiny_gguf)

    async def main() -> None:
        async with serving(app) as c:
            router: Router = app.state.serve.router
            e0, e1 = engines(app)
            assert [r.device for r in router.replicas] == ["cpu", "cpu:1"]
            assert str(e0.model.device) == "cpu" and str(e1.model.device) == "cpu:1"
            assert router.pick() is router.replicas[0]  # a tie goes to the first device
            ids = e0.model.encode(PROMPT)
            # e0 holds a queued request nobody iterates: its load stays put
            held = e0.stream(ids, 40)
            assert e0.pending_tokens == len(ids) + 40 and e1.pending_tokens == 0
            assert router.pick() is router.replicas[1]
            h = (await c.get("/health")).json()
            assert [(e["device"], e["state"], e["load"], e["queued"]) for e in h["engines"]] == [
                ("cpu", "serving", len(ids) + 40, 1), ("cpu:1", "serving", 0, 0)]
            r = await c.post("/v1/completions", json=body())
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 6
            # it ran on cpu:1's model, and nothing ran on cpu's
            assert e1.stats().prefill_tokens == len(ids) and e1.stats().generated_tokens == 6
            assert e0.stats().steps == 0 and e0.stats().queued == 1
            held.cancel()
            # now cpu:1 holds more work: the next request goes back to cpu
            held1 = e1.stream(ids, 3)
            assert router.pick() is router.replicas[0]
            r = await c.post("/v1/completions", json=body(max_tokens=2))
            assert r.status_code == 200, r.text
            assert e0.stats().generated_tokens == 2 and e1.stats().generated_tokens == 6
            held1.cancel()
            assert e0.pending_tokens == e1.pending_tokens == 0

    anyio.run(main)


def test_pending_tokens_count_prompt_left_and_tokens_left() -> None:
    """The routing load: prompt tokens not yet prefilled + max_new_tokens not yet generated."""
    toy = Toy(max_batch=2, max_seq=64)
    eng = Engine(toy, max_batch=2, max_seq=64, prefill_chunk=16)

    async def main() -> None:
        a = eng.stream(_prompt(1, 10), 5)
        b = eng.stream(_prompt(2, 3), 7)
        assert eng.pending_tokens == 10 + 5 + 3 + 7 == eng.stats().pending_tokens
        await a.__anext__()  # one step: both prompts prefilled, one token each
        assert (len(a.tokens), len(b.tokens)) == (1, 1)
        assert eng.pending_tokens == 4 + 6
        await a.__anext__()  # a decode step: one more token each
        assert eng.pending_tokens == 3 + 5
        b.cancel()  # a cancelled request is no work
        assert eng.pending_tokens == 3
        assert len([t async for t in a]) == 3 and eng.pending_tokens == 0

    anyio.run(main)


def test_every_queue_full_is_429(tiny_gguf: str) -> None:
    app = devices_app(tiny_gguf, max_queue=1)

    async def main() -> None:
        async with serving(app) as c:
            e0, e1 = engines(app)
            ids = e0.model.encode(PROMPT)
            held = [e0.stream(ids, 10), e1.stream(ids, 20)]  # one queued each: both full
            r = await c.post("/v1/completions", json=body())
            assert r.status_code == 429, r.text
            err = r.json()["error"]
            assert err["type"] == "rate_limit_exceeded" and "every device" in err["message"]
            assert r.headers["retry-after"] == "1"
            for s in held:
                s.cancel()
            assert (await c.post("/v1/completions", json=body(max_tokens=1))).status_code == 200

    anyio.run(main)


# -- correctness --------------------------------------------------------------------------
async def _outputs(c: httpx.AsyncClient) -> dict[str, str]:
    """Greedy and seeded-sampled completions, a chat answer and a stream, as text."""
    out: dict[str, str] = {}
    for name, b in {"greedy": body(max_tokens=10),
                    "sampled": body(max_tokens=10, temperature=0.9, top_p=0.9, seed=11),
                    "ids": body(prompt=[5, 80, 81, 82, 40, 41], max_tokens=8)}.items():
        r = await c.post("/v1/completions", json=b)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == b["max_tokens"]
        out[name] = r.json()["choices"][0]["text"]
    msgs = [{"role": "user", "content": "hello there"}]
    r = await c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 8,
                                                   "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    out["chat"] = r.json()["choices"][0]["message"]["content"]
    r = await c.post("/v1/completions", json=body(max_tokens=10, stream=True))
    ev = sse_events(iter(r.text.splitlines()))
    assert ev[-1] == "[DONE]", ev
    out["stream"] = "".join(e["choices"][0]["text"] for e in ev[:-1])
    return out


def test_each_device_gives_the_single_engine_output(tiny_gguf: str) -> None:
    single = create_app(lambda: serve.load_engine(tiny_gguf, device="cpu", **KW),
                        model_name="tiny")
    multi = devices_app(tiny_gguf)

    async def main() -> None:
        async with serving(single) as c:
            assert not single.state.serve.router.per_device
            want = await _outputs(c)
        assert want["greedy"] == want["stream"] and want["greedy"] != want["sampled"]
        async with serving(multi) as c:
            e0, e1 = engines(multi)
            assert await _outputs(c) == want  # nothing queued: every request on cpu
            assert e1.stats().steps == 0 and e0.stats().generated_tokens > 0
            held = e0.stream(e0.model.encode(PROMPT), 80)  # cpu loaded: cpu:1 serves
            gen0 = e0.stats().generated_tokens
            assert await _outputs(c) == want
            assert e0.stats().generated_tokens == gen0 and e1.stats().generated_tokens > 0
            held.cancel()

    anyio.run(main)


# -- /metrics and /health -----------------------------------------------------------------
def _sample(text: str, name: str, device: str) -> float:
    m = re.search(rf'^{name}{{device="{re.escape(device)}"}} (\S+)$', text, re.M)
    assert m, f"{name}{{device={device!r}}} missing from /metrics"
    return float(m.group(1))


def test_metrics_and_health_per_device(tiny_gguf: str) -> None:
    app = devices_app(tiny_gguf)

    async def main() -> None:
        async with serving(app) as c:
            e0, _ = engines(app)
            held = e0.stream(e0.model.encode(PROMPT), 30)
            assert (await c.post("/v1/completions", json=body(max_tokens=3))).status_code == 200
            m = (await c.get("/metrics")).text
            for dev in ("cpu", "cpu:1"):
                assert _sample(m, "deviceops_kv_slots_in_use", dev) == 0.0
                assert _sample(m, "deviceops_engine_up", dev) == 1.0
                assert _sample(m, "deviceops_engine_max_batch", dev) == 2.0
            assert _sample(m, "deviceops_engine_queued_requests", "cpu") == 1.0
            assert _sample(m, "deviceops_engine_pending_tokens", "cpu") == e0.pending_tokens
            assert _sample(m, "deviceops_engine_prefill_tokens_total", "cpu") == 0.0
            assert _sample(m, "deviceops_engine_prefill_tokens_total", "cpu:1") > 0
            assert "deviceops_kv_slots_in_use 0.0" not in m  # every engine series is labelled
            assert 'deviceops_http_requests_total{endpoint="completions",status="200"} 1.0' in m
            r = await c.get("/health")
            assert r.status_code == 200
            h = r.json()
            assert h["status"] == "ok" and h["model"] == "tiny"
            assert [(e["device"], e["state"], e["error"]) for e in h["engines"]] == [
                ("cpu", "serving", None), ("cpu:1", "serving", None)]
            held.cancel()

    anyio.run(main)


def test_a_device_that_fails_to_load_is_listed_and_the_rest_serve(tiny_gguf: str) -> None:
    # cuda:99 exists nowhere (no GPU here; out of range on a GPU machine)
    app = devices_app(tiny_gguf, devices=["cpu:1", "cuda:99"])

    async def main() -> None:
        async with serving(app) as c:
            r = await c.get("/health")
            assert r.status_code == 200, r.text
            h = r.json()
            assert h["status"] == "degraded"
            bad = h["engines"][1]
            assert (bad["device"], bad["state"]) == ("cuda:99", "failed")
            assert "loading the model failed" in bad["error"] and "DeviceError" in bad["error"]
            assert (await c.post("/v1/completions", json=body(max_tokens=2))).status_code == 200
            m = (await c.get("/metrics")).text
            assert _sample(m, "deviceops_engine_up", "cuda:99") == 0.0
            assert _sample(m, "deviceops_engine_up", "cpu:1") == 1.0

    anyio.run(main)


# -- failure ------------------------------------------------------------------------------
def _fail_decodes(engine: Engine, gate: anyio.Event | None = None) -> None:
    """Make ``engine``'s decode step raise a device error once ``gate`` is set (the decode's
    real work is enqueued and awaited first, as a device fault surfaces on the wait)."""
    real = engine.scheduler.submit_decode

    def submit(*args: Any) -> Callable[[], Any]:
        wait = real(*args)

        async def result() -> Any:
            await wait()
            if gate is not None:
                await gate.wait()
            raise deviceops.DriverError("injected: an illegal memory access was encountered",
                                        device="cpu:1")

        return result

    engine.scheduler.submit_decode = submit


def test_failed_engine_503s_its_requests_and_the_other_serves(tiny_gguf: str) -> None:
    app = devices_app(tiny_gguf, max_batch=1)

    async def main() -> None:
        async with serving(app) as c:
            router: Router = app.state.serve.router
            e0, e1 = engines(app)
            ids = e0.model.encode(PROMPT)
            held = e0.stream(ids, 80)  # cpu busy: the next requests go to cpu:1
            gate = anyio.Event()
            _fail_decodes(e1, gate)
            res: dict[str, httpx.Response] = {}

            async def post(name: str, path: str, b: dict[str, Any]) -> None:
                res[name] = await c.post(path, json=b)

            async with anyio.create_task_group() as tg:
                # a: streaming, in flight on cpu:1 (prefilled, first token out, decode stuck)
                tg.start_soon(post, "a", "/v1/completions", body(stream=True, max_tokens=8))
                await wait_for(lambda: e1.stats().generated_tokens == 1, "a's first token")
                # b (plain) and c (chat stream) wait in cpu:1's queue behind a (max_batch 1)
                tg.start_soon(post, "b", "/v1/completions", body(max_tokens=4))
                await wait_for(lambda: e1.stats().queued == 1, "b queued on cpu:1")
                tg.start_soon(post, "c", "/v1/chat/completions", {
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                    "stream": True})
                await wait_for(lambda: e1.stats().queued == 2, "c queued on cpu:1")
                assert e0.stats().queued == 1 and e0.stats().steps == 0
                gate.set()  # the device faults: a, b and c end with 503s
            # a: its first token, then the error event, then [DONE]
            ev = sse_events(iter(res["a"].text.splitlines()))
            assert res["a"].status_code == 200 and ev[-1] == "[DONE]"
            assert all(e["choices"][0]["finish_reason"] is None for e in ev[:-2])  # no end
            err = ev[-2]["error"]
            assert (err["type"], err["code"]) == ("server_unavailable", "device_failed")
            assert "device cpu:1 failed" in err["message"] and "illegal memory" in err["message"]
            assert "1 other device(s) are serving" in err["message"]
            # b: a plain 503 in OpenAI's shape, with Retry-After
            rb = res["b"]
            assert rb.status_code == 503, rb.text
            assert rb.headers["retry-after"] == "1"
            e = rb.json()["error"]
            assert (e["type"], e["code"], e["param"]) == ("server_unavailable", "device_failed",
                                                         None)
            assert "device cpu:1 failed" in e["message"] and "Retry it" in e["message"]
            # c: a stream that never got a token: role chunk, the error event, [DONE]
            ev = sse_events(iter(res["c"].text.splitlines()))
            assert ev[0]["choices"][0]["delta"] == {"role": "assistant"}
            assert ev[1]["error"]["code"] == "device_failed" and ev[2] == "[DONE]"
            # cpu:1 is out of routing, its slots are free; cpu keeps serving
            assert router.replicas[1].state == "failed" and [r.device for r in router.ranked()] == ["cpu"]
            assert e1.stats().slots_in_use == 0 and e1.stats().queued == 0
            assert isinstance(e1.failure, EngineFailed)
            assert isinstance(e1.failure.__cause__, deviceops.DriverError)
            with pytest.raises(EngineFailed, match="out of service"):
                e1.stream(ids, 2)
            r = await c.post("/v1/completions", json=body(max_tokens=5))
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 5
            assert e0.stats().generated_tokens >= 5
            h = await c.get("/health")
            assert h.status_code == 200 and h.json()["status"] == "degraded"
            st = {e["device"]: e for e in h.json()["engines"]}
            assert st["cpu"]["state"] == "serving" and st["cpu:1"]["state"] == "failed"
            assert "illegal memory" in st["cpu:1"]["error"]
            m = (await c.get("/metrics")).text
            assert _sample(m, "deviceops_engine_up", "cpu:1") == 0.0
            assert _sample(m, "deviceops_engine_up", "cpu") == 1.0
            assert 'deviceops_http_requests_total{endpoint="completions",status="503"} 1.0' in m
            held.cancel()
            # the last device fails too: its request gets 503, then nothing serves
            _fail_decodes(e0)
            r = await c.post("/v1/completions", json=body(max_tokens=3))
            assert r.status_code == 503 and "0 other device(s)" in r.json()["error"]["message"]
            h = await c.get("/health")
            assert h.status_code == 503 and h.json()["status"] == "failed"
            r = await c.post("/v1/completions", json=body())
            assert r.status_code == 503, r.text
            e = r.json()["error"]
            assert e["code"] == "device_failed" and "no device is serving" in e["message"]
            assert "cpu: failed" in e["message"] and "cpu:1: failed" in e["message"]

    anyio.run(main)


def test_fail_stop_engine_ends_queued_and_running_requests() -> None:
    """Engine-level: a failed step ends everything with EngineFailed; a device error in one
    prompt's prefill does too, other prefill errors end only that request."""
    toy = Toy(max_batch=1, max_seq=64)
    eng = Engine(toy, max_batch=1, max_seq=64, fail_stop=True)

    async def main() -> None:
        toy.fail_next = True  # a plain prefill error: only that request ends
        with pytest.raises(RuntimeError, match="toy failure"):
            await eng.generate(_prompt(0, 4), 3)
        assert eng.failure is None and await eng.generate(_prompt(1, 4), 3)
        running = eng.stream(_prompt(2, 4), 10)
        queued = eng.stream(_prompt(3, 4), 10)
        await running.__anext__()
        async def broken(*a: Any) -> list[int]:
            raise deviceops.LaunchError("injected launch failure", op="decode")

        eng.scheduler.submit_decode = lambda *a: (lambda: broken(*a))
        for s in (running, queued):
            with pytest.raises(EngineFailed) as info:
                async for _ in s:
                    pass
            assert isinstance(info.value.__cause__, deviceops.LaunchError)
            assert s.finish_reason == "error"
        assert eng.closed and eng.stats().slots_in_use == 0 and eng.pending_tokens == 0
        with pytest.raises(EngineFailed, match="injected launch failure"):
            eng.stream(_prompt(4, 4), 2)

    anyio.run(main)
    # a launch error in one request's prefill is the device's: the engine fails
    toy2 = Toy(max_batch=2, max_seq=64)
    eng2 = Engine(toy2, max_batch=2, max_seq=64, fail_stop=True)
    real_prefill = eng2.scheduler.submit_prefill

    def bad_prefill(*a: Any, **kw: Any) -> Any:
        real_prefill(*a, **kw)
        raise deviceops.DriverError("injected driver error")

    async def main2() -> None:
        eng2.scheduler.submit_prefill = bad_prefill
        with pytest.raises(EngineFailed):
            await eng2.generate(_prompt(5, 4), 3)
        assert isinstance(eng2.failure, EngineFailed)

    anyio.run(main2)


def test_single_engine_step_failure_is_still_500_and_it_goes_on() -> None:
    """Without --devices nothing changes: a failed step is a 500 and the engine serves on;
    /health has no per-engine list; the metrics have no device label."""
    toy = ToyLM(max_batch=2, max_seq=64)
    app = create_app(lambda: Engine(toy, max_batch=2, max_seq=64), model_name="toy")

    async def main() -> None:
        async with serving(app) as c:
            eng = app.state.serve.engine
            real = eng.scheduler.submit_decode
            calls = 0

            def once(*a: Any) -> Any:
                nonlocal calls
                calls += 1
                if calls == 1:
                    raise RuntimeError("one bad step")
                return real(*a)

            eng.scheduler.submit_decode = once
            r = await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
            assert r.status_code == 500 and "one bad step" in r.json()["error"]["message"]
            r = await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
            assert r.status_code == 200, r.text
            assert eng.failure is None and not eng.closed
            assert (await c.get("/health")).json() == {"status": "ok", "model": "toy"}
            m = (await c.get("/metrics")).text
            assert "deviceops_kv_slots_in_use 0.0" in m and 'device="' not in m

    anyio.run(main)


# -- the command line ---------------------------------------------------------------------
@pytest.mark.parametrize(("text", "gpus", "want"), [
    ("0,1", 2, ["cuda:0", "cuda:1"]),
    ("1", 2, ["cuda:1"]),
    (" cuda:0 , cuda:1 ", 4, ["cuda:0", "cuda:1"]),
    ("all", 3, ["cuda:0", "cuda:1", "cuda:2"]),
    ("ALL", 1, ["cuda:0"]),
    ("cpu:0,cpu:1", 0, ["cpu", "cpu:1"]),
    ("cpu,cpu:2", 0, ["cpu", "cpu:2"]),
])
def test_parse_devices(text: str, gpus: int, want: list[str]) -> None:
    assert serve.parse_devices(text, cuda_count=gpus) == want


@pytest.mark.parametrize(("text", "gpus", "msg"), [
    ("", 2, "comma-separated list"),
    ("0,,1", 2, "comma-separated list"),
    ("gpu1", 2, "'gpu1' is not a device"),
    ("-1", 2, "is not a device"),
    ("0,0", 2, "already listed"),
    ("cpu,cpu:0", 0, "already listed"),
    ("0,cpu:1", 2, "mixes cpu and cuda"),
    ("0,1", 1, "cuda:1 does not exist (this machine has 1 GPU: 0)"),
    ("0,1", 0, "no CUDA GPU"),
    ("all", 0, "use --devices cpu:0,cpu:1"),
])
def test_parse_devices_refuses(text: str, gpus: int, msg: str) -> None:
    with pytest.raises(ValueError, match=re.escape(msg)):
        serve.parse_devices(text, cuda_count=gpus)


def _argv_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        serve.main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_cli_devices_flag(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                          tiny_gguf: str) -> None:
    err = _argv_error(capsys, ["--device", "cpu", "--devices", "cpu:0,cpu:1"])
    assert "--devices: not allowed with argument --device" in err
    err = _argv_error(capsys, ["--devices", "cpu:0,banana"])
    assert "'banana' is not a device" in err and "usage:" in err
    if not deviceops.cuda_available():
        err = _argv_error(capsys, ["--devices", "all"])
        assert "no CUDA GPU" in err and "cpu:0,cpu:1" in err
    with pytest.raises(SystemExit) as info:
        serve.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--devices LIST" in out and "'all'" in out and "cpu:0,cpu:1" in out
    # the flag reaches the loader: one engine per named device (the server is not run)
    loads: list[Callable[[], Any]] = []
    real_create_app = serve.create_app

    def record(load: Callable[[], Any], **kw: Any) -> Any:
        loads.append(load)
        return real_create_app(load, **kw)

    monkeypatch.setattr(serve, "create_app", record)
    monkeypatch.setattr(serve._Server, "run", lambda self, *a, **k: None)
    common = ["--model", tiny_gguf, "--max-batch", "2", "--max-seq", "64", "--log-level",
              "warning"]
    assert serve.main([*common, "--devices", "cpu:0,cpu:1"]) == 1  # never started
    assert serve.main([*common, "--device", "cpu"]) == 1
    # each load starts engine cores (one process per device) and routes over their clients
    router, single = loads[0](), loads[1]()
    try:
        assert isinstance(router, CoreRouter) and router.per_device
        assert [(r.device, r.engine.info["device"], r.process is not None)
                for r in router.replicas if r.engine is not None] == [
            ("cpu", "cpu", True), ("cpu:1", "cpu:1", True)]
        assert isinstance(single, CoreRouter) and not single.per_device
        assert [r.engine.info["device"] for r in single.replicas] == ["cpu"]
        pids = [r.process.pid for rt in (router, single) for r in rt.replicas if r.process]
        assert len(pids) == 3
    finally:
        router.close()
        single.close()
    assert all(r.process.proc.poll() is not None for rt in (router, single)
               for r in rt.replicas if r.process is not None and r.process.proc is not None)


def test_router_refuses_bad_replica_lists() -> None:
    with pytest.raises(ValueError, match="no devices"):
        Router([])
    with pytest.raises(ValueError, match="'cpu' is listed twice"):
        Router([Replica("cpu"), Replica("cpu")])
    r = Router([Replica("cpu", None, "OSError: boom"), Replica("cpu:1", None, "OSError: bang")])
    assert r.pick() is None and r.serving == []
    assert r.unavailable_reason() == ("no device is serving the model; cpu: failed (loading "
                                      "the model failed: OSError: boom); cpu:1: failed "
                                      "(loading the model failed: OSError: bang)")


# -- two GPUs -----------------------------------------------------------------------------
def _gpus() -> int:
    if not deviceops.cuda_available():
        return 0
    # deviceops.backend is not exported at the top level (yet): the core's function then
    from deviceops._device import backend as core_backend

    backend: Any = getattr(deviceops, "backend", core_backend)
    return int(backend("cuda").device_count())


@pytest.mark.gpu
def test_two_gpus_serve_the_single_engine_output(tiny_gguf: str) -> None:
    if _gpus() < 2:
        pytest.skip(f"needs >= 2 CUDA GPUs; this machine has {_gpus()}")
    kw = {"dtype": "float32"}
    single = create_app(lambda: serve.load_engine(tiny_gguf, device=0, **KW, **kw),
                        model_name="tiny")
    multi = devices_app(tiny_gguf, devices=serve.parse_devices("0,1"), **kw)

    async def main() -> None:
        async with serving(single) as c:
            want = await _outputs(c)
        async with serving(multi) as c:
            e0, e1 = engines(multi)
            assert (str(e0.model.device), str(e1.model.device)) == ("cuda:0", "cuda:1")
            assert await _outputs(c) == want
            held = e0.stream(e0.model.encode(PROMPT), 80)
            assert await _outputs(c) == want  # on cuda:1
            assert e1.stats().generated_tokens > 0
            held.cancel()
            m = (await c.get("/metrics")).text
            assert _sample(m, "deviceops_engine_up", "cuda:1") == 1.0
            h = (await c.get("/health")).json()
            assert [e["device"] for e in h["engines"]] == ["cuda:0", "cuda:1"]

    anyio.run(main)


def test_sse_error_event_is_json(tiny_gguf: str) -> None:
    """The SSE error event of a failed device parses as OpenAI's error object."""
    app = devices_app(tiny_gguf, devices=["cpu:1"])

    async def main() -> None:
        async with serving(app) as c:
            (e1,) = engines(app)
            _fail_decodes(e1)
            r = await c.post("/v1/completions", json=body(stream=True))
            lines = [ln for ln in r.text.splitlines() if ln]
            assert lines[-1] == "data: [DONE]"
            err = json.loads(lines[-2][len("data: "):])["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert "0 other device(s)" in err["message"]
            assert (await c.get("/health")).status_code == 503

    anyio.run(main)
