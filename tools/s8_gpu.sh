#!/bin/bash
export DEVICEOPS_REQUIRE_GPU=${DEVICEOPS_REQUIRE_GPU:-1}  # a GPU test that would skip fails (tests/conftest.py)
# Eighth-session GPU work (issue 13). The slab GEMM experiment's mode lives on branch
# wip/slab-gemm (benchmarks/RESULTS-gemm.md, "Eighth session").
#   attn: the split-KV cluster rule for long splits: the attention / replay GPU tests of the
#         cluster, kv_len, paged and replay cases, then the decode tables beside SDPA
#   sweep: benchmarks/gemm.py with forced skinny:KS:TR:U geometries at M = 32 (both model
#         tables) and M = 1 / 8 (8B), each row's fastest variant beside the planner's choice
#   decode: the GEMM, replay, tiny-model and kernel-op GPU tests, then gemm.py --m 1,8,32
#   tma: the swapped-operand TMA skinny kernel (GEMM tests, memcheck, forced variants)
#   verify: every GEMM GPU test, memcheck (TMA skinny, sm_90 tiles), classic shapes, M = 32 rows
# Usage: OUT=out bash tools/s8_gpu.sh attn sweep decode tma verify
OUT=${OUT:-/tmp/s8}
source "$(dirname "$0")/device_prologue.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 --version
for step in "$@"; do case "$step" in
attn)
    timeout 240 python3 -m pytest -q -x -p no:cacheprovider --timeout 200 tests/test_attention.py tests/test_replay_gpu.py \
        -k "cluster or kv_len or paged or wide or replay or decode" > "$OUT/attn_tests.log" 2>&1
    echo "attn tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/attn_tests.log" | head; tail -1 "$OUT/attn_tests.log"; t "attn tests"
    (cd benchmarks && timeout 240 python3 attention.py --decode-tables --reps ${REPS:-30} \
        --json "$OUT/attention_decode.json" > "$OUT/attention_decode.log" 2>&1); echo "tables rc=$?"
    grep -E "^\| " "$OUT/attention_decode.log" | head -40; t tables ;;
sweep)  # the register-only skinny kernel's geometry (skinny:KS:TR:U) at the decode rows below 1.0x
    for spec in "32|smol,8b|${V32:-skinny:8:1:2,skinny:8:1:3,skinny:8:1:4,skinny:4:1:4,skinny:8:2:1,skinny:8:2:2,skinny:8:2:3,skinny:4:2:2,skinny:2:2:2}" \
                "1,8|8b|${V18:-skinny:8:1:6,skinny:8:1:8,skinny:4:1:8,skinny:4:1:4,skinny:8:2:4,skinny:8:2:2}"; do
        IFS='|' read -r ms models vars <<< "$spec"
        (cd benchmarks && timeout 250 python3 gemm.py --m "$ms" --models "$models" --variants "$vars" \
            --json "$OUT/sweep_${ms/,/_}.json" > "$OUT/sweep_${ms/,/_}.log" 2>&1); echo "sweep M=$ms rc=$?"
        python3 tools/gemm_sweep_report.py "$OUT/sweep_${ms/,/_}.json"
    done; t sweep ;;
decode)  # the planner's skinny rules: GEMM / replay / tiny-model GPU tests, then the decode table
    timeout 300 python3 -m pytest -q -p no:cacheprovider --timeout 250 tests/test_gemm.py tests/test_replay_gpu.py \
        tests/test_nn_tiny.py tests/test_kernel_ops.py > "$OUT/decode_tests.log" 2>&1
    echo "decode tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/decode_tests.log" | head; tail -1 "$OUT/decode_tests.log"; t tests
    (cd benchmarks && timeout 250 python3 gemm.py --m 1,8,32 --json "$OUT/gemm_decode.json" > "$OUT/gemm_decode.log" 2>&1)
    echo "gemm decode rc=$?"; python3 tools/gemm_sweep_report.py "$OUT/gemm_decode.json"; t table ;;
tma)  # the swapped-operand TMA skinny kernel: tests, memcheck, then forced variants beside the planner
    timeout 200 python3 -m pytest -q -x -p no:cacheprovider --timeout 150 tests/test_gemm.py \
        -k "${GTEST_K:-skinny or random}" > "$OUT/tma_tests.log" 2>&1
    echo "tma tests rc=$?"; grep -E "^(FAILED|ERROR)|^E  " "$OUT/tma_tests.log" | head -12; tail -1 "$OUT/tma_tests.log"; t tests
    GEMM_SANITIZE_ONLY=tma timeout 120 compute-sanitizer --tool memcheck --error-exitcode 3 \
        python3 tools/gemm_sanitize.py > "$OUT/tma_memcheck.log" 2>&1; echo "memcheck rc=$?"; tail -3 "$OUT/tma_memcheck.log"
    for spec in "32|smol,8b|${VT32:-skinny,tma,tma:1,tma:2,tma:8}" "1,8|8b|${VT18:-tma,tma:1}"; do
        IFS='|' read -r ms models vars <<< "$spec"
        (cd benchmarks && timeout 200 python3 gemm.py --m "$ms" --models "$models" --variants "$vars" \
            --json "$OUT/tma_${ms/,/_}.json" > "$OUT/tma_${ms/,/_}.log" 2>&1); echo "gemm M=$ms rc=$?"
        python3 tools/gemm_sweep_report.py "$OUT/tma_${ms/,/_}.json"
    done; t tma ;;
verify)  # after the TMA-ring helpers moved into gemm_sm90_common.cuh: every GEMM GPU test,
    # memcheck over the TMA skinny and sm_90 cases, the classic shapes and the M = 32 rows
    timeout 330 python3 -m pytest -q -p no:cacheprovider --timeout 300 tests/test_gemm.py tests/test_replay_gpu.py \
        tests/test_kernel_ops.py > "$OUT/verify_tests.log" 2>&1
    echo "verify tests rc=$?"; grep -E "^(FAILED|ERROR)|^E  " "$OUT/verify_tests.log" | head -12; tail -1 "$OUT/verify_tests.log"; t tests
    for only in tma 128x; do
        GEMM_SANITIZE_ONLY=$only timeout 150 compute-sanitizer --tool memcheck --error-exitcode 3 \
            python3 tools/gemm_sanitize.py > "$OUT/verify_memcheck_$only.log" 2>&1; echo "memcheck $only rc=$?"
        tail -2 "$OUT/verify_memcheck_$only.log"
    done; t memcheck
    (cd benchmarks && timeout 150 python3 gemm.py --models "" --classic --json "$OUT/verify_classic.json" \
        > "$OUT/verify_classic.log" 2>&1); echo "classic rc=$?"; grep -E "^\|" "$OUT/verify_classic.log" | cut -c1-160 | head -20
    (cd benchmarks && timeout 100 python3 gemm.py --m 32 --models 8b --json "$OUT/verify_m32.json" \
        > "$OUT/verify_m32.log" 2>&1); echo "m32 rc=$?"; python3 tools/gemm_sweep_report.py "$OUT/verify_m32.json"; t bench ;;
esac; done
