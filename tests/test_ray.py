"""Replicas as Ray actors (``serve --ray``, ``nn.batch_generate(..., ray=...)``) on a real
local Ray cluster: no mocks.

One local cluster (4 logical CPUs, no dashboard) and one pool of two CPU replicas of the
tiny random Llama of :mod:`tests.nn_tiny` (``max_batch`` 4, ``max_seq`` 96) are shared by
the module; each test builds its own front (a :class:`RayRouter` over the same actors, as
a new server process would) and talks to it in-process through httpx's ASGI transport.
Replicas killed here are restarted by Ray and rejoin, so later tests find two again.

Without Ray installed these tests skip, saying what to install; the test of ``--ray``'s
message without Ray runs everywhere (it hides Ray from the import system).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from deviceops import nn
from deviceops.nn import serve
from deviceops.nn.serving.detokenize import Detokenizer as _Detok
from deviceops.nn.serving.http import create_app

from . import nn_tiny
from .test_serve_http import sse_events

HAVE_RAY = importlib.util.find_spec("ray") is not None
needs_ray = pytest.mark.skipif(
    not HAVE_RAY, reason="Ray is not installed: pip install 'deviceops[ray]' to run these")

pytestmark = [pytest.mark.timeout(180)]

SPEC_KW: dict[str, Any] = {"device": "cpu", "max_batch": 4, "max_seq": 96, "prefill_chunk": 32,
                           "num_cpus": 1.0, "max_restarts": 3}
TOKEN = "s3cret"
# prompts whose greedy continuation has no EOS in its first LONG tokens (chosen below)
CANDIDATES = ["the cat in the hat", "hello there", "a b c d e f", "in the beginning",
              "one two three", "the theme", "then he went", "on and on", "in an inn",
              "the other one", "he ate", "at the end", "tea at ten", "an oath", "the heat"]
LONG = 60


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = Path(tmp_path_factory.mktemp("tiny_ray")) / "tiny.gguf"
    nn_tiny.write_gguf(path, nn_tiny.hf_weights(1, tied=False), "F32")
    return str(path)


@pytest.fixture(scope="module")
def lm(tiny_gguf: str) -> Any:
    """The reference: the same GGUF as a local CausalLM."""
    return nn.load_gguf(tiny_gguf, device="cpu", max_batch=4, max_seq=96)


@pytest.fixture(scope="module")
def long_prompts(lm: Any) -> dict[str, list[int]]:
    """Prompts whose greedy continuation runs LONG tokens without EOS, with it."""
    outs = lm.generate(CANDIDATES, LONG)
    good = {p: o for p, o in zip(CANDIDATES, outs, strict=True) if len(o) == LONG}
    assert len(good) >= 8, f"only {len(good)} prompts without an early EOS"
    return good


@pytest.fixture(scope="module")
def pool(tiny_gguf: str) -> Iterator[Any]:
    """A local Ray cluster and two CPU replicas of the tiny model."""
    if not HAVE_RAY:
        pytest.skip("Ray is not installed: pip install 'deviceops[ray]' to run these")
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             object_store_memory=100 * 2**20)
    spec = nn.ReplicaSpec(tiny_gguf, **SPEC_KW)
    replicas = nn.RayReplicas(spec, 2)
    try:
        yield replicas
    finally:
        replicas.shutdown()
        ray.shutdown()


def front(pool: Any) -> Any:
    """A ``serve --ray`` app over ``pool``'s actors (not killing them when it stops)."""
    from deviceops.nn.serving.ray_front import RayRouter, add_admin_routes

    app = create_app(lambda: RayRouter.attach(pool), model_name="tiny")
    add_admin_routes(app, TOKEN)
    return app


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with app.router.lifespan_context(app):
        deadline = time.monotonic() + 60
        while app.state.serve.router is None:
            assert app.state.serve.load_error is None, app.state.serve.load_error
            assert time.monotonic() < deadline, "the replicas did not attach"
            await asyncio.sleep(0.01)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://tiny",
                                     timeout=60) as c:
            yield c


