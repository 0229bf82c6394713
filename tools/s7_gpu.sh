#!/bin/bash
export DEVICEOPS_REQUIRE_GPU=${DEVICEOPS_REQUIRE_GPU:-1}  # a GPU test that would skip fails (tests/conftest.py)
# Seventh-session GPU work (issue 12's allocating add; issue 13's kernels).
#   ab:    op_cost.py's cases named in ONLY (default: the allocating add, saxpy, argmax,
#          embedding) on this tree and on _old_head/ (a `git archive` of the previous
#          commit's packages, if present), alternating AB_N (default 2) times, fresh processes
#   parts: tools/alloc_parts_gpu.py on both trees (where a small op's host time goes), with a
#          cProfile on this tree
#   opcost: the whole op_cost.py table (every bar)
#   tests: the GPU tests of the files the change touches (TEST_FILES)
#   attn:  split-KV cluster merge: attention + GEMV GPU tests, the cluster sweep
#          (tools/attn_cluster_gpu.py), the decode tables beside SDPA
#   final12: issue 12's figures: overhead.py (chains + the per-op table), graph_replay.py,
#          await_latency.py
#   replay: graph replay in both forms (graph_replay.py --form partition / flat) after the
#          elementwise, graph and kernel-op GPU tests (for branch wip/tiled-pdl)
# Usage: OUT=out bash tools/s7_gpu.sh ab parts opcost tests
OUT=${OUT:-/tmp/s7}
source "$(dirname "$0")/device_prologue.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 --version
for step in "$@"; do case "$step" in
ab)
    if [ -d _old_head ]; then
        rm -rf /tmp/oldpkg && mkdir -p /tmp/oldpkg && cp -r _old_head/deviceops /tmp/oldpkg/ && for d in scheduling graphs kernels nn; do
            cp -r _old_head/$d /tmp/oldpkg/deviceops/$d; done
    fi
    for i in $(seq ${AB_N:-2}); do
        for v in new old; do
            [ $v = old ] && [ ! -d /tmp/oldpkg ] && continue
            pp=$PYTHONPATH; [ $v = old ] && pp=/tmp/oldpkg:$PYTHONPATH
            (cd benchmarks && PYTHONPATH=$pp timeout 120 python3 op_cost.py --only ${ONLY:-allocating,saxpy,argmax,embedding} --rounds 7 --n 200 \
                --json "$OUT/ab_${v}_$i.json" > "$OUT/ab_${v}_$i.log" 2>&1)
            echo "== $v $i"; sed -n '/^op (as/,/^$/p' "$OUT/ab_${v}_$i.log" | cut -c1-150
        done
    done; t ab ;;
parts)
    timeout 120 python3 tools/alloc_parts_gpu.py --profile > "$OUT/alloc_parts.log" 2>&1; cat "$OUT/alloc_parts.log" | cut -c1-160
    if [ -d /tmp/oldpkg ]; then echo "== old tree"; PYTHONPATH=/tmp/oldpkg:$PYTHONPATH timeout 120 python3 tools/alloc_parts_gpu.py \
        > "$OUT/alloc_parts_old.log" 2>&1; cat "$OUT/alloc_parts_old.log"; fi; t parts ;;
opcost)
    (cd benchmarks && timeout 300 python3 op_cost.py --rounds ${ROUNDS:-5} --n 200 --json "$OUT/op_cost.json" \
        > "$OUT/op_cost.log" 2>&1); echo "op_cost rc=$?"; sed -n '/^Per-call/,$p' "$OUT/op_cost.log"; t opcost ;;
tests)
    timeout ${T_TESTS:-280} python3 -m pytest -q -p no:cacheprovider --timeout 150 ${TEST_FILES:-tests/test_elementwise.py \
        tests/test_alloc_gpu.py tests/test_spare.py tests/test_streams.py tests/test_hazards.py tests/test_replay_gpu.py tests/test_graphs.py tests/test_kernel_ops.py \
        tests/test_replay.py tests/test_plan_cache.py tests/test_ops.py} \
        > "$OUT/tests.log" 2>&1; echo "tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head; tail -1 "$OUT/tests.log"; t tests ;;
