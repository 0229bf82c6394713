"""The first ten minutes (issue 35, items 4 and 5): API edges a newcomer hits, and the CLIs.

* ``numpy.asarray(tensor)`` is refused (naming ``api.to_host``); NumPy arguments to kernels
  and copies are refused naming ``api.from_host``; a shape no device could hold is refused
  before allocating, with a ``DeviceError`` naming the bytes;
* every ``generate``/``stream``/``Engine`` argument is validated, the error naming it;
* ``examples/trace_overlap.py`` writes into a temporary folder unless told otherwise;
* ``python -m deviceops.nn.generate``: the chat template by default for a model that has
  one (``--raw`` to continue the text), no control tokens printed, tokens/s with ``-v``;
  ``--help`` of both CLIs shows the defaults;
* the server: "ready" only once the model is loaded, one log line per request.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import pytest

import deviceops
from deviceops import api, kernels

from . import nn_tiny

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- tensors and kernels


def test_numpy_conversion_of_a_tensor_is_refused_naming_to_host() -> None:
    t = api.ones((2, 3)).sync()
    for convert in (np.asarray, np.array, lambda x: np.ones((2, 3)) + x):
        with pytest.raises(TypeError, match=r"api\.to_host\(t\)\.sync\(\)"):
            convert(t)
    assert api.to_host(t).sync().tolist() == [[1.0] * 3] * 2  # the explicit way works


def test_numpy_arguments_are_refused_naming_from_host() -> None:
    t = api.ones((4,)).sync()
    host = np.ones(4, np.float32)
    for call in (lambda: kernels.add(host, t), lambda: kernels.gemm(t.reshape((2, 2)), [[1.0]]),
                 lambda: kernels.rms_norm(host, t), lambda: api.memcpy(t, host),
                 lambda: api.dup(host)):
        with pytest.raises(TypeError, match=r"api\.from_host"):
            call()
    with pytest.raises(TypeError, match="host data already"):
        api.to_host(host)
    # the fix the message names works
    assert api.to_host(kernels.add(api.from_host(host), t)).sync().tolist() == [2.0] * 4


@pytest.mark.parametrize("shape", [(2**40, 2**40), (2**20, 2**20), (10**6, 10**6, 10**6)])
def test_a_shape_no_device_holds_is_refused_before_allocating(shape: tuple[int, ...]) -> None:
    for make in (api.empty, api.zeros):
        with pytest.raises(deviceops.DeviceError) as info:
            make(shape).sync()
        msg = str(info.value)
        nbytes = int(np.prod(np.array(shape, dtype=object))) * 4
        assert f"{nbytes:,} bytes" in msg and "refused before allocating" in msg, msg
        assert isinstance(info.value, MemoryError)  # (OutOfMemoryError)
    assert api.empty((1000, 1000)).sync().shape == (1000, 1000)  # and the device still works


# ----------------------------------------------------------------------------- generation arguments


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from deviceops import nn

    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    nn_tiny.write_gguf(path, nn_tiny.hf_weights(1, tied=False))
    return nn.load_gguf(path, device="cpu", dtype="float32", max_batch=2, max_seq=64)


BAD_ARGS: list[tuple[dict[str, Any], str]] = [
    ({"seed": "x"}, "seed"), ({"seed": "5"}, "seed"), ({"seed": -1}, "seed"),
    ({"seed": 2**63}, "seed"), ({"seed": 1.5}, "seed"), ({"seed": True}, "seed"),
    ({"temperature": "1"}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": -0.5}, "temperature"), ({"top_k": -1}, "top_k"), ({"top_k": 2.0}, "top_k"),
    ({"top_k": "3"}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_p": "0.9"}, "top_p"), ({"stop": "5"}, "stop"), ({"stop": 5}, "stop"),
    ({"stop": [1, "2"]}, "stop"),
]


@pytest.mark.parametrize(("kw", "name"), BAD_ARGS)
def test_generate_arguments_are_validated(tiny: Any, kw: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        tiny.generate([5, 9, 40], 2, **kw)

    async def stream() -> None:
        async for _ in tiny.stream([5, 9, 40], 2, **kw):
            pass

    with pytest.raises(ValueError, match=name):
        anyio.run(stream)


@pytest.mark.parametrize(("kw", "name"), BAD_ARGS)
def test_engine_arguments_are_validated(kw: dict[str, Any], name: str) -> None:
    from deviceops.nn import Engine

    from .test_engine import Toy

    eng = Engine(Toy(max_batch=2, max_seq=16), max_batch=2, max_seq=16)
    with pytest.raises(ValueError, match=name):
        eng.stream([1, 2, 3], 2, **kw)
    assert eng.stats().queued == 0


def test_max_new_tokens_and_huge_top_k(tiny: Any) -> None:
    for bad in (2.5, -1, "3", True):
        with pytest.raises((ValueError, TypeError), match="max_new_tokens"):
            tiny.generate([5, 9], bad)
    # a top_k beyond any vocabulary keeps every token: the same as off, no OverflowError
    ids = [5, 9, 40, 7]
    assert tiny.generate(ids, 4, temperature=0.8, top_k=10**30, seed=3) == tiny.generate(
        ids, 4, temperature=0.8, seed=3)
    assert tiny.generate(ids, 3, seed=np.int64(5)) == tiny.generate(ids, 3, seed=5)


# ----------------------------------------------------------------------------- examples


def test_trace_example_writes_into_a_temporary_folder(tmp_path: Path) -> None:
    env = {"DEVICEOPS_DEVICE": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "trace_overlap.py"),
                           "--branches", "2"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []  # nothing in the working directory
    wrote = [w for w in proc.stdout.split() if w.endswith("trace.json")]
    assert wrote and Path(wrote[0]).exists() and "deviceops-trace-" in wrote[0]


# ----------------------------------------------------------------------------- the generate CLI


def test_generate_cli_chat_by_default_raw_and_verbose(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from deviceops import nn
    from deviceops.nn.generate import main

    path = tmp_path / "tiny.gguf"
    nn_tiny.write_gguf(path, nn_tiny.hf_weights(2, tied=False))
    m = nn.load_gguf(path, device="cpu", dtype="float32", max_batch=1, max_seq=64)
    common = ["--model", str(path), "--device", "cpu", "--max-new-tokens", "5"]
    capsys.readouterr()
    assert main(["the cat", *common, "-v"]) == 0
    out, err = capsys.readouterr()
    chat = m.apply_chat_template([{"role": "user", "content": "the cat"}])
    ids = m.generate(chat, 5)
    stops = set(m.config.stop_ids)
    want = m.tokenizer.decode([i for i in ids if i not in stops], skip_special_tokens=True)
    assert out == want + "\n"  # the answer only: no prompt echo, no control token
    assert f"{len(ids)} tokens in " in err and "tokens/s" in err, err
    assert "; first token after 0." in err and "then " in err, err  # (a small model: < 1 s)
    assert main(["the cat", *common, "--raw"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("the cat")


def test_control_tokens_are_never_printed(tiny: Any) -> None:
    from deviceops.nn.generate import visible_text

    eos = sorted(tiny.config.stop_ids)[0]
    text = visible_text(tiny, [5, 9, eos])
    assert text == visible_text(tiny, [5, 9])
    assert tiny.tokenizer.id_to_token(eos) not in text


def test_generate_cli_chat_flag_needs_a_template(tmp_path: Path) -> None:
    import argparse

    from deviceops.nn.generate import use_chat

    class NoTemplate:
        def apply_chat_template(self, messages: Any) -> str:
            raise ValueError("apply_chat_template: this checkpoint has no chat template")

    ns = argparse.Namespace(raw=False, chat=False)
    assert use_chat(NoTemplate(), ns) is False
    with pytest.raises(ValueError, match="--chat"):
        use_chat(NoTemplate(), argparse.Namespace(raw=False, chat=True))


@pytest.mark.parametrize("module", ["deviceops.nn.generate", "deviceops.nn.serve",
                                    "deviceops.precompile"])
def test_cli_help_shows_defaults(module: str) -> None:
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("(default:") >= 3, proc.stdout


def test_timing_line_reports_tokens_per_second() -> None:
    from deviceops.nn.generate import timing_line

    class M:
        device, dtype = "cpu", "float32"

    line = timing_line(21, 2.0, 0.5, M())
    assert "21 tokens in 2.00 s: 10.5 tokens/s" in line and "then 13.3 tokens/s" in line
    assert "then" not in timing_line(1, 2.0, 0.5, M())  # one token: no decode rate
    assert "then 1.0 tokens/s" in timing_line(2, 2.0, 1.0, M())
    assert "then" not in timing_line(2, 1.0, 1.0, M())  # all of it before the first token
    assert "0 tokens in 0.00 s: 0.0 tokens/s" in timing_line(0, 0.0, 0.0, M())


def test_generate_cli_refuses_a_missing_device_or_file(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from deviceops.nn.generate import main

    with pytest.raises(SystemExit) as exc:
        main(["hi", "--device", "cuda:99"])
    assert exc.value.code == 2 and "--device cuda:99" in capsys.readouterr().err
    assert main(["hi", "--model", str(tmp_path / "missing.gguf")]) == 2  # refused before loading
    assert "missing.gguf" in capsys.readouterr().err
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    assert main(["hi", "--device", "cpu", "--model", str(bad)]) == 1  # the load fails: one line
    err = capsys.readouterr().err
    assert "bad.gguf" in err and "Traceback" not in err


# ----------------------------------------------------------------------------- the server's log


def test_compile_bar_shows_only_when_kernels_compile() -> None:
    """generate's "compiling kernels" bar: nothing while every load is a cache hit, then one
    bar counting loads from the first slow one; closed (and gone) at the first token."""
    import io

    from deviceops.nn.generate import CompileBar

    out = io.StringIO()
    bar = CompileBar(file=out)
    bar(0.001)
    bar(0.002)
    assert bar.bar is None and out.getvalue() == ""
    bar(0.8)
    bar(0.001)
    assert bar.bar is not None and bar.bar.n == 4 and bar.loads == 4
    assert "compiling kernels (first use on this GPU)" in out.getvalue()
    bar.close()
    assert bar.bar is None
    bar.close()  # twice: nothing


def test_program_load_hooks_are_called_and_removed() -> None:
    from deviceops._backend import program_loaded

    seen: list[float] = []
    remove = deviceops.on_program_load(seen.append)
    try:
        program_loaded(0.25)
    finally:
        remove()
    program_loaded(0.5)
    remove()  # twice: nothing
    assert seen == [0.25]
    with pytest.raises(TypeError, match="must be callable"):
        deviceops.on_program_load(3)  # type: ignore[arg-type]


@pytest.mark.gpu
def test_a_kernel_compile_calls_the_program_load_hooks() -> None:
    seen: list[float] = []
    remove = deviceops.on_program_load(seen.append)
    try:
        src = 'extern "C" __global__ void deviceops_hook_probe_%d(float* x) { x[0] = 1.0f; }'
        deviceops.default_device().backend.load_program(deviceops.default_device(),
                                                        src % np.random.default_rng().integers(1 << 30))
    finally:
        remove()
    assert len(seen) == 1 and seen[0] > 0


def test_access_log_one_line_per_request(caplog: pytest.LogCaptureFixture) -> None:
    from deviceops.nn.serving.access_log import SCOPE_KEY, AccessLog

    class Stream:
        tokens = (1, 2, 3)

    health = [503, 200, 500]  # loading, ready, broken

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["path"] == "/gen":
            scope[SCOPE_KEY] = Stream()
        status = {"/no": 404, "/health": health.pop(0) if scope["path"] == "/health" else 0}
        await send({"type": "http.response.start", "status": status.get(scope["path"], 200),
                    "headers": []})
        await send({"type": "http.response.body", "body": b"x"})

    async def main() -> None:
        transport = httpx.ASGITransport(app=AccessLog(app))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            await c.get("/health")
            await c.get("/health")
            await c.post("/gen", json={})
            await c.get("/no")
            await c.get("/health")

    def logged(level: int) -> list[str]:
        caplog.clear()
        with caplog.at_level(level, logger="deviceops.nn.serve"):
            anyio.run(main)
        return [r.getMessage() for r in caplog.records if r.name == "deviceops.nn.serve"]

    # the default level (info): the readiness polls (503, then 200) are not logged; a
    # /health answering something else is
    health[:] = [503, 200, 500]
    lines = logged(logging.INFO)
    assert len(lines) == 3, lines
    assert lines[0].startswith("POST /gen 200 3 tokens ") and lines[0].endswith(" s")
    assert lines[1].startswith("GET /no 404 - ")
    assert lines[2].startswith("GET /health 500 - ")
    health[:] = [503, 200, 500]
    lines = logged(logging.DEBUG)  # --log-level debug shows every poll
    starts = ["GET /health 503 - ", "GET /health 200 - ", "POST /gen 200 3 tokens ",
              "GET /no 404 - ", "GET /health 500 - "]
    assert len(lines) == len(starts), lines
    assert all(ln.startswith(s) for ln, s in zip(lines, starts, strict=True)), lines


def test_listening_line_does_not_claim_ready() -> None:
    from deviceops.nn.serving.access_log import ListeningFilter

    rec = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1,
                            "Uvicorn running on %s://%s:%d (Press CTRL+C to quit)",
                            ("http", "127.0.0.1", 8000), None)
    assert ListeningFilter().filter(rec)
    msg = rec.getMessage()
    assert msg.startswith("listening on http://127.0.0.1:8000") and "ready" in msg
    assert "running" not in msg


def test_server_says_ready_only_once_loaded(caplog: pytest.LogCaptureFixture) -> None:
    import threading

    from starlette.testclient import TestClient

    from deviceops.nn.serving.engine import Engine
    from deviceops.nn.serving.http import create_app

    from .test_serve_http import ToyLM

    gate = threading.Event()

    def load() -> Engine:
        gate.wait(30)
        return Engine(ToyLM(max_batch=2, max_seq=32))

    app = create_app(load)
    with caplog.at_level(logging.INFO, logger="deviceops.nn.serve"), TestClient(app) as c:
        assert c.get("/health").status_code == 503
        assert not any("ready" in r.getMessage() for r in caplog.records)
        gate.set()
        for _ in range(400):
            if c.get("/health").status_code == 200:
                break
            anyio.run(anyio.sleep, 0.01)
        assert c.get("/health").status_code == 200
    assert any(r.getMessage().startswith("ready: model smollm2 loaded") for r in caplog.records)