async def wait_for(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def sample(text: str, name: str, replica: str) -> float:
    m = re.search(rf'^{name}{{replica="{replica}"}} (\S+)$', text, re.M)
    assert m, f"{name}{{replica={replica!r}}} missing from /metrics"
    return float(m.group(1))


def http_text(lm: Any, ids: list[int]) -> str:
    """The text the HTTP layer sends for ``ids`` (its incremental detokenizer)."""
    d = _Detok(lm, frozenset(lm.config.stop_ids), [])
    return "".join(d.push(t) for t in ids) + d.finish()


def body(prompt: str, n: int, **kw: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": n, "temperature": 0} | kw


async def until_idle(c: httpx.AsyncClient, names: list[str]) -> str:
    """/metrics once every named replica reports no slot, block or request in use."""
    deadline = time.monotonic() + 15
    while True:
        m = (await c.get("/metrics")).text
        busy = [(n, k) for n in names for k in ("deviceops_kv_slots_in_use",
                                                "deviceops_kv_blocks_in_use",
                                                "deviceops_engine_running_requests",
                                                "deviceops_engine_queued_requests",
                                                "deviceops_engine_pending_tokens")
                if sample(m, k, n) != 0.0]
        if not busy:
            return m
        assert time.monotonic() < deadline, f"still in use: {busy}"
        await asyncio.sleep(0.05)


# -- results ------------------------------------------------------------------------------
@needs_ray
def test_replicas_generate_what_causallm_generates(pool: Any, lm: Any) -> None:
    from deviceops.nn.serving.ray_front import RayRouter

    prompts = CANDIDATES[:6]
    greedy = lm.generate(prompts, 12)
    sampled = lm.generate(prompts, 12, temperature=0.9, top_p=0.9, seed=7)
    router = RayRouter.attach(pool)
    engines = [r.engine for r in router.replicas]
    assert [r.device for r in router.replicas] == ["r0", "r1"] and all(engines)

    async def main() -> None:
        for eng in engines:  # each replica, all prompts at once
            got = await asyncio.gather(*(eng.generate(p, 12) for p in prompts))
            assert got == greedy
            got = await asyncio.gather(*(eng.generate(p, 12, temperature=0.9, top_p=0.9,
                                                      seed=7) for p in prompts))
            assert got == sampled
        s = engines[1].stream(lm.encode(prompts[0]), 12)  # token ids in, streamed out
        assert [t async for t in s] == greedy[0] and s.finish_reason in ("length", "stop")
        with pytest.raises(ValueError, match="outside"):
            engines[0].stream([10**6], 2)

    try:
        asyncio.run(main())
    finally:
        router.close()


@needs_ray
def test_http_front_completions_streams_health_metrics(pool: Any, lm: Any) -> None:
    app = front(pool)
    want = lm.generate("the cat in the hat", 10)
    text = http_text(lm, want)

    async def main() -> None:
        async with serving(app) as c:
            router = app.state.serve.router
            r = await c.post("/v1/completions", json=body("the cat in the hat", 10))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == text
            assert r.json()["usage"]["completion_tokens"] == len(want)
            r = await c.post("/v1/completions", json=body("the cat in the hat", 10, stream=True))
            ev = sse_events(iter(r.text.splitlines()))
            assert ev[-1] == "[DONE]", ev
            assert "".join(e["choices"][0]["text"] for e in ev[:-1]) == text
            msgs = [{"role": "user", "content": "hello there"}]
            r = await c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 6,
                                                           "temperature": 0})
            assert r.status_code == 200, r.text
            chat = lm.generate(lm.apply_chat_template(msgs), 6)
            assert r.json()["usage"]["completion_tokens"] == len(chat)
            # routing: a request held on r0 sends the next one to r1
            e0, e1 = (rep.engine for rep in router.replicas)
            held = e0.stream(lm.encode("hello there"), 80)
            assert router.pick() is router.replicas[1]
            before = (await e1.actor.stats.remote()).generated_tokens
            r = await c.post("/v1/completions", json=body("hello there", 5, ignore_eos=True))
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
            await wait_for(lambda: e1.stats().generated_tokens == before + 5, "r1's stats")
            held.cancel()
            h = await c.get("/health")
            assert h.status_code == 200 and h.json()["status"] == "ok"
            assert [(e["replica"], e["state"], e["error"]) for e in h.json()["engines"]] == [
                ("r0", "serving", None), ("r1", "serving", None)]
            assert h.json()["engines"][0]["device"] == "cpu"
            m = await until_idle(c, ["r0", "r1"])
            for name in ("r0", "r1"):
                assert sample(m, "deviceops_engine_up", name) == 1.0
                assert sample(m, "deviceops_engine_max_batch", name) == 4.0
            assert 'device="' not in m
            # the admin route: token required; a bad body is a 400
            r = await c.get("/admin/replicas")
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            auth = {"Authorization": f"Bearer {TOKEN}"}
            r = await c.get("/admin/replicas", headers=auth)
            assert r.status_code == 200 and len(r.json()["replicas"]) == 2
            r = await c.post("/admin/replicas", headers=auth, json={"add": 0})
            assert r.status_code == 400 and r.json()["error"]["param"] == "add"
            r = await c.post("/admin/replicas", headers=auth, json={"remove": ["r9"]})
            assert r.status_code == 400 and "no replica named 'r9'" in r.text
            r = await c.post("/admin/replicas", headers=auth, json={"remove": ["r0", "r1"]})
            assert r.status_code == 400 and "leave none serving" in r.text
            for wait in (True, False):  # 4 CPUs, 2 held: no room for 3 more, said at once
                r = await c.post("/admin/replicas", headers=auth, json={"add": 3, "wait": wait})
                assert r.status_code == 400, r.text
                assert "3 more replica(s) need 3 CPU" in r.json()["error"]["message"], r.text
            assert len(router.replicas) == 2

    asyncio.run(main())
    off = create_app(lambda: serve.load_engine("smollm2"), model_name="x")  # never loads
    from deviceops.nn.serving.ray_front import add_admin_routes

    add_admin_routes(off, None)

    async def disabled() -> None:
        transport = httpx.ASGITransport(app=off)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as c:
            r = await c.post("/admin/replicas", json={"add": 1})
            assert r.status_code == 403 and "--admin-token" in r.json()["error"]["message"]

    asyncio.run(disabled())


