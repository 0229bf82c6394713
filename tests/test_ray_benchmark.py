"""``benchmarks/ray_serve.py --smoke`` stays alive: three servers (plain, ``--ray`` with one
and with two cpu replicas of a tiny random GGUF) on a local Ray cluster, every token
checked, the same greedy text from all three, a clean exit on SIGTERM."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from . import nn_tiny

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                    reason="Ray is not installed: pip install 'deviceops[ray]' to run this")
def test_ray_serve_benchmark_smoke(tmp_path: Path) -> None:
    gguf = tmp_path / "tiny.gguf"
    nn_tiny.write_gguf(gguf, nn_tiny.hf_weights(1, tied=False), "F32")
    out = tmp_path / "ray_serve.json"
    env = {**os.environ, "DEVICEOPS_DEVICE": "cpu", "PYTHONDONTWRITEBYTECODE": "1",
           "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ray_serve.py"), "--smoke",
                           "--gguf", str(gguf), "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=280)
    log = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, log
    assert "smoke: ok" in proc.stdout and "CORRECTNESS FAIL" not in proc.stderr, log
    rec = json.loads(out.read_text())
    assert rec["benchmark"] == "ray_serve" and rec["smoke"] is True and rec["device"] == "cpu"
    assert rec["checks"]["passed"] is True and rec["checks"]["failed_count"] == 0, rec["checks"]
    firsts = rec["checks"]["first"]
    assert any("every token arrived" in c for c in firsts), firsts
    assert any("equal the plain server's" in c for c in firsts), firsts
    assert sum("stopped cleanly on SIGTERM" in c for c in firsts) == 3, firsts
    got = {(r["section"], r["server"]) for r in rec["rows"]}
    assert got == {("overhead", "plain"), ("overhead", "ray x1"), ("scale", "ray x1"),
                   ("scale", "ray x2")}, got
    for r in rec["rows"]:
        want = (4 if r["section"] == "overhead" else 8) * 4  # requests x new tokens
        assert r["tokens"] == want and r["tokens_per_s"] > 0 and r["itl_p50_ms"] > 0, r
    assert len(rec["bars"]) == 2 and all(b["value"] > 0 for b in rec["bars"]), rec["bars"]
    texts = rec["texts"]
    assert texts["ray x1"] == texts["plain"] == texts["ray x2"] and all(texts["plain"])
