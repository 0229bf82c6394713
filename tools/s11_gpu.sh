#!/bin/bash
export DEVICEOPS_REQUIRE_GPU=${DEVICEOPS_REQUIRE_GPU:-1}  # a GPU test that would skip fails (tests/conftest.py)
# Eleventh-session GPU work (issue 13): re-test of the tenth session's review tidy, and
# split-KV decode variants (bulk L2 prefetch, evict-first loads) beside SDPA.
#   gemm:  tests/test_gemm.py (+ memcheck of the TMA skinny GEMM cases)
#   var:   tools/attn_variants_gpu.py (VARS=..., ONLY=...)
#   attn:  tests/test_attention.py
#   table: benchmarks/attention.py --decode-tables (the interleaved decode tables)
#   attnsan: compute-sanitizer memcheck / racecheck over benchmarks/attention.py --check
#   w1 / w2 / ab: the real weights in two calls, nn GPU tests, decode.py A/B against 0c6220d
# Usage: OUT=out bash tools/s11_gpu.sh gemm var
OUT=${OUT:-/tmp/s11}
source "$(dirname "$0")/device_prologue.sh"
source "$(dirname "$0")/attn_gpu_steps.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; python3 --version
for step in "$@"; do case "$step" in
gemm)
    timeout ${T_GEMM:-300} python3 -m pytest -q -p no:cacheprovider --timeout 280 tests/test_gemm.py \
        > "$OUT/test_gemm.log" 2>&1; echo "test_gemm rc=$?"; tail -3 "$OUT/test_gemm.log"; t gemm ;;
gemmsan)
    GEMM_SANITIZE_ONLY=tma timeout 200 compute-sanitizer --tool memcheck --error-exitcode 3 \
        python3 tools/gemm_sanitize.py > "$OUT/tma_memcheck.log" 2>&1; echo "memcheck rc=$?"; tail -2 "$OUT/tma_memcheck.log"; t gemmsan ;;
w1) mkdir -p /tmp/wts && cp .w1/part00 /tmp/wts/ && t "part00 copied" ;;
w2)  # within 30 s of w1 (carry .w2): the real-weights nn GPU tests, then decode.py
    [ -f /tmp/wts/part00 ] || { echo "machine went cold: no part00"; exit 2; }
    cp .w2/part01 /tmp/wts/ && cat /tmp/wts/part00 /tmp/wts/part01 > /tmp/wts/model.gguf
    DEVICEOPS_SMOLLM2_GGUF=/tmp/wts/model.gguf timeout 150 python3 -m pytest -q -p no:cacheprovider \
        --timeout 140 tests/test_nn_gpu.py > "$OUT/nn_gpu_tests.log" 2>&1; echo "nn gpu tests rc=$?"
    tail -2 "$OUT/nn_gpu_tests.log"; t "nn tests" ;;
ab)  # after w2 (carry _old_s11/, a git archive of 0c6220d: heads per block a power of two):
    # decode.py on this tree and on that package, alternating, on one machine instance
    # (newcopy: this tree copied the same way, to tell the code from the editable install)
    [ -f /tmp/wts/model.gguf ] || { [ -f /tmp/wts/part00 ] && cp .w2/part01 /tmp/wts/ && cat /tmp/wts/part00 /tmp/wts/part01 > /tmp/wts/model.gguf; }
    for src in old:_old_s11 newcopy:.; do v=${src%%:*}; tree=${src#*:}
        rm -rf /tmp/$v && mkdir -p /tmp/$v && cp -r $tree/deviceops /tmp/$v/ && for d in scheduling graphs kernels nn; do
            cp -r $tree/$d /tmp/$v/deviceops/$d; done; done
    for r in $(seq ${ROUNDS:-2}); do for v in ${ORDER:-new old}; do
        pp=$PYTHONPATH; [ $v != new ] && pp=/tmp/$v:$PYTHONPATH
        [ $r = 1 ] && (cd benchmarks && PYTHONPATH=$pp python3 -c "import deviceops.kernels._attention_plan as g; print('$v:', g.__file__, g._heads_per_block(3))")
        PYTHONPATH=$pp timeout 100 python3 benchmarks/decode.py --gguf /tmp/wts/model.gguf --no-transformers \
            --json "$OUT/ab_${v}_$r.json" > "$OUT/ab_${v}_$r.log" 2>&1; echo "$v $r rc=$?"
        grep -E "^(prefill|decode batch .* graph)" "$OUT/ab_${v}_$r.log"
    done; done; t ab ;;
var|attn|table|attnsan) attn_gpu_step "$step" ;;
*) echo "unknown step $step" ;;
esac; done
