"""Mutation testing of the modules that matter most, on the cpu backend.

Usage::

    python tools/mutation.py --list                      # the modules and their tests
    python tools/mutation.py --named                     # the issue-36 mutants: each must die
    python tools/mutation.py [MODULE ...] [--max N] [--workers W] [--seed S]
                             [--markdown tests/MUTATION.md]

A *mutant* is one small deliberate bug: an operator of cosmic-ray (``pip install
cosmic-ray``; comparisons, arithmetic, boolean operators, ``True``/``False``, numbers, loops
that never run, ``break``/``continue``, except clauses that catch nothing) applied at one
place, or a statement deleted (a call or an assignment whose effect a test should see). For
each module named (default: all of :data:`MODULES`) the tool makes every mutant, applies each
to a private copy of the working tree (the tree itself is never touched, so other work in it
goes on), runs that module's fast cpu tests (``-x``, ``DEVICEOPS_DEVICE=cpu``) and prints a
table per module: mutants run, killed (a test failed or timed out), survived, equivalent
(a survivor listed in ``tools/mutation_equivalents.json`` with the reason it cannot be
told apart: module, the line before and after the mutation, ``"*"`` for every mutant of a
line) and the kill rate of the non-equivalent ones. Survivors are printed with their
line, to be killed by a stronger test or listed as equivalent. ``--max N`` runs a
deterministic sample of N mutants per module (``--seed``); results are kept in
``WORKDIR/results.json``: a rerun skips mutants already killed (a test added later cannot
revive one) and, with ``--rerun-survivors``, runs the survivors again.

``--named`` applies the mutants issue 36 listed (sampling parameters dropped over HTTP,
temperature forced to 0, an engine ignoring top-k/top-p, paged-KV writes one slot early or
V dropped at block ends, the zip error hand-over removed, ``MultiDeviceRoundRobin`` using
its first device only) and exits 1 if any survives its fast tests.

Not part of CI (minutes to hours); run it before resolving an issue that touches these
modules. Imports resolve to the copy: the test process maps ``deviceops`` and its
sub-packages (``nn/``, ``kernels/`` ...) to the copy's folders ahead of the editable install.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from _mutation_mutants import NAMED, Mutant, make_mutants

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENTS = ROOT / "tools" / "mutation_equivalents.json"
PACKAGES = {"deviceops": "deviceops", "deviceops.scheduling": "scheduling",
            "deviceops.graphs": "graphs", "deviceops.kernels": "kernels", "deviceops.nn": "nn"}

# module -> the fast cpu tests that must kill its mutants
_ENGINE_TESTS = ["tests/test_engine.py", "tests/test_sampling_effects.py",
                 "tests/test_small_contracts.py", "tests/test_engine_edges.py"]
_PAGED_TESTS = ["tests/test_paged_kv.py", "tests/test_nn_paged.py"]
_ERROR_TESTS = ["tests/test_error_delivery.py", "tests/test_reliability_errors.py"]
MODULES: dict[str, list[str]] = {
    "nn/serving/requests.py": _ENGINE_TESTS,
    "nn/serving/http.py": ["tests/test_sampling_effects.py", "tests/test_serve_http.py",
                    "tests/test_serve_devices.py", "tests/test_serve_n_choices.py"],
    "nn/serving/engine.py": _ENGINE_TESTS,
    "nn/serving/scheduler.py": ["tests/test_engine_lookahead.py", "tests/test_nn_packed_prefill.py",
                                *_ENGINE_TESTS, "tests/test_nn_paged.py",
                                "tests/test_prefix_cache.py"],
    "nn/serving/step_model.py": ["tests/test_engine_lookahead.py",
                                 "tests/test_nn_packed_prefill.py", *_ENGINE_TESTS,
                                 "tests/test_sampling_features.py", "tests/test_nn_tiny.py"],
    # the runner's decode step (tokens=None, primed rows) and packed prefill
    "nn/runner/decode.py": ["tests/test_nn_lookahead.py", "tests/test_engine_lookahead.py",
                            "tests/test_nn_tiny.py", "tests/test_nn_paged.py",
                            "tests/test_fused_decode.py"],
    "nn/runner/packed_prefill.py": ["tests/test_nn_packed_prefill.py",
                                    "tests/test_engine_lookahead.py"],
    "nn/serving/slots.py": ["tests/test_engine.py", "tests/test_small_contracts.py"],
    # the engine core and its client in one process (the serve subprocesses of
    # tests/test_serve_processes.py would import the unmutated install)
    "nn/serving/core.py": ["tests/test_serve_cores.py"],
    "nn/serving/core_client.py": ["tests/test_serve_cores.py"],
    "nn/serving/protocol.py": ["tests/test_serve_cores.py"],
    # the static batch (generate / stream), both of its loops
    "nn/static_batch.py": ["tests/test_nn_lookahead.py", "tests/test_nn_tiny.py"],
    # the fused decode step's packing, plan and NumPy step (the CUDA kernel: GPU tests)
    "kernels/fused/_plan.py": ["tests/test_fused_decode.py"],
    "kernels/fused/_cpu.py": ["tests/test_fused_decode.py"],
    "kernels/fused/op.py": ["tests/test_fused_decode.py"],
    "nn/runner/fused.py": ["tests/test_fused_decode.py"],
    "nn/serving/detokenize.py": ["tests/test_detokenize.py", "tests/test_serve_http.py",
                                 "tests/test_sampling_effects.py"],
    "nn/serving/tool_calls.py": ["tests/test_serve_tool_calls.py"],
    "nn/serving/grammar.py": ["tests/test_grammar_engine.py", "tests/test_grammar_http.py"],
    "graphs/_auto.py": ["tests/test_auto_graph.py"],
    "nn/generate.py": ["tests/test_first_use.py", "tests/test_cli_errors.py"],
    "deviceops/_backend.py": ["tests/test_first_use.py", "tests/test_backend.py"],
    "scheduling/_tenants.py": ["tests/test_tenants.py", "tests/test_auto_graph.py"],
    "kernels/runtime/_spec.py": ["tests/test_plan_cache.py", "tests/test_kernel_ops.py"],
    "nn/serving/guard.py": ["tests/test_serve_guard.py", "tests/test_serve_guard_near_miss.py",
                            "tests/test_serve_exposure.py"],
    "nn/serving/openai.py": ["tests/test_serve_request_fields.py", "tests/test_serve_http.py",
                             "tests/test_sampling_effects.py", "tests/test_serve_n_choices.py"],
    "nn/runner/paged_kv.py": [*_PAGED_TESTS, "tests/test_small_contracts.py",
                              "tests/test_prefix_cache.py"],
    "nn/runner/prefix_cache.py": ["tests/test_prefix_cache.py"],
    "kernels/transformer/_reference.py": [*_PAGED_TESTS, "tests/test_small_contracts.py",
                                   "tests/test_transformer_kernels.py"],
    "kernels/attention/_reference.py": ["tests/test_paged_kv.py", "tests/test_small_contracts.py",
                                        "tests/test_attention.py"],
    "kernels/sampling/op.py": ["tests/test_sampling_effects.py", "tests/test_nn_tiny.py",
                             "tests/test_transformer_kernels.py"],
    "deviceops/_combinators.py": [*_ERROR_TESTS, "tests/test_ops.py", "tests/test_scheduling.py",
                                  "tests/test_multi_device.py", "tests/test_properties.py",
                                  "tests/test_reliability_deep.py"],
    "deviceops/_placement.py": ["tests/test_multi_device.py", "tests/test_scheduling.py",
                                "tests/test_small_contracts.py"],
    "scheduling/_policies.py": ["tests/test_multi_device.py", "tests/test_scheduling.py",
                                "tests/test_small_contracts.py"],
    "deviceops/_copies.py": ["tests/test_multi_device.py", "tests/test_api.py",
                             "tests/test_hazards.py", "tests/test_small_contracts.py"],
    # the cpu backend's float32 kernel paths (its paged KV writes and reads among them)
    "kernels/transformer/_cpu.py": ["tests/test_paged_kv.py", "tests/test_small_contracts.py",
                                    "tests/test_transformer_kernels.py", "tests/test_nn_tiny.py"],
    "kernels/attention/_cpu.py": ["tests/test_paged_kv.py", "tests/test_small_contracts.py",
                                  "tests/test_attention.py", "tests/test_nn_tiny.py"],
}


# -- the copy and the test process ------------------------------------------------------------

def snapshot(dest: Path) -> None:
    """Copy the working tree's tracked and untracked, not ignored, files to ``dest``."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                         check=True, capture_output=True).stdout.decode()
    if dest.exists():
        shutil.rmtree(dest)
    for rel in filter(None, out.split("\0")):
        src = ROOT / rel
        if not src.is_file() or rel.startswith(("_old", ".venv")):
            continue
        d = dest / rel
        d.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, d)


