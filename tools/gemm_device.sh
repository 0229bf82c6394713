#!/bin/bash
export DEVICEOPS_REQUIRE_GPU=${DEVICEOPS_REQUIRE_GPU:-1}  # a GPU test that would skip fails (tests/conftest.py)
# One device run for the GEMM work: install, parallel precompile, GPU tests, decode tables,
# memcheck sweep, then the remaining tables while the time budget lasts.
# Usage (GPU machine, repo root): OUT=dir BUDGET=230 bash tools/gemm_device.sh
set -o pipefail
OUT=${OUT:-/tmp/gemm_out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-230}
export PYTHONUNBUFFERED=1
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
stamp() { echo "--- t=$(( $(date +%s) - T0 ))s $*"; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || { echo "pip install failed"; tail -5 "$OUT/pip.log"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader
stamp precompile
timeout 60 python3 tools/gemm_precompile.py -j 16 2>&1 | tail -8
stamp pytest
GEMM_TEST_CASES=${GEMM_TEST_CASES:-150} timeout 100 python3 -m pytest -q -p no:cacheprovider -s \
    tests/test_gemm.py tests/test_kernel_ops.py -k "gpu or kernel_op or gemm" 2>&1 | tee "$OUT/pytest.log" \
    | grep -E "seed=|passed|failed|Error|error|assert|FAIL" | head -40
stamp decode tables
timeout $(( $(left) - 75 )) python3 benchmarks/gemm.py --m ${DECODE_M:-1,8,32} --variants ${VARIANTS:-skinny:2,skinny:4,skinny:8} \
    --host --json "$OUT/bench_decode.json" 2>&1 | tee "$OUT/bench_decode.log" | grep -v "^ *$"
stamp memcheck
timeout $(( $(left) - 25 > 60 ? 60 : $(left) - 25 )) compute-sanitizer --tool memcheck --error-exitcode 3 \
    python3 tools/gemm_sanitize.py > "$OUT/memcheck.log" 2>&1; echo "memcheck rc=$?"; tail -4 "$OUT/memcheck.log"
stamp rest
if [ "$(left)" -gt 10 ]; then
    timeout $(( $(left) - 3 )) python3 benchmarks/gemm.py --m ${REST_M:-128,512,2048} --classic --json "$OUT/bench_rest.json" \
        2>&1 | tee "$OUT/bench_rest.log" | grep -v "^ *$"
fi
stamp end
