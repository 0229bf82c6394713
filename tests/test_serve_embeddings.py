"""``POST /v1/embeddings`` (:mod:`deviceops.nn.serving.embeddings`) over a tiny random BERT.

Real uvicorn on a free localhost port (``ServerThread`` of ``test_serve_http.py``): the
embedding model alone (no chat routes) and beside the toy chat engine; OpenAI's response
shape, float and base64 equal to ``Encoder.embed``, ``usage``; the bad-request battery
(400s naming the field, 404 for another model); the event loop answering while a slow
forward runs; the service under asyncio and trio; the ``serve`` flags refused before
anything starts.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from deviceops import nn
from deviceops.nn.serving import cli
from deviceops.nn.serving.embeddings import EmbeddingService, parse_embedding_request
from deviceops.nn.serving.engine import Engine
from deviceops.nn.serving.http import create_app

from .test_nn_encoder import tiny
from .test_serve_http import ServerThread, ToyLM

pytestmark = [pytest.mark.timeout(90)]


@pytest.fixture(scope="module")
def enc() -> nn.Encoder:
    return tiny()


@pytest.fixture
def alone(enc: nn.Encoder) -> Iterator[ServerThread]:
    app = create_app(None, model_name="tiny-bert",
                     embedding=EmbeddingService("tiny-bert", lambda: enc))
    with ServerThread(app) as srv:
        srv.wait_healthy()
        yield srv


def test_embeddings_alone(alone: ServerThread, enc: nn.Encoder) -> None:
    texts = ["the cat sat on the mat.", "hello world!", "cat"]
    want = enc.embed(texts)
    with httpx.Client(base_url=alone.url, timeout=30) as c:
        assert c.get("/health").json() == {"status": "ok", "model": "tiny-bert"}
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny-bert"]
        assert c.get("/v1/models/tiny-bert").json()["id"] == "tiny-bert"
        r = c.post("/v1/embeddings", json={"model": "tiny-bert", "input": texts})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["model"] == "tiny-bert"
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        assert all(d["object"] == "embedding" for d in body["data"])
        got = np.array([d["embedding"] for d in body["data"]])
        np.testing.assert_allclose(got, want, atol=1e-7)
        n = sum(len(s) for s in enc.encode_batch(texts))
        assert body["usage"] == {"prompt_tokens": n, "total_tokens": n} and n == 9 + 5 + 3
        r = c.post("/v1/embeddings", json={"model": "tiny-bert", "input": texts,
                                           "encoding_format": "base64", "user": "u1",
                                           "dimensions": 32})
        raw = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
               for d in r.json()["data"]]
        np.testing.assert_array_equal(np.array(raw), want)
        # one string; one list of token ids; several lists of token ids
        one = c.post("/v1/embeddings", json={"model": "tiny-bert", "input": "cat"}).json()
        np.testing.assert_allclose(one["data"][0]["embedding"], want[2], atol=1e-7)
        ids = enc.encode("hello world!")
        r1 = c.post("/v1/embeddings", json={"model": "tiny-bert", "input": ids}).json()
        np.testing.assert_allclose(r1["data"][0]["embedding"], want[1], atol=1e-7)
        assert r1["usage"]["prompt_tokens"] == len(ids)
        r2 = c.post("/v1/embeddings", json={"model": "tiny-bert", "input": [ids, [2, 5, 3]]})
        np.testing.assert_allclose(np.array([d["embedding"] for d in r2.json()["data"]]),
                                   want[1:], atol=1e-7)
        # no chat model: no completion routes
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"
        m = c.get("/metrics").text
        assert 'deviceops_http_requests_total{endpoint="embeddings",status="200"} 5.0' in m


BAD: list[tuple[Any, int, str | None, str | None]] = [
    (b"{not json", 400, None, None),
    ([1, 2], 400, None, None),
    ({"input": "x"}, 400, "model", None),
    ({"model": "other", "input": "x"}, 404, "model", "model_not_found"),
    ({"model": "tiny-bert"}, 400, "input", None),
    ({"model": "tiny-bert", "input": ""}, 400, "input", None),
    ({"model": "tiny-bert", "input": []}, 400, "input", None),
    ({"model": "tiny-bert", "input": [[]]}, 400, "input", None),
    ({"model": "tiny-bert", "input": ["a", ""]}, 400, "input", None),
    ({"model": "tiny-bert", "input": ["a", [2, 3]]}, 400, "input", None),
    ({"model": "tiny-bert", "input": [[2, "x"]]}, 400, "input", None),
    ({"model": "tiny-bert", "input": [True, 3]}, 400, "input", None),
    ({"model": "tiny-bert", "input": {"a": 1}}, 400, "input", None),
    ({"model": "tiny-bert", "input": [2, 99, 3]}, 400, "input", None),
    ({"model": "tiny-bert", "input": [[2] * 65]}, 400, "input", "context_length_exceeded"),
    ({"model": "tiny-bert", "input": "cat " * 63}, 400, "input", "context_length_exceeded"),
    ({"model": "tiny-bert", "input": ["x"] * 2049}, 400, "input", None),
    ({"model": "tiny-bert", "input": "x", "encoding_format": "int8"}, 400, "encoding_format",
     None),
    ({"model": "tiny-bert", "input": "x", "dimensions": 16}, 400, "dimensions",
     "unsupported_parameter"),
    ({"model": "tiny-bert", "input": "x", "user": 3}, 400, "user", None),
    ({"model": "tiny-bert", "input": "x", "truncate": True}, 400, "truncate", None),
]


def test_bad_requests(alone: ServerThread) -> None:
    with httpx.Client(base_url=alone.url, timeout=30) as c:
        for body, status, param, code in BAD:
            kw: dict[str, Any] = ({"content": body, "headers": {"Content-Type": "application/json"}}
                                  if isinstance(body, bytes) else {"json": body})
            r = c.post("/v1/embeddings", **kw)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["message"], body
            assert err["param"] == param and err["code"] == code, (body, err)
        r = c.post("/v1/embeddings", json={"model": "tiny-bert", "input": [[2] * 65]})
        assert "at most 64 tokens" in r.json()["error"]["message"]
        r = c.post("/v1/embeddings", json={"model": "tiny-bert", "input": ["x"] * 2049})
        assert "at most 2048" in r.json()["error"]["message"]
        assert c.get("/health").status_code == 200


def test_beside_chat(enc: nn.Encoder) -> None:
    toy = ToyLM(max_batch=4, max_seq=64, delay=0.0)
    app = create_app(lambda: Engine(toy, max_batch=4, max_seq=64, max_queue=8), model_name="toy",
                     embedding=EmbeddingService("tiny-bert", lambda: enc))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        srv.wait_healthy()
        deadline = time.monotonic() + 30
        while c.get("/health").json().get("embedding_model", {}).get("status") != "ok":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["toy", "tiny-bert"]
        assert c.get("/v1/models/tiny-bert").status_code == 200
        r = c.get("/v1/models/nope")
        assert r.status_code == 404 and "'toy' and 'tiny-bert'" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"model": "toy", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        r = c.post("/v1/embeddings", json={"model": "tiny-bert", "input": "cat"})
        np.testing.assert_allclose(r.json()["data"][0]["embedding"], enc.embed("cat")[0],
                                   atol=1e-7)
        # each endpoint answers for its own model only
        assert c.post("/v1/embeddings", json={"model": "toy", "input": "x"}).status_code == 404
        assert c.post("/v1/completions", json={"model": "tiny-bert", "prompt": "x"}
                      ).status_code == 404


def test_the_loop_answers_while_a_forward_runs(enc: nn.Encoder) -> None:
    class Slow:
        """The encoder, with a forward that takes 0.8 s."""

        def __getattr__(self, name: str) -> Any:
            return getattr(enc, name)

        def embed_ids(self, ids: Any) -> np.ndarray:
            time.sleep(0.8)
            return enc.embed_ids(ids)

    app = create_app(None, model_name="tiny-bert",
                     embedding=EmbeddingService("tiny-bert", lambda: Slow()))  # type: ignore[arg-type,return-value]
    with ServerThread(app) as srv:
        srv.wait_healthy()
        done: list[int] = []
        t = threading.Thread(target=lambda: done.append(httpx.post(
            srv.url + "/v1/embeddings", json={"model": "tiny-bert", "input": "cat"},
            timeout=30).status_code))
        t.start()
        time.sleep(0.2)
        t0 = time.monotonic()
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
        assert time.monotonic() - t0 < 0.3 and not done  # answered during the forward
        t.join()
        assert done == [200]


def test_a_failed_load_is_reported(enc: nn.Encoder) -> None:
    def boom() -> nn.Encoder:
        raise FileNotFoundError("no weights here")

    app = create_app(None, model_name="x", embedding=EmbeddingService("x", boom))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        deadline = time.monotonic() + 10
        while c.get("/health").json()["status"] == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        h = c.get("/health")
        assert h.status_code == 503 and h.json() == {
            "status": "failed", "error": "FileNotFoundError: no weights here"}
        r = c.post("/v1/embeddings", json={"model": "x", "input": "a"})
        assert r.status_code == 503 and "no weights here" in r.json()["error"]["message"]
    with pytest.raises(ValueError, match="nothing to serve"):
        create_app(None)


@pytest.mark.anyio
async def test_service_under_asyncio_and_trio(enc: nn.Encoder) -> None:
    svc = EmbeddingService("tiny-bert", lambda: enc)
    assert svc.status == "loading"
    await svc.load()
    assert svc.status == "ok"
    job = parse_embedding_request({"model": "tiny-bert", "input": ["cat", "hello world!"]},
                                  "tiny-bert", enc)
    assert job.tokens == 3 + 5 and not job.base64
    got = await svc.embed(job)
    np.testing.assert_allclose(got, enc.embed(["cat", "hello world!"]), atol=0)


@pytest.mark.anyio
async def test_requests_waiting_are_embedded_together(enc: nn.Encoder) -> None:
    import anyio

    calls: list[int] = []

    class Slow:
        """The encoder; each forward takes 0.2 s (the others queue up behind the first)."""

        def __getattr__(self, name: str) -> Any:
            return getattr(enc, name)

        def embed_ids(self, ids: Any) -> np.ndarray:
            calls.append(len(ids))
            time.sleep(0.2)
            return enc.embed_ids(ids)

    svc = EmbeddingService("tiny-bert", lambda: Slow())  # type: ignore[arg-type,return-value]
    await svc.load()
    texts = [["cat"], ["hello world!", "the dog"], ["a big red dog"], ["mat", "run", "jump"]]
    jobs = [parse_embedding_request({"model": "tiny-bert", "input": t}, "tiny-bert", enc)
            for t in texts]
    got: dict[int, np.ndarray] = {}

    async def one(i: int) -> None:
        got[i] = await svc.embed(jobs[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(jobs)):
            tg.start_soon(one, i)
            await anyio.sleep(0.01 if i == 0 else 0)  # the first starts the first forward
    assert svc.forwards == 2 and calls == [1, 6], calls  # the rest went together
    for i, t in enumerate(texts):
        np.testing.assert_allclose(got[i], enc.embed(t), atol=1e-6)

    class Broken:
        def __getattr__(self, name: str) -> Any:
            return getattr(enc, name)

        def embed_ids(self, ids: Any) -> np.ndarray:
            raise RuntimeError("device on fire")

    bad = EmbeddingService("tiny-bert", lambda: Broken())  # type: ignore[arg-type,return-value]
    await bad.load()
    errors: list[str] = []

    async def fails(i: int) -> None:
        try:
            await bad.embed(jobs[i])
        except RuntimeError as exc:
            errors.append(str(exc))

    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(fails, i)
    assert errors == ["device on fire"] * 3


@pytest.mark.parametrize(("argv", "says"), [
    (["--embedding-model", "nope"], "unknown embedding model 'nope'"),
    (["--embedding-model", "minilm", "--devices", "cpu:0,cpu:1"], "--devices spreads a chat"),
    (["--embedding-model", "minilm", "--api-servers", "2"], "--api-servers spreads a chat"),
])
def test_serve_refuses_before_starting(argv: list[str], says: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert says in capsys.readouterr().err


def test_serve_flags_reach_the_app(monkeypatch: pytest.MonkeyPatch, enc: nn.Encoder) -> None:
    """``--embedding-model`` alone: no chat load, the embedding model's name; with ``--model``:
    both (the server is not run; the embedding loader is called to check where it loads)."""
    from deviceops.nn.serving import cli as serve_cli

    seen: list[tuple[Any, dict[str, Any]]] = []
    real = serve_cli.create_app

    def record(load: Any, **kw: Any) -> Any:
        seen.append((load, kw))
        return real(load, **kw)

    loaded: list[dict[str, Any]] = []
    monkeypatch.setattr(serve_cli, "create_app", record)
    monkeypatch.setattr(serve_cli._Server, "run", lambda self, *a, **k: None)
    monkeypatch.setattr(serve_cli, "load_named_encoder",
                        lambda model, **kw: loaded.append({"model": model, **kw}) or enc)
    assert serve_cli.main(["--embedding-model", "minilm", "--device", "cpu",
                           "--log-level", "warning"]) == 1  # (never started)
    assert serve_cli.main(["--model", "smollm2", "--embedding-model", "minilm",
                           "--log-level", "warning"]) == 1
    (load0, kw0), (load1, kw1) = seen
    assert load0 is None and kw0["model_name"] == "minilm" and kw0["embedding"].name == "minilm"
    assert callable(load1) and kw1["model_name"] == "smollm2"
    assert kw1["embedding"].name == "minilm"
    assert kw0["embedding"]._load() is enc
    assert loaded == [{"model": "minilm", "device": "cpu", "dtype": None}]
