"""Issue 16: the soak (``benchmarks/soak.py``), short, on the cpu backend in CI.

Mixed ops (sync, await under asyncio and trio, graph replays, failing ops, cancellations)
with RSS, threads and live events asserted flat after a warm-up; every result checked.
The full run (1,000,000 ops on the GPU) is ``python benchmarks/soak.py``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

import deviceops

ROOT = Path(__file__).resolve().parent.parent


def _soak_module() -> Any:
    spec = importlib.util.spec_from_file_location("deviceops_soak", ROOT / "benchmarks" / "soak.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(300)
def test_soak_short_on_cpu() -> None:
    soak = _soak_module()
    lines: list[str] = []
    rec = soak.run_soak(30_000, deviceops.device("cpu"), log=lines.append)
    assert rec["ops"] >= 25_000, rec["ops"]
    assert rec["failures"] > 0 and rec["cancels"] > 0 and rec["checks"] > 0, rec
    assert rec["passed"], (rec["growth_after_warmup"], rec["limits"], lines)


def test_soak_detects_growth() -> None:
    # the check itself can fail: a fake leak of one event per round is caught
    soak = _soak_module()
    kept: list[Any] = []
    orig = soak.Soak.graph_round

    def leaky(self: Any, n: int) -> None:
        orig(self, n)
        for _ in range(20):
            kept.append(self.s._record())  # live events that are never released

    soak.Soak.graph_round = leaky
    try:
        rec = soak.run_soak(10_000, deviceops.device("cpu"), log=lambda *_: None)
    finally:
        soak.Soak.graph_round = orig
    assert not rec["flat"]["events"], rec["growth_after_warmup"]
    assert not rec["passed"]
