"""``python -m deviceops.precompile`` (issue 35, item 2): the workload that fills CuPy's kernel
cache runs as written (checked on the cpu backend, where nothing compiles), the GEMM variant
list is the launchers', and a machine without a GPU is told so (exit 0)."""

from __future__ import annotations

import pytest

import deviceops
from deviceops.kernels.gemm._precompile import gemm_variants
from deviceops.nn import _precompile as pc


@pytest.mark.parametrize("group", [g for g in pc.GROUPS if g != "model"])
def test_each_group_runs_on_the_cpu_backend(group: str) -> None:
    results = pc.run_task("cpu", (group,) if group != "gemm" else ("gemm", 0, 1))
    assert results, group
    bad = [r for r in results if r[2]]
    assert not bad, bad


def test_main_checks_the_workload_and_refuses_unknown_groups(capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    assert pc.main(["--device", "cpu", "--groups", "elementwise,transformer"]) == 0
    assert "0 failed" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        pc.main(["--device", "cpu", "--groups", "nope"])
    assert info.value.code == 2
    assert "unknown group 'nope'" in capsys.readouterr().err


def test_a_failing_item_fails_the_run(monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    def broken(dev: object) -> list[pc.Result]:
        return pc._items(dev, [("broken", lambda: 1 / 0)])

    monkeypatch.setitem(pc.GROUPS, "norms", broken)
    assert pc.main(["--device", "cpu", "--groups", "norms"]) == 1
    assert "FAILED broken" in capsys.readouterr().out


def test_without_a_gpu_there_is_nothing_to_compile(capsys: pytest.CaptureFixture[str]) -> None:
    if deviceops.cuda_available():
        pytest.skip("a CUDA GPU answers here: precompile would compile")
    assert pc.main([]) == 0
    assert "nothing to compile" in capsys.readouterr().out


def test_gemm_variants_per_architecture() -> None:
    h100, a100 = gemm_variants(90), gemm_variants(80)
    assert len(set(h100)) == len(h100) and len(set(a100)) == len(a100)
    assert any(v[3] == "a" for v in h100) and not any(v[3] == "a" for v in a100)
    assert set(a100) < set(h100)  # the portable kernels are compiled everywhere
    assert pc.tasks_for(["gemm", "norms"], 3) == [("gemm", 0, 3), ("gemm", 1, 3),
                                                  ("gemm", 2, 3), ("norms",)]
