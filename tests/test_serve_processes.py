"""``python -m deviceops.nn.serve`` with its engine-core processes, as a user starts it.

On the cpu backend with the tiny random Llama of :mod:`tests.nn_tiny`: ``--devices
cpu:0,cpu:1``, kill -9 of one core mid-stream fails only that core's requests, the
survivors finish, the core is restarted and serves again with no KV blocks held; SIGTERM
leaves no process behind; a model that cannot load makes ``serve`` exit non-zero with a
one-line reason; a prompt that cannot fit is refused before tokenising; ``--api-servers 2``
runs two fronts on one port; the cores exit when ``serve`` is killed. (The cores and their clients in one process:
``tests/test_serve_cores.py``.)
"""

from __future__ import annotations

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
import pytest

pytestmark = [pytest.mark.timeout(120)]


# -- serve, as a user starts it ------------------------------------------------------------
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def _core_folders() -> set[str]:
    import glob
    import tempfile

    return set(glob.glob(os.path.join(tempfile.gettempdir(), "deviceops-cores-*")))


def test_kill_9_of_one_core_fails_only_its_streams_and_it_comes_back(tiny_gguf: str) -> None:
    import threading

    folders = _core_folders()
    with _serve("--model", tiny_gguf, "--devices", "cpu:0,cpu:1", "--max-batch", "4",
                "--max-seq", "256", env={"DEVICEOPS_CORE_STEP_PAUSE_MS": "20"}) as (proc, url):
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
        # no orphans even after kill -9 of serve itself: the cores watch their parent
        now = [e["pid"] for e in httpx.get(url + "/health").json()["engines"]]
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in now):
            assert time.monotonic() < deadline, [p for p in now if _alive(p)]
            time.sleep(0.1)
        # and the last core to go removed serve's socket folder
        assert _core_folders() - folders == set()


def test_sigterm_stops_every_core_and_leaves_no_process(tiny_gguf: str) -> None:
    """A prompt that cannot fit is refused before tokenising; SIGTERM mid-stream: the
    stream ends normally, serve exits 0 and no core is left."""
    with _serve("--model", tiny_gguf, "--devices", "cpu:0,cpu:1",
                env={"DEVICEOPS_CORE_STEP_PAUSE_MS": "5"}) as (proc, url):
        pids = [e["pid"] for e in httpx.get(url + "/health").json()["engines"]]
        # a prompt longer than max_seq times the longest vocabulary entry cannot fit: a 400
        # naming the context's bound (not --max-prompt-chars' million), before tokenising
        r = httpx.post(url + "/v1/completions", json={"prompt": "ab " * 200_000,
                                                      "max_tokens": 2}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "characters" in err["message"] and "at most" in err["message"], err
        bound = int(re.search(r"at most (\d+)", err["message"]).group(1))  # type: ignore[union-attr]
        assert bound < 600_000
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


@pytest.mark.slow  # ~6 s of process start-ups; ./scripts/test.sh --slow runs it
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