attn)
    timeout ${T_ATEST:-240} python3 -m pytest -q -x -p no:cacheprovider --timeout 150 tests/test_attention.py \
        tests/test_replay_gpu.py tests/test_gemm.py -k "${ATEST_K:-not test_gemm or gemv}" > "$OUT/attn_tests.log" 2>&1
    rc=$?; echo "attn tests rc=$rc"; grep -E "^(FAILED|ERROR)|Error" "$OUT/attn_tests.log" | head; tail -1 "$OUT/attn_tests.log"; t "attn tests"
    if [ $rc = 0 ]; then
        (cd benchmarks && timeout 200 python3 ../tools/attn_cluster_gpu.py --reps ${REPS:-30} \
            --json "$OUT/attn_cluster.json" > "$OUT/attn_cluster.log" 2>&1); echo "sweep rc=$?"
        sed -n '/^point/,$p' "$OUT/attn_cluster.log"; t "cluster sweep"
        (cd benchmarks && timeout 200 python3 attention.py --decode-tables --reps ${REPS:-30} \
            --json "$OUT/attention_decode.json" > "$OUT/attention_decode.log" 2>&1); echo "tables rc=$?"
        grep -iE "^\| |ratio|PASS|FAIL|B[0-9]+ " "$OUT/attention_decode.log" | head -60; t tables
    fi ;;
attn2)  # the cluster rule as committed: its tests, the decode tables, the sanitizers
    timeout 200 python3 -m pytest -q -x -p no:cacheprovider --timeout 150 tests/test_attention.py tests/test_replay_gpu.py \
        -k "cluster or kv_len or paged or wide or replay" > "$OUT/attn2_tests.log" 2>&1
    echo "attn2 tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/attn2_tests.log" | head; tail -1 "$OUT/attn2_tests.log"; t "attn2 tests"
    (cd benchmarks && timeout 200 python3 attention.py --decode-tables --reps ${REPS:-30} \
        --json "$OUT/attention_decode.json" > "$OUT/attention_decode.log" 2>&1); echo "tables rc=$?"
    grep -E "^\| " "$OUT/attention_decode.log" | head -40; t tables
    timeout ${T_SAN:-200} python3 tools/sanitize_all.py --tools memcheck,racecheck --only flash_attention \
        --timeout 180 --json "$OUT/san.json" > "$OUT/san.log" 2>&1; echo "san rc=$?"; tail -8 "$OUT/san.log"; t san ;;
final12)
    (cd benchmarks && timeout 330 python3 overhead.py --samples-scale ${SCALE:-0.3} --json "$OUT/overhead.json" \
        > "$OUT/overhead.log" 2>&1); echo "overhead rc=$?"; sed -n '/^Per-op host/,$p' "$OUT/overhead.log"; t overhead
    (cd benchmarks && timeout 120 python3 graph_replay.py --json "$OUT/graph_replay.json" > "$OUT/graph_replay.log" 2>&1)
    echo "graph_replay rc=$?"; tail -15 "$OUT/graph_replay.log"; t graph_replay
    (cd benchmarks && timeout 200 python3 await_latency.py --iters 1000 --load 3000 --json "$OUT/await_latency.json" \
        > "$OUT/await_latency.log" 2>&1); echo "await rc=$?"; tail -25 "$OUT/await_latency.log"; t await ;;
replay)
    timeout 200 python3 -m pytest -q -p no:cacheprovider --timeout 150 tests/test_elementwise.py tests/test_graphs.py \
        tests/test_kernel_ops.py tests/test_hazards.py tests/test_nn_tiny.py > "$OUT/replay_tests.log" 2>&1
    echo "replay tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/replay_tests.log" | head; tail -1 "$OUT/replay_tests.log"
    for f in partition flat; do
        (cd benchmarks && timeout 90 python3 graph_replay.py --form $f --json "$OUT/graph_replay_$f.json" 2>&1 | tail -9)
    done; t replay ;;
esac; done
