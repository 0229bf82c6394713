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


def _run_multi_gpu(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], Path, str]:
    out = tmp_path / "multi_gpu.json"
    args = [sys.executable, str(BENCH / "multi_gpu.py"), "--smoke", "--json", str(out), *extra]
    env = {**os.environ, "DEVICEOPS_DEVICE": "cpu", "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    return proc, out, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_multi_gpu_smoke(tmp_path: Path) -> None:
    """Two emulated cpu devices: zip over devices and peer copies, every output checked."""
    proc, out, log = _run_multi_gpu(tmp_path)
    assert proc.returncode == 0, log
    assert "CORRECTNESS FAIL" not in proc.stderr and "CHECK FAILED" not in proc.stderr, log
    rec = json.loads(out.read_text())
    assert rec.keys() >= RECORD_KEYS | {"devices", "device_names", "ratios", "zip_rows", "correctness"}
    assert rec["benchmark"] == "multi_gpu" and rec["smoke"] is True and rec["device"] == "cpu"
    assert rec["env"].keys() >= ENV_KEYS, sorted(rec["env"])
    assert rec["devices"] == ["cpu", "cpu:1"] and len(rec["device_names"]) == 2
    # the script's own record of its comparisons (not _common's summary)
    checks = rec["checks"]
    assert checks["passed"] is True and checks["failed_count"] == 0 and not checks["failed"], checks
    assert checks["count"] > 0 and rec["correctness"]
    assert all(c["passed"] for c in rec["correctness"])
    kinds = " ".join(checks["first"])
    for what in ("zip/multi: chain 0", "zip/multi: chain 1", "zip/single: chain 1",
                 "copy cpu->cpu:1/ours: bytes", "copy cpu:1->cpu/ours: bytes"):
        assert what in kinds, (what, checks["first"])
    benches = [r["bench"] for r in rec["rows"]]
    assert benches[:3] == ["zip", "peer copy", "peer copy"], benches
    for row in rec["rows"]:
        assert {"bench", "variant", "ours_ms", "reference", "ref_ms", "ratio"} <= row.keys(), sorted(row)
        assert row["ours_ms"] > 0
    assert rec["rows"][0]["ratio"] > 0 and rec["rows"][0]["ref_ms"] > 0  # the zip: single-device reference
    assert {r["key"] for r in rec["zip_rows"]} == {"alone", "single", "multi"}
    assert rec["ratios"].keys() == {"zip_multi_over_single", "copy_0to1_ours_over_torch",
                                    "copy_1to0_ours_over_torch", "serve_two_over_one"}
    assert rec["ratios"]["serve_two_over_one"] is None  # (no --serve)
    assert len(rec["bars"]) == 3
    for bar in rec["bars"]:
        assert ("PASS " if bar["passed"] else "FAIL " if bar["passed"] is False else "SKIP ") + bar["name"] in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_multi_gpu_checks_can_fail(tmp_path: Path) -> None:
    """Corrupted references: the script records the failures and exits 1."""
    proc, out, log = _run_multi_gpu(tmp_path, "--inject-error", "--no-host")
    assert proc.returncode == 1, log
    assert "CORRECTNESS FAIL" in proc.stderr, log
    rec = json.loads(out.read_text())
    assert rec["checks"]["passed"] is False and rec["checks"]["failed_count"] > 0
    failed = " ".join(c["what"] for c in rec["checks"]["failed"])
    assert "zip/multi: chain 1 output vs float64 reference" in failed
    assert "copy cpu->cpu:1/ours: bytes equal" in failed


def test_multi_gpu_serve_smoke(tmp_path: Path) -> None:
    """The serving section on two emulated cpu devices: four servers (one device at half and
    full clients, twice the rows, --devices cpu,cpu:1), every requested token received."""
    sys.path.insert(0, str(Path(__file__).parent))
    import nn_tiny

    gguf = tmp_path / "tiny.gguf"
    nn_tiny.write_gguf(gguf, nn_tiny.hf_weights(1, tied=False), "F32")
    proc, out, log = _run_multi_gpu(tmp_path, "--serve", str(gguf), "--serve-only")
    assert proc.returncode == 0, log
    rec = json.loads(out.read_text())
    assert rec["checks"]["passed"] is True and rec["checks"]["count"] == 4, rec["checks"]
    assert [r["clients"] for r in rec["rows"]] == [2, 4, 4, 4]
    assert rec["rows"][-1]["variant"].startswith("2 devices (cpu,cpu:1)")
    assert all(r["tokens_per_s"] > 0 for r in rec["rows"])
    assert rec["ratios"]["serve_two_over_one"] == rec["serve"]["ratio"]
    assert len(rec["bars"]) == 2
