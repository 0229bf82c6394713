#!/bin/bash
export DEVICEOPS_REQUIRE_GPU=${DEVICEOPS_REQUIRE_GPU:-1}  # a GPU test that would skip fails (tests/conftest.py)
# Short device run used for the second (final-planner) GEMM measurement of 2026-11-23:
# precompile the skinny variants, skinny/cached-plan/kernel-op GPU tests, the decode tables
# (M = 1, 8, 32) with forced-KS variants, memcheck over the skinny cases.
# Usage (GPU machine, repo root): OUT=dir bash tools/gemm_device_quick.sh
set -o pipefail
OUT=${OUT:-/tmp/gemm_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s); stamp() { echo "--- t=$(( $(date +%s) - T0 ))s $*"; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || echo "pip failed"
timeout 40 python3 tools/gemm_precompile.py -j 16 --only skinny 2>&1 | tail -4
stamp pytest
timeout 25 python3 -m pytest -q -p no:cacheprovider -s tests/test_gemm.py -k "skinny or cached or kernel_op" 2>&1 \
    | tee "$OUT/pytest.log" | grep -E "seed=|passed|failed|Error|assert" | head -20
stamp bench
timeout 45 python3 benchmarks/gemm.py --m 1,8,32 --variants skinny:4,skinny:8 --json "$OUT/bench_decode.json" 2>&1 \
    | grep -v "Deprecation\|row = _bench" | tee "$OUT/bench_decode.log"
stamp memcheck
GEMM_SANITIZE_ONLY=skinny timeout $(( 86 - ($(date +%s) - T0) )) compute-sanitizer --tool memcheck --error-exitcode 3 \
    python3 tools/gemm_sanitize.py > "$OUT/memcheck.log" 2>&1; echo "memcheck rc=$?"; tail -3 "$OUT/memcheck.log"
stamp end