def run_pytest_in(root: Path, args: list[str]) -> int:
    """pytest in this process, ``deviceops`` and its sub-packages imported from ``root``."""
    import importlib.abc
    import importlib.util

    dirs = {name: root / d for name, d in PACKAGES.items()}
    early = sorted(n for n in sys.modules if n == "deviceops" or n.startswith("deviceops."))
    if early:  # they would stay the editable install's: mutants there would go unseen
        raise SystemExit(f"mutation.py: {early} imported before the copy's packages were "
                         "mapped; the test child must not import deviceops first")

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
            d = dirs.get(name)
            if d is None:
                return None
            return importlib.util.spec_from_file_location(
                name, d / "__init__.py", submodule_search_locations=[str(d)])

    sys.meta_path.insert(0, Finder())
    os.chdir(root)
    sys.path.insert(0, str(root))
    import pytest

    return int(pytest.main(args))


def test_command(root: Path, tests: list[str], timeout: float) -> list[str]:
    # the copy's own tools/mutation.py runs the tests: editing this file mid-run is safe
    return [sys.executable, str(root / "tools" / "mutation.py"), "--run-tests", str(root), "--",
            *tests, "-x", "-q", "-m", "not slow", "-p", "no:cacheprovider", "-o", "addopts=",
            "--timeout", str(int(timeout)), "-W", "ignore::pytest.PytestUnraisableExceptionWarning"]


