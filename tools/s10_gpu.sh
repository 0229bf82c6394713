#!/bin/bash
export DEVICEOPS_REQUIRE_GPU=${DEVICEOPS_REQUIRE_GPU:-1}  # a GPU test that would skip fails (tests/conftest.py)
# Tenth-session GPU work (issue 13): the cp.async K/V ring in the split-KV decode kernel
# (ATTN_STAGES) and one-consumer-warpgroup (64-row) tiles in the TMA skinny GEMM ("tma:S:ST:1").
#   ring:  tools/s10_attn_ring_gpu.py (ring variants x split targets beside SDPA; the ring and
#          the tool exist at commit f710793 only: check it out to re-run)
#   m32:   the M = 32 decode rows with the TMA kernel forced at 64 / 128 weight rows a block
#   tests: tests/test_gemm.py, test_attention.py, test_replay_gpu.py in three parallel processes
#   suite / w2: as tools/s9_gpu.sh / tools/s6_gpu.sh
# Usage: OUT=out bash tools/s10_gpu.sh ring m32 tests
OUT=${OUT:-/tmp/s10}
source "$(dirname "$0")/device_prologue.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; python3 --version
for step in "$@"; do case "$step" in
ring)
    timeout ${T_RING:-240} python3 tools/s10_attn_ring_gpu.py --reps ${REPS:-40} --json "$OUT/ring.json" \
        > "$OUT/ring.log" 2>&1; echo "ring rc=$?"; grep -v '^{' "$OUT/ring.log" | tail -25; t ring ;;
m32)
    (cd benchmarks && timeout 200 python3 gemm.py --m 32 --models smol,8b \
        --variants "${V32:-tma,tma:0:0:1,tma:1:0:1,tma:2:0:1,tma:4:0:1,tma:2:6:1,tma:1:6:1,tma:4:6:1}" \
        --json "$OUT/m32.json" > "$OUT/m32.log" 2>&1); echo "m32 rc=$?"; python3 tools/gemm_sweep_report.py "$OUT/m32.json"
    t m32 ;;
m32b)  # round 2: 64-row tiles with deeper rings, and the persistent kernel
    V=${V32B:-tma,tma:2:6:1,tma:2:8:1,tma:3:6:1,tma:2:5:1,tma:0:0:1:1,tma:0:0:2:1,tma:0:6:1:1,tma:0:3:1:1,tma:0:6:2:1,tma:0:4:2:1}
    (cd benchmarks && timeout 250 python3 gemm.py --m ${MS:-32} --models smol,8b --variants "$V" \
        --json "$OUT/m32b.json" > "$OUT/m32b.log" 2>&1); echo "m32b rc=$?"; python3 tools/gemm_sweep_report.py "$OUT/m32b.json"
    (cd benchmarks && timeout 250 python3 gemm.py --m ${MS2:-20,48,64} --models 8b --variants "${V2:-tma:2:6:1,tma:0:0:1:1,tma:0:0:2:1}" \
        --json "$OUT/m2064.json" > "$OUT/m2064.log" 2>&1); echo "m2064 rc=$?"; python3 tools/gemm_sweep_report.py "$OUT/m2064.json"
    t m32b ;;
final)  # memcheck + racecheck over the TMA skinny cases, the decode table, M = 48 / 64 rows
    [ -f .w1/part00 ] && mkdir -p /tmp/wts && cp .w1/part00 /tmp/wts/
    for tool in memcheck racecheck; do
        GEMM_SANITIZE_ONLY=tma timeout 150 compute-sanitizer --tool $tool --error-exitcode 3 \
            python3 tools/gemm_sanitize.py > "$OUT/tma_$tool.log" 2>&1; echo "$tool rc=$?"; tail -2 "$OUT/tma_$tool.log"
    done; t sanitize
    (cd benchmarks && timeout 200 python3 gemm.py --m 1,8,32 --json "$OUT/decode.json" > "$OUT/decode.log" 2>&1)
    echo "decode rc=$?"; python3 tools/gemm_sweep_report.py "$OUT/decode.json"; t decode
    (cd benchmarks && timeout 150 python3 gemm.py --m 20,48,64 --json "$OUT/m2064f.json" > "$OUT/m2064f.log" 2>&1)
    echo "m20/48/64 rc=$?"; python3 tools/gemm_sweep_report.py "$OUT/m2064f.json"; t m2064 ;;
