#!/usr/bin/env bash
# The README's demo command: make a venv from pyproject.toml (once) and run the
# demo. It uses CUDA device 0 when CuPy sees a GPU, the cpu backend otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DEVICEOPS_VENV:-.venv}
PY=${PYTHON:-python3}
. scripts/_venv.sh
make_venv
EXTRA=""
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    EXTRA="cuda13"   # a GPU answers: install CuPy too
fi
install_project "$EXTRA" "numpy, ml_dtypes, gguf, tokenizers, jinja2, starlette, uvicorn, \
pyzmq, msgspec, prometheus_client, tqdm${EXTRA:+, CuPy} (a minute or so)"
# SmolLM2-135M weights for the generation demo
install_weights
if [ -n "$EXTRA" ]; then
    # compile the common kernels for this GPU into CuPy's cache once (parallel workers),
    # so neither the demo nor a later server compiles on first use
    "$VENV/bin/python" -m deviceops.precompile
fi
"$VENV/bin/python" examples/demo.py "$@"
echo
echo '$ python -m deviceops.nn.generate "What is the capital of France?"'
exec "$VENV/bin/python" -m deviceops.nn.generate "What is the capital of France?" --max-new-tokens 32