def run_tests(root: Path, tests: list[str], timeout: float,
              extra_env: tuple[tuple[str, str], ...] = ()) -> tuple[str, float, str]:
    """("passed" | "failed" | "timeout", seconds, output tail)."""
    env = {**os.environ, "DEVICEOPS_DEVICE": "cpu", "PYTHONDONTWRITEBYTECODE": "1",
           **dict(extra_env)}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(test_command(root, tests, timeout), cwd=root, env=env,
                           capture_output=True, text=True, timeout=timeout * 2 + 30)
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - t0, ""
    dt = time.perf_counter() - t0
    tail = (p.stdout + p.stderr)[-1500:]
    if p.returncode == 0:
        return "passed", dt, tail
    if "Timeout" in tail and "+++++" in tail:
        return "timeout", dt, tail
    return "failed", dt, tail


# -- running ----------------------------------------------------------------------------------

def _load(path: Path) -> dict[str, Any]:
    """Earlier results by mutant key (a killed mutant stays killed when tests are added; a
    survivor is run again with ``--rerun-survivors``)."""
    raw = json.loads(path.read_text()) if path.exists() else {}
    return {(k.rsplit(":", 1)[0] if k.count(":") == 4 else k): v for k, v in raw.items()}


def _equivalents() -> list[dict[str, str]]:
    return list(json.loads(EQUIVALENTS.read_text())) if EQUIVALENTS.exists() else []


def _is_equivalent(m: dict[str, Any], eqs: list[dict[str, str]]) -> str | None:
    for e in eqs:
        if (e["module"] == m["module"] and e["before"] == m["before"]
                and e["after"] in (m["after"], "*")):  # "*": every mutant of the line
            return e["reason"]
    return None


