#!/bin/bash
# Session-5 GPU check: core + kernel tests (replay included), host-cost parts, op_cost.
# Run from the repo root on the GPU machine: OUT=dir bash tools/s5_gpu.sh [tests|bench|all]
OUT=${OUT:-/tmp/s5}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
if ls build/wheels_rel/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site build/wheels_rel/*.whl > "$OUT/pip_whl.log" 2>&1 && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || tail -5 "$OUT/pip.log"
timeout 90 python3 tools/gemm_precompile.py -j 16 > "$OUT/precompile.log" 2>&1 &
case "${1:-all}" in tests|all)
    timeout ${T_TESTS:-240} python3 -m pytest -q -p no:cacheprovider --timeout 120 -x \
        tests/test_replay_gpu.py tests/test_kernel_ops.py tests/test_elementwise.py tests/test_plan_cache.py \
        tests/test_transformer_kernels.py tests/test_hazards.py tests/test_graphs.py tests/test_streams.py \
        tests/test_backend.py tests/test_async.py tests/test_ops.py tests/test_api.py ${EXTRA_TESTS} > "$OUT/tests.log" 2>&1
    echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|Error" "$OUT/tests.log" | head -20; tail -3 "$OUT/tests.log"; t "tests";;
esac
wait
case "${1:-all}" in bench|all)
    timeout 60 python3 tools/host_parts_gpu.py > "$OUT/parts.log" 2>&1; cat "$OUT/parts.log"; t "parts"
    timeout 120 python3 benchmarks/op_cost.py --rounds 5 --n 100 --json "$OUT/op_cost.json" > "$OUT/op_cost.log" 2>&1
    echo "op_cost rc=$?"; grep -v "^# " "$OUT/op_cost.log" | tail -22; t "op_cost";;
esac
