"""The measurement scripts stay alive: each runs with ``--smoke`` on the cpu backend.

Every script checks its own results (exit status 1 on a wrong result) and writes
its JSON record; a missed performance bar is a measurement, not a failure, so
only the exit status, the record's keys and its correctness section are asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"

# script -> keys every row of its record must carry
SCRIPTS = {
    "overhead.py": {"N", "variant", "ours_us", "reference", "ref_us", "ratio"},
    "await_latency.py": {"variant", "median_us", "p90_us", "reference", "ref_median_us", "ratio"},
    "graph_replay.py": {"variant", "ours_us", "reference", "ref_us", "ratio"},
    "op_cost.py": {"op", "ours_wall_us", "reference", "ref_wall_us", "wall_ratio", "ours_dev_us"},
    "overlap.py": {"policy", "n", "elapsed_ms", "over_T", "efficiency", "ideal_ms", "vs_ideal"},
    "norms.py": {"op", "shape", "dtype", "ours_us", "reference", "ref_us", "ratio"},
}
RECORD_KEYS = {"benchmark", "device", "env", "smoke", "config", "rows", "bars", "checks"}
ENV_KEYS = {"date", "device", "device_name", "python", "numpy", "deviceops"}


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_smoke(script: str, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    args = [sys.executable, str(BENCH / script), "--smoke", "--json", str(out)]
    if script == "overlap.py":
        args += ["--trace", str(tmp_path / "trace.json")]
    env = {**os.environ, "DEVICEOPS_DEVICE": "cpu", "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    log = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, log
    assert "CORRECTNESS FAIL" not in proc.stderr, log
    rec = json.loads(out.read_text())
    assert rec.keys() >= RECORD_KEYS, sorted(rec)
    assert rec["benchmark"] == script.removesuffix(".py")
    assert rec["device"] == "cpu" and rec["smoke"] is True
    assert rec["env"].keys() >= ENV_KEYS, sorted(rec["env"])
    assert rec["checks"]["passed"] is True and rec["checks"]["count"] > 0, rec["checks"]
    assert rec["checks"]["first"], rec["checks"]
    assert rec["rows"], "no rows"
    for row in rec["rows"]:
        assert SCRIPTS[script] <= row.keys(), (sorted(row), SCRIPTS[script])
    assert rec["bars"], "no bars"
    for bar in rec["bars"]:
        assert {"name", "value", "op", "limit", "passed"} <= bar.keys()
        assert ("PASS " if bar["passed"] else "FAIL " if bar["passed"] is False else "SKIP ") + bar["name"] in proc.stdout
    if script == "overlap.py":
        trace = json.loads((tmp_path / "trace.json").read_text())
        assert trace["traceEvents"], "empty trace"
    if script == "await_latency.py":
        assert rec["load_rows"] and all(r["correct"] for r in rec["load_rows"])