class Workers:
    """``n`` private copies of the tree; a mutant is applied to one copy at a time."""

    def __init__(self, workdir: Path, n: int) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        first = workdir / "tree0"
        snapshot(first)
        self.roots = [first]
        for i in range(1, n):
            d = workdir / f"tree{i}"
            if d.exists():
                shutil.rmtree(d)
            shutil.copytree(first, d)
            self.roots.append(d)
        self.free = list(self.roots)
        self.lock = threading.Lock()

    def take(self) -> Path:
        with self.lock:
            return self.free.pop()

    def give(self, root: Path) -> None:
        with self.lock:
            self.free.append(root)


def _apply_and_test(workers: Workers, module: str, code: str, tests: list[str],
                    timeout: float) -> tuple[str, float, str]:
    root = workers.take()
    path = root / module
    orig = path.read_text()
    try:
        path.write_text(code)
        return run_tests(root, tests, timeout)
    finally:
        path.write_text(orig)
        workers.give(root)


def run_modules(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir)
    results_path = workdir / "results.json"
    results = _load(results_path)
    workers = Workers(workdir, args.workers)
    eqs = _equivalents()
    lock = threading.Lock()
    summary: list[dict[str, Any]] = []
    for module in args.modules:
        tests = MODULES[module]
        status, base_s, tail = run_tests(workers.roots[0], tests, args.timeout)
        if status != "passed":
            print(f"{module}: the unmutated tests do not pass ({status}); skipped\n{tail}")
            continue
        timeout = max(args.timeout, 3 * base_s)
        muts = make_mutants(module)
        total = len(muts)
        if args.max and len(muts) > args.max:
            muts = sorted(random.Random(args.seed).sample(muts, args.max), key=lambda m: m.line)
        todo = [m for m in muts if m.key not in results or (
            args.rerun_survivors and results[m.key]["status"] == "passed")]
        print(f"{module}: {total} mutants, {len(muts)} selected, {len(todo)} to run "
              f"(baseline {base_s:.1f} s, tests: {' '.join(tests)})", flush=True)

        def one(m: Mutant, tests: list[str] = tests, timeout: float = timeout) -> None:
            st, dt, _out = _apply_and_test(workers, m.module, m.code, tests, timeout)
            rec = {k: v for k, v in asdict(m).items() if k != "code"}
            rec |= {"status": st, "seconds": round(dt, 1), "tests": tests}
            with lock:
                results[m.key] = rec
                results_path.write_text(json.dumps(results, indent=1))
            mark = "survived" if st == "passed" else "killed"
            print(f"  {mark:8} {m.module}:{m.line} {m.operator.split('/')[-1]}: "
                  f"{m.before[:60]!r} -> {m.after[:60]!r} ({dt:.1f} s)", flush=True)

        with cf.ThreadPoolExecutor(args.workers) as ex:
            list(ex.map(one, todo))
        recs = [results[m.key] for m in muts]
        survived = [r for r in recs if r["status"] == "passed"]
        equivalent = [r for r in survived if _is_equivalent(r, eqs)]
        killed = len(recs) - len(survived)
        live = len(recs) - len(equivalent)
        summary.append({"module": module, "generated": total, "run": len(recs), "killed": killed,
                        "survived": len(survived) - len(equivalent), "equivalent": len(equivalent),
                        "rate": killed / live if live else 1.0, "tests": tests,
                        "survivors": [r for r in survived if not _is_equivalent(r, eqs)],
                        "equivalents": [(r, _is_equivalent(r, eqs)) for r in equivalent]})
    print()
    print(table(summary))
    for s in summary:
        for r in s["survivors"]:
            print(f"SURVIVED {r['module']}:{r['line']} {r['operator'].split('/')[-1]}: "
                  f"{r['before']!r} -> {r['after']!r}")
    if args.markdown:
        Path(args.markdown).write_text(markdown(summary, args))
        print(f"# wrote {args.markdown}")
    return 0


