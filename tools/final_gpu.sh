#!/bin/bash
export DEVICEOPS_REQUIRE_GPU=${DEVICEOPS_REQUIRE_GPU:-1}  # a GPU test that would skip fails (tests/conftest.py)
# The session's final GPU verification, in two device calls (the weights are 98 MB and one
# call carries 64 MiB; see weights-on-device.md). Run from the repo root on the GPU machine.
#   phase a (carry .w1 build/wheels_rel):  OUT=dir bash tools/final_gpu.sh a
#   phase b (carry .w2 .whl build/wheels_rel):  OUT=dir bash tools/final_gpu.sh b
# Phase a copies the first half of the GGUF to /tmp/wts and runs the core GPU tests; phase b
# joins the GGUF and runs the nn GPU tests and the decode / serve / op-cost benchmarks.
set -o pipefail
OUT=${OUT:-/tmp/final_out}
source "$(dirname "$0")/device_prologue.sh"  # OUT, the timer t, carried wheels, editable install
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
case "$1" in
a)
    mkdir -p /tmp/wts && cp .w1/part00 /tmp/wts/ && t "part00 copied"
    timeout 60 python3 tools/gemm_precompile.py -j 16 > "$OUT/precompile.log" 2>&1 &
    timeout ${T_TESTS:-200} python3 -m pytest -q -p no:cacheprovider --timeout 120 \
        tests/test_graphs.py tests/test_async.py tests/test_hazards.py tests/test_streams.py \
        tests/test_kernel_ops.py tests/test_ops.py tests/test_elementwise.py \
        tests/test_scheduling.py tests/test_api.py tests/test_examples.py \
        tests/test_transformer_kernels.py tests/test_plan_cache.py tests/test_reliability_gpu.py \
        tests/test_async_loop_lifetime.py tests/test_nn_gpu_paged.py > "$OUT/gpu_tests.log" 2>&1
    echo "core gpu tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head; tail -3 "$OUT/gpu_tests.log"
    wait; t "tests done"
    timeout 90 python3 benchmarks/soak.py --ops ${SOAK_OPS:-1000000} --json "$OUT/soak.json" > "$OUT/soak.log" 2>&1
    echo "soak rc=$?"; tail -3 "$OUT/soak.log"; t "soak done"
    timeout 60 python3 tools/eager_profile.py --device cuda --steps 60 --no-profile > "$OUT/eager.log" 2>&1
    cat "$OUT/eager.log"
    timeout 80 python3 benchmarks/op_cost.py --rounds 5 --n 100 --json "$OUT/op_cost.json" > "$OUT/op_cost.log" 2>&1
    echo "op_cost rc=$?"; grep -v "^# " "$OUT/op_cost.log" | tail -19; t "op_cost done"
    ;;
b)
    [ -f /tmp/wts/part00 ] || { echo "machine went cold: no part00"; exit 2; }
    cp .w2/part01 /tmp/wts/ && cat /tmp/wts/part00 /tmp/wts/part01 > /tmp/wts/model.gguf
    sha256sum /tmp/wts/model.gguf | cut -c1-16
    export DEVICEOPS_SMOLLM2_GGUF=/tmp/wts/model.gguf
    timeout 120 python3 -m pytest -q -p no:cacheprovider --timeout 100 tests/test_nn_gpu.py \
        > "$OUT/nn_gpu_tests.log" 2>&1; echo "nn gpu tests rc=$?"; tail -6 "$OUT/nn_gpu_tests.log"
    t "nn tests done"
    timeout 90 python3 benchmarks/decode.py --gguf /tmp/wts/model.gguf --no-transformers \
        --json "$OUT/decode.json" > "$OUT/decode.log" 2>&1; echo "decode rc=$?"
    tail -25 "$OUT/decode.log"; t "decode done"
    timeout ${T_SERVE:-200} python3 benchmarks/serve.py --gguf /tmp/wts/model.gguf \
        --levels ${LEVELS:-1,16,64} --cancel-requests ${CANCEL:-1000} --hf-budget 30 \
        --json "$OUT/serve.json" 2>&1 | grep -v "tensor/s" > "$OUT/serve.log"
    echo "serve rc=$?"; tail -45 "$OUT/serve.log"; t "serve done"
    ;;
esac