# -- failure ------------------------------------------------------------------------------
@needs_ray
def test_killed_replica_fails_its_requests_others_complete_and_it_rejoins(
        pool: Any, lm: Any, long_prompts: dict[str, list[int]]) -> None:
    import ray

    app = front(pool)
    prompts = list(long_prompts)[:8]

    async def main() -> None:
        async with serving(app) as c:
            router = app.state.serve.router
            e0, e1 = (rep.engine for rep in router.replicas)
            res: dict[int, Any] = {}
            where: dict[int, str] = {}

            async def one(i: int) -> None:
                b = body(prompts[i], LONG, stream=(i % 2 == 0))
                res[i] = await c.post("/v1/completions", json=b)

            base = (await router.replicas[0].actor.stats.remote()).generated_tokens
            tasks = []
            for i in range(len(prompts)):  # alternate: each request goes to the lesser load
                before = (e0.in_flight, e1.in_flight)
                tasks.append(asyncio.create_task(one(i)))
                await wait_for(lambda b=before: (e0.in_flight, e1.in_flight) != b,
                               f"request {i} routed")
                where[i] = "r0" if e0.in_flight > before[0] else "r1"
            assert sorted(where.values()) == ["r0"] * 4 + ["r1"] * 4
            # every request is running (its first token is back); then r0's process dies
            await wait_for(lambda: all(r.out for r in list(e0._reqs.values()) +
                                       list(e1._reqs.values())) and
                           e0.in_flight == 4 and e1.in_flight == 4, "first tokens")
            st = await router.replicas[0].actor.stats.remote()  # r0 is still mid-way
            assert st.running == 4 and st.generated_tokens - base <= 4 * (LONG - 10), st
            ray.kill(router.replicas[0].actor, no_restart=False)
            await asyncio.gather(*tasks)
            for i, r in res.items():
                if where[i] == "r1":  # the survivor's requests: complete and correct
                    assert r.status_code == 200, r.text
                    text = http_text(lm, long_prompts[prompts[i]])
                    if i % 2 == 0:
                        ev = sse_events(iter(r.text.splitlines()))
                        assert ev[-1] == "[DONE]" and "error" not in ev[-2], ev[-2:]
                        assert "".join(e["choices"][0]["text"] for e in ev[:-1]) == text
                    else:
                        assert r.json()["choices"][0]["text"] == text
                elif i % 2 == 0:  # the killed replica's stream: tokens, an error event, [DONE]
                    ev = sse_events(iter(r.text.splitlines()))
                    assert r.status_code == 200 and ev[-1] == "[DONE]"
                    err = ev[-2]["error"]
                    assert (err["type"], err["code"]) == ("server_unavailable", "device_failed")
                    assert "replica r0 failed" in err["message"]
                    assert "1 other replica(s) are serving" in err["message"]
                    # the text sent before the error (perhaps none: a byte-level token may
                    # hold back an incomplete character) is the start of the right answer
                    got = "".join(e["choices"][0]["text"] for e in ev[:-2])
                    assert http_text(lm, long_prompts[prompts[i]]).startswith(got)
                else:  # the killed replica's plain request: 503 with Retry-After
                    assert r.status_code == 503, r.text
                    assert r.headers["retry-after"] == "1"
                    assert r.json()["error"]["code"] == "device_failed"
            assert router.replicas[0].state in ("restarting", "serving")
            # new requests go to the survivor while r0 is away; r1 leaks nothing
            if router.replicas[0].state == "restarting":
                h = (await c.get("/health")).json()
                assert h["status"] == "degraded" and h["engines"][0]["state"] == "restarting"
                r = await c.post("/v1/completions", json=body(prompts[0], 4))
                assert r.status_code == 200, r.text
            m = await until_idle(c, ["r1"])
            assert sample(m, "deviceops_engine_up", "r1") == 1.0
            # Ray restarts r0 and it rejoins: it serves again, with a fresh engine
            await wait_for(lambda: router.replicas[0].state == "serving", "r0 back", 90)
            assert e0.restarts == 1 and router.replicas[0].describe()["restarts"] == 1
            held = e1.stream(lm.encode(prompts[1]), 80)  # load on r1: the next goes to r0
            r = await c.post("/v1/completions", json=body(prompts[2], 6))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == http_text(lm, long_prompts[prompts[2]][:6])
            held.cancel()
            await until_idle(c, ["r0", "r1"])
            h = (await c.get("/health")).json()
            assert h["status"] == "ok", h

    asyncio.run(main())