def table(summary: list[dict[str, Any]]) -> str:
    rows = [("module", "generated", "run", "killed", "survived", "equivalent", "kill rate")]
    for s in summary:
        rows.append((s["module"], str(s["generated"]), str(s["run"]), str(s["killed"]),
                     str(s["survived"]), str(s["equivalent"]), f"{100 * s['rate']:.1f}%"))
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i])
                               for i, c in enumerate(r)) for r in rows)


def markdown(summary: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = ["| module | mutants generated | run | killed | survived | equivalent | kill rate "
             "(non-equivalent) | tests |", "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| `{s['module']}` | {s['generated']} | {s['run']} | {s['killed']} | "
                     f"{s['survived']} | {s['equivalent']} | {100 * s['rate']:.1f}% | "
                     + ", ".join(f"`{t.removeprefix('tests/')}`" for t in s["tests"]) + " |")
    out = ["<!-- written by: python tools/mutation.py "
           + " ".join(args.modules) + f" --max {args.max} --seed {args.seed} -->", "",
           *lines, ""]
    eq = [(r, why) for s in summary for r, why in s["equivalents"]]
    if eq:
        out += ["Equivalent survivors:", ""]
        out += [f"- `{r['module']}:{r['line']}` `{r['before']}` -> `{r['after']}`: {why}"
                for r, why in eq]
        out.append("")
    sv = [r for s in summary for r in s["survivors"]]
    if sv:
        out += ["Survivors (not yet killed, not equivalent):", ""]
        out += [f"- `{r['module']}:{r['line']}` {r['operator'].split('/')[-1]}: `{r['before']}` -> "
                f"`{r['after']}`" for r in sv]
        out.append("")
    return "\n".join(out)


def run_named(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir)
    workers = Workers(workdir, 1)
    root = workers.roots[0]
    bad = 0
    rows = []
    for nm in NAMED:
        path = root / nm.module
        orig = path.read_text()
        if orig.count(nm.old) != 1:
            print(f"{nm.name}: the code to mutate is not found exactly once in {nm.module}; "
                  "update NAMED in tools/_mutation_mutants.py")
            bad += 1
            continue
        try:
            path.write_text(orig.replace(nm.old, nm.new))
            st, dt, tail = run_tests(root, list(nm.tests), args.timeout, nm.env)
        finally:
            path.write_text(orig)
        killed = st != "passed"
        bad += not killed
        first = next((ln for ln in tail.splitlines() if ln.startswith("FAILED")), st)
        rows.append((nm.name, " ".join(nm.tests), "killed" if killed else "SURVIVED", first))
        print(f"{'killed  ' if killed else 'SURVIVED'} {nm.name} ({dt:.1f} s): {first}", flush=True)
    print()
    for r in rows:
        print(" | ".join(r))
    return 1 if bad else 0


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--run-tests":
        root = Path(sys.argv[2])
        rest = sys.argv[3:]
        return run_pytest_in(root, rest[1:] if rest[:1] == ["--"] else rest)
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__)
    p.add_argument("modules", nargs="*", help="modules to mutate (default: all of MODULES)")
    p.add_argument("--named", action="store_true", help="the issue-36 mutants; exit 1 if one survives")
    p.add_argument("--list", action="store_true", help="print the modules and their tests")
    p.add_argument("--max", type=int, default=0, help="mutants per module at most (a sample)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=max(1, min(4, (os.cpu_count() or 2) // 2)))
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per test run at least")
    from deviceops import _env  # here, not at the top: the test child maps the copy first

    p.add_argument("--workdir", default=_env.get("DEVICEOPS_MUTATION_DIR"))
    p.add_argument("--markdown", default=None, help="write the table as markdown here")
    p.add_argument("--rerun-survivors", action="store_true",
                   help="run the survivors of earlier runs again (after strengthening tests)")
    args = p.parse_args()
    if args.list:
        for m, t in MODULES.items():
            print(f"{m}: {' '.join(t)}")
        return 0
    if args.named:
        return run_named(args)
    args.modules = args.modules or list(MODULES)
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        p.error(f"unknown modules {unknown}; known: {list(MODULES)}")
    return run_modules(args)


if __name__ == "__main__":
    sys.exit(main())
