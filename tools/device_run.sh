#!/bin/bash
# One batched device run: install, then the core benchmarks, JSON into $OUT.
# Usage (on the GPU machine, repo root): OUT=/some/dir bash tools/device_run.sh [names...]
set -o pipefail
OUT=${OUT:-/tmp/deviceops_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || { echo "pip install failed"; tail -5 "$OUT/pip.log"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
names=${*:-overhead graph_replay overlap await_latency}
for b in $names; do
    echo "=== $b"
    extra=""
    [ "$b" = overlap ] && extra="--trace $OUT/overlap_trace.json"
    timeout 300 python3 benchmarks/$b.py --json "$OUT/$b.json" $extra 2>&1 | tee "$OUT/$b.log"
done
