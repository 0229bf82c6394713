#!/bin/bash
# Final batched device run: core benchmarks, examples on the GPU, GEMM/attention quick tables.
set -o pipefail
OUT=${OUT:-/tmp/deviceops_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
bash tools/device_run.sh overhead graph_replay overlap await_latency 2>&1 | grep -v "^# \(cpu\|knobs\)"
export PYTHONPATH=/tmp/site
for ex in demo async_pipeline graph_decode_loop; do
    echo "=== example $ex"; timeout 120 python3 examples/$ex.py 2>&1 | tail -12; echo "rc=$?"
done
echo "=== example trace_overlap"; timeout 120 python3 examples/trace_overlap.py --out "$OUT/trace_example" 2>&1 | tail -8
echo "=== gemm --quick"; timeout 200 python3 benchmarks/gemm.py --quick --json "$OUT/gemm.json" 2>&1 | tail -25
echo "=== attention --quick"; timeout 200 python3 benchmarks/attention.py --quick --json "$OUT/attention.json" 2>&1 | tail -25
