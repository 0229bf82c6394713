#!/bin/bash
# Eighth-session GPU work (issue 13). The slab GEMM experiment's mode lives on branch
# wip/slab-gemm (benchmarks/RESULTS-gemm.md, "Eighth session").
#   attn: the split-KV cluster rule for long splits: the attention / replay GPU tests of the
#         cluster, kv_len, paged and replay cases, then the decode tables beside SDPA
# Usage: OUT=out bash tools/s8_gpu.sh attn
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
esac; done
