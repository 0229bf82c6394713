#!/bin/bash
export DEVICEOPS_REQUIRE_GPU=${DEVICEOPS_REQUIRE_GPU:-1}  # a GPU test that would skip fails (tests/conftest.py)
# Session-5 final GPU verification, two device calls (the GGUF travels in two halves).
#   a (carry .w1 build/wheels_rel): every GPU test file, overhead.py (then-chains + per-op
#     table, issue 12's bars), graph_replay, await_latency, a 200k-op soak, eager profile
#   b (carry .w2 .whl build/wheels_rel), within 30 s of a: real-weights nn tests, decode.py,
#     a short serve run
set -o pipefail
OUT=${OUT:-/tmp/s5final}
source "$(dirname "$0")/device_prologue.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
case "$1" in
tests)
    timeout ${T_TESTS:-420} python3 -m pytest -q -p no:cacheprovider --timeout 120 \
        $(ls tests/test_*.py | grep -v "test_nn_gpu.py") > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20; tail -2 "$OUT/gpu_tests.log"
    t "gpu tests"
    timeout 100 python3 benchmarks/op_cost.py --rounds 7 --n 200 --json "$OUT/op_cost.json" > "$OUT/op_cost.log" 2>&1
    echo "op_cost rc=$?"; grep -v "^# " "$OUT/op_cost.log" | tail -20; t "op_cost"
    ;;
w)
    mkdir -p /tmp/wts && cp .w1/part00 /tmp/wts/ && t "part00 copied"
    timeout 60 python3 -m pytest -q -p no:cacheprovider --timeout 50 -rf --tb=line tests/test_nn_tiny.py \
        tests/test_nn_paged.py > "$OUT/nn_cpu_tests.log" 2>&1; echo "nn tests on cuda rc=$?"; tail -3 "$OUT/nn_cpu_tests.log"
    ;;
a)
    mkdir -p /tmp/wts && cp .w1/part00 /tmp/wts/ && t "part00 copied"
    timeout 90 python3 tools/gemm_precompile.py -j 16 > "$OUT/precompile.log" 2>&1 &
    timeout ${T_TESTS:-420} python3 -m pytest -q -p no:cacheprovider --timeout 120 \
        $(ls tests/test_*.py | grep -v "test_nn_gpu.py") > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20; tail -2 "$OUT/gpu_tests.log"
    wait; t "gpu tests"
    timeout 180 python3 benchmarks/overhead.py --json "$OUT/overhead.json" --per-op-rounds 5 \
        > "$OUT/overhead.log" 2>&1; echo "overhead rc=$?"; grep -v "^# " "$OUT/overhead.log" | tail -42; t "overhead"
    timeout 60 python3 benchmarks/graph_replay.py --json "$OUT/graph_replay.json" > "$OUT/graph_replay.log" 2>&1
    echo "graph_replay rc=$?"; grep -E "PASS|FAIL" "$OUT/graph_replay.log"; t "graph_replay"
    timeout 90 python3 benchmarks/await_latency.py --iters 1000 --load 3000 --json "$OUT/await.json" \
        > "$OUT/await.log" 2>&1; echo "await rc=$?"; grep -E "PASS|FAIL" "$OUT/await.log"; t "await"
    timeout 60 python3 benchmarks/soak.py --ops ${SOAK_OPS:-200000} --json "$OUT/soak.json" > "$OUT/soak.log" 2>&1
    echo "soak rc=$?"; tail -3 "$OUT/soak.log"; t "soak"
    timeout 60 python3 tools/gemm_sweep_gpu.py --planner-only > "$OUT/gemm_planner.log" 2>&1; cat "$OUT/gemm_planner.log"; t "gemm planner"
    timeout 60 python3 tools/eager_profile.py --device cuda --steps 60 --no-profile > "$OUT/eager.log" 2>&1
    tail -4 "$OUT/eager.log"; t "eager"
    ;;
b)
    [ -f /tmp/wts/part00 ] || { echo "machine went cold: no part00"; exit 2; }
    cp .w2/part01 /tmp/wts/ && cat /tmp/wts/part00 /tmp/wts/part01 > /tmp/wts/model.gguf
    export DEVICEOPS_SMOLLM2_GGUF=/tmp/wts/model.gguf
    timeout 150 python3 -m pytest -q -p no:cacheprovider --timeout 120 tests/test_nn_gpu.py \
        > "$OUT/nn_gpu_tests.log" 2>&1; echo "nn gpu tests rc=$?"; tail -3 "$OUT/nn_gpu_tests.log"; t "nn tests"
    timeout 120 python3 benchmarks/decode.py --gguf /tmp/wts/model.gguf --no-transformers \
        --json "$OUT/decode.json" > "$OUT/decode.log" 2>&1; echo "decode rc=$?"
    tail -25 "$OUT/decode.log"; t "decode"
    [ -n "$NO_SERVE" ] && exit 0
    timeout ${T_SERVE:-120} python3 benchmarks/serve.py --gguf /tmp/wts/model.gguf \
        --levels ${LEVELS:-1,64} --cancel-requests ${CANCEL:-300} --no-transformers --no-http \
        --json "$OUT/serve.json" 2>&1 | grep -v "tensor/s" > "$OUT/serve.log"
    echo "serve rc=$?"; tail -30 "$OUT/serve.log"; t "serve"
    ;;
esac