mc)  # activation multicast in the TMA skinny kernel: GPU tests, sanitizers, M = 32 variants
    timeout 330 python3 -m pytest -q -p no:cacheprovider --timeout 300 tests/test_gemm.py \
        -k "skinny_trans_b or random or chain" > "$OUT/mc_tests.log" 2>&1
    echo "mc tests rc=$?"; grep -E "^(FAILED|ERROR)|^E  " "$OUT/mc_tests.log" | head -12; tail -1 "$OUT/mc_tests.log"; t tests
    for tool in memcheck racecheck; do
        GEMM_SANITIZE_ONLY=tma:1: timeout 150 compute-sanitizer --tool $tool --error-exitcode 3 \
            python3 tools/gemm_sanitize.py > "$OUT/mc_$tool.log" 2>&1; echo "$tool rc=$?"; tail -2 "$OUT/mc_$tool.log"
    done; t sanitize
    V=${VMC:-tma:1:10:2:2:4,tma:1:8:2:2:4,tma:1:6:2:2:4,tma:1:10:2:2:2,tma:1:6:2:2:2,tma:1:10,tma:1:10:1:2:4}
    for r in 1 2; do
        (cd benchmarks && timeout 200 python3 gemm.py --m ${MS:-32} --models 8b --variants "$V" \
            --json "$OUT/mc_$r.json" > "$OUT/mc_$r.log" 2>&1); echo "mc bench $r rc=$?"
        python3 tools/gemm_sweep_report.py "$OUT/mc_$r.json" | grep -v "qkv"
    done; t bench ;;
mc2)  # planned multicast: the odd-shape GPU test, then M = 20 / 32 with fewer stages forced
    timeout 330 python3 -m pytest -q -p no:cacheprovider --timeout 300 tests/test_gemm.py \
        -k "skinny_trans_b" > "$OUT/mc2_tests.log" 2>&1
    echo "mc2 tests rc=$?"; grep -E "^(FAILED|ERROR)|^E  " "$OUT/mc2_tests.log" | head -12; tail -1 "$OUT/mc2_tests.log"; t tests
    (cd benchmarks && timeout 200 python3 gemm.py --m 20,32 --models 8b --variants "${VMC2:-tma:1:4:2:2:4,tma:1:5:2:2:4,tma:1:6:2:2:1}" \
        --json "$OUT/mc2.json" > "$OUT/mc2.log" 2>&1); echo "mc2 bench rc=$?"
    python3 tools/gemm_sweep_report.py "$OUT/mc2.json" | grep -v "qkv"; t bench ;;
w2) bash tools/s6_gpu.sh w2 ;;
w1) mkdir -p /tmp/wts && cp .w1/part00 /tmp/wts/ && t "part00 copied" ;;
ab)  # within 30 s of w1 (carry .w2 and _old_s9/, a git archive of 60720a4's package): decode.py
    # on this tree and on the ninth session's code, alternating, on one machine instance
    [ -f /tmp/wts/part00 ] || { echo "machine went cold: no part00"; exit 2; }
    cp .w2/part01 /tmp/wts/ && cat /tmp/wts/part00 /tmp/wts/part01 > /tmp/wts/model.gguf
    rm -rf /tmp/oldpkg && mkdir -p /tmp/oldpkg && cp -r _old_s9/deviceops /tmp/oldpkg/ && for d in scheduling graphs kernels nn; do
        cp -r _old_s9/$d /tmp/oldpkg/deviceops/$d; done
    for r in $(seq ${ROUNDS:-2}); do for v in ${ORDER:-new old}; do
        pp=$PYTHONPATH; [ $v = old ] && pp=/tmp/oldpkg:$PYTHONPATH
        [ $r = 1 ] && (cd benchmarks && PYTHONPATH=$pp python3 -c "import deviceops.kernels._gemm_plan as g; print('$v:', g.__file__)")
        PYTHONPATH=$pp timeout 100 python3 benchmarks/decode.py --gguf /tmp/wts/model.gguf --no-transformers \
            --json "$OUT/ab_${v}_$r.json" > "$OUT/ab_${v}_$r.log" 2>&1; echo "$v $r rc=$?"
        grep -E "^(prefill|decode batch .* graph)" "$OUT/ab_${v}_$r.log"
    done; done; t ab ;;
tests)
    PYT="python3 -m pytest -q -p no:cacheprovider --timeout 200 -rs -x"
    pids=()
    for f in ${TESTS:-test_gemm test_attention test_replay_gpu}; do
        timeout ${T_PAR:-400} $PYT tests/$f.py > "$OUT/t_$f.log" 2>&1 & pids+=($!)
    done
    for p in "${pids[@]}"; do wait $p; done
    for f in ${TESTS:-test_gemm test_attention test_replay_gpu}; do echo "$f: $(tail -1 "$OUT/t_$f.log")"; grep -E "^(FAILED|ERROR)" "$OUT/t_$f.log" | head -5; done
    t tests ;;
suite) bash tools/s9_gpu.sh suite ;;
*) echo "unknown step $step" ;;
esac; done
