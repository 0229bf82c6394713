#!/bin/bash
# The whole suite and the multi-GPU benchmark on a machine with two GPUs (nvidia-h100-x2 /
# nvidia-h200-x2), in two device calls: the SmolLM2 GGUF is 98 MB and one call carries 64 MiB
# (see weights-on-device.md: .w1/part00 and .w2/part01, git-ignored).
#   phase a (carry .w1):              bash tools/multi_gpu_verify.sh a
#   phase b (carry .w2 .whl):         OUT=dir bash tools/multi_gpu_verify.sh b
# Phase b runs the test files in parallel groups, each pinned to one GPU with
# CUDA_VISIBLE_DEVICES except the group of multi-device files, which sees both;
# DEVICEOPS_REQUIRE_GPU=1 (2 for that group) turns any GPU skip into a failure. Then
# benchmarks/multi_gpu.py (zip over GPUs, peer copies; SERVE_BENCH=1: HTTP serving with
# --devices) alone on the machine. tools/first_use_gpu.py (first-use compile stalls, empty
# kernel caches) runs beside the tests.
set -o pipefail
case "$1" in
a)
    mkdir -p /tmp/wts && cp .w1/part00 /tmp/wts/ && echo "part00 copied"
    exit 0 ;;
b) ;;
*) echo "usage: $0 a|b"; exit 2 ;;
esac
OUT=${OUT:-/tmp/multi_gpu_verify}
source "$(dirname "$0")/device_prologue.sh"  # OUT, the timer t, carried wheels, editable install
[ -f /tmp/wts/part00 ] || { echo "machine went cold: no part00"; exit 2; }
cp .w2/part01 /tmp/wts/ && cat /tmp/wts/part00 /tmp/wts/part01 > /tmp/wts/model.gguf
sha256sum /tmp/wts/model.gguf | cut -c1-16
export DEVICEOPS_SMOLLM2_GGUF=/tmp/wts/model.gguf DEVICEOPS_REQUIRE_GPU=1
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
P="python3 -m pytest -q -p no:cacheprovider --timeout 300"
MULTI="tests/test_multi_device.py tests/test_nn_devices.py tests/test_serve_devices.py tests/test_scheduling.py"
ALL=$(ls tests/test_*.py)
REST=""
for f in $ALL; do
    case " $MULTI tests/test_attention.py tests/test_gemm.py " in *" $f "*) ;; *) REST="$REST $f";; esac
done
HALF=$(echo $REST | wc -w); HALF=$(( (HALF + 1) / 2 ))
R1=$(echo $REST | tr ' ' '\n' | head -n $HALF | tr '\n' ' ')
R2=$(echo $REST | tr ' ' '\n' | tail -n +$(( HALF + 1 )) | tr '\n' ' ')
( timeout ${T_FIRST:-200} python3 tools/first_use_gpu.py --parts ticker,server \
    --json "$OUT/first_use.json" > "$OUT/first_use.log" 2>&1; echo "first use rc=$?" ) &
( DEVICEOPS_REQUIRE_GPU=2 timeout ${T_TESTS:-540} $P $MULTI > "$OUT/t_multi.log" 2>&1; echo "multi rc=$?" ) &
( CUDA_VISIBLE_DEVICES=1 timeout ${T_TESTS:-540} $P tests/test_attention.py > "$OUT/t_attn.log" 2>&1; echo "attention rc=$?" ) &
( CUDA_VISIBLE_DEVICES=0 timeout ${T_TESTS:-540} $P tests/test_gemm.py > "$OUT/t_gemm.log" 2>&1; echo "gemm rc=$?" ) &
( CUDA_VISIBLE_DEVICES=0 timeout ${T_TESTS:-540} $P $R1 > "$OUT/t_r1.log" 2>&1; echo "rest 1 rc=$?" ) &
( CUDA_VISIBLE_DEVICES=1 timeout ${T_TESTS:-540} $P $R2 > "$OUT/t_r2.log" 2>&1; echo "rest 2 rc=$?" ) &
wait
t "tests done"
for g in multi attn gemm r1 r2; do
    echo "== $g: $(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$OUT/t_$g.log" | tail -1)"
    grep -E "^(FAILED|ERROR)" "$OUT/t_$g.log" | head -10
done
grep -E "PASS|FAIL" "$OUT/first_use.log" | head -12
SERVE=(); [ -n "$SERVE_BENCH" ] && SERVE=(--serve /tmp/wts/model.gguf)
timeout ${T_BENCH:-300} python3 benchmarks/multi_gpu.py --no-host "${SERVE[@]}" \
    --json "$OUT/multi_gpu.json" > "$OUT/multi_gpu.log" 2>&1
echo "multi_gpu rc=$?"; grep -v "tensor/s" "$OUT/multi_gpu.log" | tail -45
t "benchmark done"
