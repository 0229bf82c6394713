#!/bin/bash
export DEVICEOPS_REQUIRE_GPU=${DEVICEOPS_REQUIRE_GPU:-1}  # a GPU test that would skip fails (tests/conftest.py)
# Sixth-session kernel work on the GPU machine (issue 13): the new GEMV (b as (K, N)) and the
# 8/16-warp split-KV decode blocks — correctness first, then the timings.
#   check: GPU tests of the changed kernels (gemm, attention), then
#   sweep: attention warps x split target at every decode-table point (tools/attn_warps_sweep_gpu.py)
#   gemvx: tools/gemv_gpu.py (GEMV kernel variants beside cuBLAS, NaN-poisoned repeats)
#   tables: benchmarks/attention.py --decode-tables
#   final: kernel/nn GPU test files (three processes), the GEMV table, op_cost.py
#   san:   compute-sanitizer memcheck + racecheck over gemm and flash_attention
#   gemv:  benchmarks/gemm.py model rows with b as (K, N) at M = 1, 8 beside cuBLAS
# Usage: OUT=out bash tools/s6_kernels.sh check sweep gemv ...
OUT=${OUT:-/tmp/s6k}
source "$(dirname "$0")/device_prologue.sh"
for step in "$@"; do case "$step" in
check)
    timeout ${T_CHECK:-200} python3 -m pytest -q -p no:cacheprovider --timeout 150 \
        tests/test_gemm.py tests/test_attention.py -k "${CHECK_K:-gemv or random_shapes or edge or skinny or wide_blocks or decode or kv_len or paged or graph}" \
        > "$OUT/check.log" 2>&1; echo "check rc=$?"; grep -E "^(FAILED|ERROR)|Error" "$OUT/check.log" | head; tail -1 "$OUT/check.log"; t check ;;
sweep)
    (cd benchmarks && timeout ${T_SWEEP:-200} python3 ../tools/attn_warps_sweep_gpu.py --reps ${REPS:-30} \
        --json "$OUT/attn_warps_sweep.json" > "$OUT/attn_warps_sweep.log" 2>&1); echo "sweep rc=$?"
    sed -n '/^point/,$p' "$OUT/attn_warps_sweep.log"; t sweep ;;
gemv)
    timeout ${T_GEMV:-150} python3 benchmarks/gemm.py --models ${MODELS:-8b,smol} --m 1,8 --layout kn \
        --json "$OUT/gemv.json" > "$OUT/gemv.log" 2>&1; echo "gemv rc=$?"; cat "$OUT/gemv.log" | cut -c1-200; t gemv ;;
gemvx)
    timeout ${T_GEMVX:-240} python3 tools/gemv_gpu.py --json "$OUT/gemv_variants.json" > "$OUT/gemv_variants.log" 2>&1
    echo "gemvx rc=$?"; cut -c1-400 "$OUT/gemv_variants.log"; t gemvx ;;
san)
    timeout ${T_SAN:-280} python3 tools/sanitize_all.py --tools memcheck,racecheck --only gemm,flash_attention \
        --timeout 260 --json "$OUT/san.json" > "$OUT/san.log" 2>&1; echo "san rc=$?"; tail -12 "$OUT/san.log"; t san ;;
final)
    P="python3 -m pytest -q -p no:cacheprovider --timeout 200 -rs"
    timeout 330 $P tests/test_gemm.py tests/test_kernel_ops.py > "$OUT/final_g1.log" 2>&1 & p1=$!
    timeout 330 $P tests/test_attention.py tests/test_replay_gpu.py > "$OUT/final_g2.log" 2>&1 & p2=$!
    timeout 330 $P tests/test_transformer_kernels.py tests/test_nn_gpu_paged.py tests/test_nn_tiny.py \
        tests/test_nn_paged.py tests/test_plan_cache.py tests/test_graphs.py > "$OUT/final_g3.log" 2>&1 & p3=$!
    wait $p1; r1=$?; wait $p2; r2=$?; wait $p3; r3=$?
    for g in g1 g2 g3; do echo "$g: $(tail -1 "$OUT/final_$g.log")"; grep -E "^(FAILED|ERROR)" "$OUT/final_$g.log" | head; done
    echo "rc $r1 $r2 $r3"; t "final tests"
    timeout 60 python3 benchmarks/gemm.py --models 8b --m 1 --layout kn --json "$OUT/gemv_final.json" \
        > "$OUT/gemv_final.log" 2>&1; echo "gemv rc=$?"; grep -v Deprecation "$OUT/gemv_final.log" | cut -c1-150; t gemv
    timeout 150 python3 benchmarks/op_cost.py --rounds 5 --n 200 --json "$OUT/op_cost.json" > "$OUT/op_cost.log" 2>&1
    echo "op_cost rc=$?"; grep -v "^# " "$OUT/op_cost.log" | tail -22; t op_cost ;;
tables)
    (cd benchmarks && timeout ${T_TABLES:-200} python3 attention.py --decode-tables --reps 40 \
        --json "$OUT/attention_decode.json" > "$OUT/attention_decode.log" 2>&1); echo "tables rc=$?"
    grep -v "^#" "$OUT/attention_decode.log" | tail -32; t tables ;;
esac; done
