#!/bin/bash
# Eleventh-session GPU work (issue 13): re-test of the tenth session's review tidy, and
# split-KV decode variants (bulk L2 prefetch, evict-first loads) beside SDPA.
#   gemm:  tests/test_gemm.py (+ memcheck of the TMA skinny GEMM cases)
#   var:   tools/attn_variants_gpu.py (VARS=..., ONLY=...)
#   attn:  tests/test_attention.py
#   table: benchmarks/attention.py --decode-tables (the interleaved decode tables)
# Usage: OUT=out bash tools/s11_gpu.sh gemm var
OUT=${OUT:-/tmp/s11}
source "$(dirname "$0")/device_prologue.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; python3 --version
for step in "$@"; do case "$step" in
gemm)
    timeout ${T_GEMM:-300} python3 -m pytest -q -p no:cacheprovider --timeout 280 tests/test_gemm.py \
        > "$OUT/test_gemm.log" 2>&1; echo "test_gemm rc=$?"; tail -3 "$OUT/test_gemm.log"; t gemm ;;
gemmsan)
    GEMM_SANITIZE_ONLY=tma timeout 200 compute-sanitizer --tool memcheck --error-exitcode 3 \
        python3 tools/gemm_sanitize.py > "$OUT/tma_memcheck.log" 2>&1; echo "memcheck rc=$?"; tail -2 "$OUT/tma_memcheck.log"; t gemmsan ;;
var)
    timeout ${T_VAR:-300} python3 tools/attn_variants_gpu.py --reps ${REPS:-60} --only "${ONLY:-}" ${ALL:+--all} \
        ${VARS:+--variants "$VARS"} --json "$OUT/var_${TAG:-1}.json" > "$OUT/var_${TAG:-1}.log" 2>&1
    echo "var rc=$?"; grep -E "^[A-Z]" "$OUT/var_${TAG:-1}.log" | grep -v Warning; t var ;;
attn)
    timeout ${T_ATTN:-300} python3 -m pytest -q -p no:cacheprovider --timeout 280 tests/test_attention.py \
        > "$OUT/test_attn.log" 2>&1; echo "test_attention rc=$?"; tail -3 "$OUT/test_attn.log"; t attn ;;
*) echo "unknown step $step" ;;
esac; done
