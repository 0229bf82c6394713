"""Every example script runs on the cpu backend and passes its own checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

CASES = {
    "demo.py": [],
    "async_pipeline.py": ["--pipelines", "4", "--rounds", "3", "--n", "4096"],
    "trace_overlap.py": ["--out", "{tmp}"],
    "graph_decode_loop.py": [],
}


def test_every_example_is_listed() -> None:
    assert {p.name for p in EXAMPLES.glob("*.py")} == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_runs_on_cpu(name: str, tmp_path: Path) -> None:
    args = [a.replace("{tmp}", str(tmp_path)) for a in CASES[name]]
    env = dict(os.environ, DEVICEOPS_DEVICE="cpu", MPLBACKEND="Agg", PYTHONWARNINGS="default")
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    # an example is what a newcomer runs first (the README's demo runs demo.py): no warning
    out = proc.stdout + proc.stderr
    assert "warning" not in out.lower(), f"{name} printed a warning:\n{out}"
    if name == "trace_overlap.py":
        assert (tmp_path / "trace.json").exists() and (tmp_path / "zip.dot").exists()
