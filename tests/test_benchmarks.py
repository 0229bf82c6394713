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

import numpy as np
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
    "tenants.py": {"scenario", "lib", "mode", "small_jobs_s", "small_p50_ms", "small_p99_ms", "work_x"},
    "quant_gemv.py": {"bench", "fmt", "M", "ours_us", "reference", "ref_us", "ratio"},
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
    assert rec["checks"]["failed_count"] == 0 and rec["checks"]["first"], rec["checks"]
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
    assert {r["key"] for r in rec["zip_rows"]} == {"alone", "single", "multi", "alone_sync",
                                                   "single_sync", "multi_sync"}
    assert rec["ratios"].keys() == {"zip_multi_over_single", "copy_0to1_ours_over_torch",
                                    "copy_1to0_ours_over_torch", "serve_two_over_one"}
    assert rec["ratios"]["serve_two_over_one"] is None  # (no --serve)
    assert len(rec["bars"]) == 4
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


@pytest.mark.slow  # four servers, each with its engine-core processes (~12 s)
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


# -- checks that can fail, and the reference-only --smoke modes (issue 36) ---------------------

def _run_bench(tmp_path: Path, script: str, *extra: str, env_extra: dict[str, str] | None = None,
               timeout: int = 120) -> tuple[subprocess.CompletedProcess[str], Path, str]:
    out = tmp_path / f"{script}.json"
    args = [sys.executable, str(BENCH / script), "--smoke", "--json", str(out), *extra]
    env = {**os.environ, "DEVICEOPS_DEVICE": "cpu", "PYTHONDONTWRITEBYTECODE": "1",
           **(env_extra or {})}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, out, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"


def test_common_checks_compare_and_can_be_false() -> None:
    sys.path.insert(0, str(BENCH))
    import _common

    saved = list(_common._checks)
    try:
        _common._checks.clear()
        assert _common.checks_summary()["passed"] is False  # no comparison made: not a pass
        _common.check_equal(np.arange(4.0), np.arange(4.0), "equal")
        _common.check_close(np.ones(3) * (1 + 1e-7), np.ones(3), "close", rtol=1e-6)
        assert _common.checks_summary()["passed"] is True
        with pytest.raises(_common.CheckFailed, match=r"differ.*1/4 elements differ"):
            _common.check_equal(np.array([0.0, 1, 2, 4]), np.arange(4.0), "differ")
        with pytest.raises(_common.CheckFailed, match=r"far: relative error"):
            _common.check_close(np.ones(3) * 1.1, np.ones(3), "far", rtol=1e-3)
        with pytest.raises(_common.CheckFailed, match="nan"):
            _common.check_close(np.array([np.nan]), np.array([1.0]), "nan", rtol=1.0)
        with pytest.raises(_common.CheckFailed, match="cond"):
            _common.check(1 + 1 == 3, "cond")
        s = _common.checks_summary()
        assert s["passed"] is False and s["count"] == 6 and s["failed_count"] == 4
        assert [f["what"] for f in s["failed"]] == ["differ", "far", "nan", "cond"]
    finally:
        _common._checks[:] = saved


def test_injected_reference_error_fails_the_benchmark(tmp_path: Path) -> None:
    """``DEVICEOPS_BENCH_INJECT_ERROR=1`` corrupts the references: exit 1, the record says so."""
    proc, out, log = _run_bench(tmp_path, "overhead.py",
                                env_extra={"DEVICEOPS_BENCH_INJECT_ERROR": "1"})
    assert proc.returncode == 1, log
    assert "CORRECTNESS FAIL" in proc.stderr, log
    rec = json.loads(out.read_text())
    assert rec["benchmark"] == "overhead" and rec["checks"]["passed"] is False, rec
    assert rec["checks"]["failed_count"] >= 1 and rec["checks"]["failed"][0]["passed"] is False


def test_gemm_smoke_against_float64(tmp_path: Path) -> None:
    proc, out, log = _run_bench(tmp_path, "gemm.py")
    assert proc.returncode == 0, log
    rows = json.loads(out.read_text())["rows"]
    assert {(r["dtype"], r["layer"]) for r in rows} == {
        (d, f"trans_b={t}") for d in ("float32", "float16", "bfloat16", "tf32") for t in (False, True)}
    for r in rows:
        assert r["path"] == "reference" and 0 <= r["err"] < 2e-2, r


def test_attention_smoke_reference_paths_agree(tmp_path: Path) -> None:
    proc, out, log = _run_bench(tmp_path, "attention.py")
    assert proc.returncode == 0, log
    assert "smoke float32 kv_len and paged KV: reference consistent" in proc.stdout, log
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 7 and all(r["finite"] is True for r in rows), rows
    assert rows[-1]["paged"] is True


def test_decode_smoke_tokens_match_generate(tmp_path: Path) -> None:
    """decode.py --smoke on a tiny random GGUF: its timed loops' greedy tokens (graph and
    eager) are checked against ``CausalLM.generate``."""
    sys.path.insert(0, str(Path(__file__).parent))
    import nn_tiny

    gguf = tmp_path / "tiny.gguf"
    nn_tiny.write_gguf(gguf, nn_tiny.hf_weights(1, tied=False), "F32")
    proc, out, log = _run_bench(tmp_path, "decode.py", "--gguf", str(gguf))
    assert proc.returncode == 0, log
    rec = json.loads(out.read_text())
    checks = rec["checks"]
    assert checks["passed"] is True and checks["count"] == 2, checks
    assert all(c["passed"] and "tokens == generate()" in c["what"] for c in checks["records"])
    assert [(r["batch"], r["graph"]) for r in rec["decode"]] == [(2, True), (2, False)]
    assert all(r["ms_per_step"] > 0 and r["tokens"] == 6 for r in rec["decode"]), rec["decode"]


def test_gemma3_smoke_tokens_match_generate(tmp_path: Path) -> None:
    """gemma3.py --smoke on a tiny random Gemma 3 (sliding-window layers): its timed decode
    loops' greedy tokens (graph and eager) are checked against ``CausalLM.generate``."""
    proc, out, log = _run_bench(tmp_path, "gemma3.py")
    assert proc.returncode == 0, log
    rec = json.loads(out.read_text())
    checks = rec["checks"]
    assert checks["passed"] is True and checks["count"] == 3, checks
    assert rec["generate"]["ms_per_token_overall"] > 0 and rec["generate"]["new"] >= 1
    assert [(r["batch"], r["graph"]) for r in rec["decode"]] == [(1, True), (1, False)]