# -- batch generation ---------------------------------------------------------------------
@needs_ray
def test_batch_generate_in_order_and_redoes_a_dead_replicas_share(pool: Any, lm: Any) -> None:
    import ray

    from deviceops.nn.serving.ray_batch import abatch_generate
    from deviceops.nn.serving.ray_front import RayRouter

    prompts = [CANDIDATES[i % len(CANDIDATES)] + " " * (i // len(CANDIDATES))
               for i in range(40)]
    want = lm.generate(prompts, 16)
    assert nn.batch_generate(prompts, 16, ray=pool, progress=False) == want
    router = RayRouter.attach(pool)
    engines = [r.engine for r in router.replicas]

    async def main() -> list[list[int]]:
        task = asyncio.create_task(abatch_generate(prompts * 3, 16, engines, progress=False))
        await wait_for(lambda: engines[1].stats().generated_tokens > 0 and
                       engines[1].in_flight > 0, "r1 at work")
        ray.kill(router.replicas[1].actor, no_restart=False)  # its share is redone on r0
        out = await task
        await wait_for(lambda: router.replicas[1].state == "serving", "r1 back", 90)
        return out

    try:
        assert asyncio.run(main()) == want * 3
    finally:
        router.close()


# -- scaling ------------------------------------------------------------------------------
@needs_ray
def test_admin_adds_and_removes_replicas_without_dropping_requests(
        pool: Any, lm: Any, long_prompts: dict[str, list[int]]) -> None:
    import ray

    app = front(pool)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    prompts = list(long_prompts)

    async def main() -> None:
        async with serving(app) as c:
            router = app.state.serve.router
            r = await c.post("/admin/replicas", headers=auth, json={"replicas": 3})
            assert r.status_code == 200, r.text
            assert r.json()["added"] == ["r2"] and r.json()["removed"] == []
            assert [e["state"] for e in r.json()["replicas"]] == ["serving"] * 3
            r2 = router.replicas[2]
            # r0 and r1 take nothing for a moment, so that requests go to r2; then r2 is
            # removed while they run
            for rep in router.replicas[:2]:
                rep.engine.draining = True
            posts = [asyncio.create_task(c.post("/v1/completions", json=body(
                p, LONG, stream=True))) for p in prompts[1:4]]
            await wait_for(lambda: r2.engine.in_flight == 3, "three requests on r2")
            for rep in router.replicas[:2]:
                rep.engine.draining = False
            r = await c.post("/admin/replicas", headers=auth, json={"remove": ["r2"]})
            assert r.status_code == 200, r.text
            assert r.json()["removed"] == ["r2"]
            assert [e["replica"] for e in r.json()["replicas"]] == ["r0", "r1"]
            for p, t in zip(prompts[1:4], posts, strict=True):  # none was dropped
                ev = sse_events(iter((await t).text.splitlines()))
                assert ev[-1] == "[DONE]" and "error" not in ev[-2]
                assert "".join(e["choices"][0]["text"] for e in ev[:-1]) == http_text(
                    lm, long_prompts[p])
            assert "r2" not in pool.actors
            with pytest.raises(ray.exceptions.RayActorError):
                await r2.actor.info.remote(False)
            # a replica killed for good stays listed as failed, with why
            r = await c.post("/admin/replicas", headers=auth, json={"add": 1, "wait": True})
            assert r.json()["added"] == ["r3"]
            r3 = router.replicas[2]
            ray.kill(r3.actor)  # no restart
            await wait_for(lambda: r3.state == "failed", "r3 dead")
            assert "will not restart" in r3.error
            r = await c.post("/admin/replicas", headers=auth, json={"replicas": 2})
            assert r.status_code == 200 and r.json()["removed"] == ["r3"], r.text
            assert (await c.get("/health")).json()["status"] == "ok"

    asyncio.run(main())


# -- without Ray --------------------------------------------------------------------------
def test_ray_flag_without_ray_names_the_install(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(SystemExit) as info:
        serve.main(["--ray", "--device", "cpu", "--replicas", "2"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "pip install 'deviceops[ray]'" in err and "usage:" in err
    with pytest.raises(nn.RayMissing, match=re.escape("pip install 'deviceops[ray]'")):
        nn.batch_generate(["hi"], 2, ray=True)
    for argv, msg in ((["--ray", "--devices", "cpu:0,cpu:1"], "--ray and --devices"),
                      (["--replicas", "2"], "--replicas needs --ray")):
        with pytest.raises(SystemExit):
            serve.main(argv)
        assert msg in capsys.readouterr().err


def test_batch_generate_without_ray_runs_one_local_engine(tiny_gguf: str, lm: Any) -> None:
    prompts = CANDIDATES[:5]
    out = nn.batch_generate(prompts, 8, model=tiny_gguf, device="cpu", max_batch=4,
                            max_seq=96, progress=False)
    assert out == lm.generate(prompts, 8)
    assert json.dumps(out)  # plain lists of ints
