#!/usr/bin/env bash
# The README's demo command: make a venv from pyproject.toml (once) and run the
# demo. It uses CUDA device 0 when CuPy sees a GPU, the cpu backend otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DEVICEOPS_VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
EXTRA=""
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    EXTRA="cuda13"   # a GPU answers: install CuPy too
fi
if [ -n "$EXTRA" ]; then
    "$VENV/bin/python" -m pip install -q -e ".[$EXTRA]"
else
    "$VENV/bin/python" -m pip install -q -e .
fi
exec "$VENV/bin/python" examples/demo.py "$@"
