#!/bin/bash
# Seventh-session GPU work (issue 12's allocating add; issue 13's kernels).
#   ab:    op_cost.py's cases named in ONLY (default: the allocating add, saxpy, argmax,
#          embedding) on this tree and on _old_head/ (a `git archive` of the previous
#          commit's packages, if present), alternating AB_N (default 2) times, fresh processes
#   parts: tools/alloc_parts_gpu.py on both trees (where a small op's host time goes), with a
#          cProfile on this tree
#   opcost: the whole op_cost.py table (every bar)
#   tests: the GPU tests of the files the change touches
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
esac; done
