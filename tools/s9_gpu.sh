#!/bin/bash
export DEVICEOPS_REQUIRE_GPU=${DEVICEOPS_REQUIRE_GPU:-1}  # a GPU test that would skip fails (tests/conftest.py)
# Ninth-session GPU work (issue 13): two-block clusters with B multicast in the sm_90 GEMM
# (configs 128x256c2 / 128x128c2) and programmatic dependent launch of every sm_90 GEMM kernel.
#   c2tests: the GEMM GPU tests that cover the new code (cluster pairs, back-to-back dependent
#            GEMMs over every path, random shapes with forced configs, edge shapes), memcheck
#            over the cluster cases
#   c2bench: classic shapes and the prefill rows (M = 128 / 512 / 2048) with the cluster
#            configs forced beside the planner's choice and cuBLAS
#   decode:  the decode rows (M = 1 / 8 / 32) as planned, and M = 32 again without PDL
#   nopdl:   the classic shapes with DEVICEOPS_PDL=0
#   host:    host cost per call (gemm.py --host)
#   suite:   the whole suite but the real-weights file (then tools/s6_gpu.sh w2 within 30 s)
#   m32:     the M = 32 decode rows with the TMA / skinny kernels forced
#   overhead: benchmarks/overhead.py (issue 12's per-op host cost beside torch)
# Usage: OUT=out bash tools/s9_gpu.sh c2tests c2bench
OUT=${OUT:-/tmp/s9}
source "$(dirname "$0")/device_prologue.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; python3 --version
VARS=${VARS:-regstore,128x256c2,128x256,128x128}
for step in "$@"; do case "$step" in
c2tests)
    timeout ${T_TEST:-240} python3 -m pytest -q -p no:cacheprovider --timeout 200 tests/test_gemm.py \
        -k "${GTEST_K:-cluster or back_to_back or random or edge or tma_store}" > "$OUT/c2_tests.log" 2>&1
    echo "c2 tests rc=$?"; grep -E "^(FAILED|ERROR)|^E  " "$OUT/c2_tests.log" | head -12; tail -1 "$OUT/c2_tests.log"; t tests
    GEMM_SANITIZE_ONLY=128x timeout 150 compute-sanitizer --tool memcheck --error-exitcode 3 \
        python3 tools/gemm_sanitize.py > "$OUT/sm90_memcheck.log" 2>&1; echo "memcheck sm_90 tiles rc=$?"
    tail -2 "$OUT/sm90_memcheck.log"; t memcheck
    GEMM_SANITIZE_ONLY=128x256 timeout 200 compute-sanitizer --tool racecheck --error-exitcode 3 \
        python3 tools/gemm_sanitize.py > "$OUT/sm90_racecheck.log" 2>&1; echo "racecheck 128x256* rc=$?"
    tail -2 "$OUT/sm90_racecheck.log"; t racecheck ;;
c2bench)
    (cd benchmarks && timeout 200 python3 gemm.py --models "" --classic --variants "$VARS" \
        --json "$OUT/c2_classic.json" > "$OUT/c2_classic.log" 2>&1); echo "classic rc=$?"
    python3 tools/gemm_sweep_report.py "$OUT/c2_classic.json"; t classic
    (cd benchmarks && timeout 240 python3 gemm.py --m ${MS:-128,512,2048} --models ${MODELS:-smol,8b} --variants "$VARS" \
        --json "$OUT/c2_prefill.json" > "$OUT/c2_prefill.log" 2>&1); echo "prefill rc=$?"
    python3 tools/gemm_sweep_report.py "$OUT/c2_prefill.json"; t prefill ;;
decode)
    (cd benchmarks && timeout 200 python3 gemm.py --m 1,8,32 --json "$OUT/decode.json" > "$OUT/decode.log" 2>&1)
    echo "decode rc=$?"; python3 tools/gemm_sweep_report.py "$OUT/decode.json"; t decode
    (cd benchmarks && DEVICEOPS_PDL=0 timeout 100 python3 gemm.py --m 32 --json "$OUT/decode_nopdl.json" \
        > "$OUT/decode_nopdl.log" 2>&1); echo "decode no-PDL rc=$?"; python3 tools/gemm_sweep_report.py "$OUT/decode_nopdl.json"
    t nopdl ;;
nopdl)  # the classic shapes with programmatic dependent launch off (DEVICEOPS_PDL=0), for comparison
    (cd benchmarks && DEVICEOPS_PDL=0 timeout 200 python3 gemm.py --models "" --classic \
        --json "$OUT/classic_nopdl.json" > "$OUT/classic_nopdl.log" 2>&1); echo "classic no-PDL rc=$?"
    python3 tools/gemm_sweep_report.py "$OUT/classic_nopdl.json"; t nopdl ;;
nopdl)  # the classic shapes with programmatic dependent launch off (DEVICEOPS_PDL=0), for comparison
    (cd benchmarks && DEVICEOPS_PDL=0 timeout 200 python3 gemm.py --models "" --classic \
        --json "$OUT/classic_nopdl.json" > "$OUT/classic_nopdl.log" 2>&1); echo "classic no-PDL rc=$?"
    python3 tools/gemm_sweep_report.py "$OUT/classic_nopdl.json"; t nopdl ;;
suite)  # the whole suite but the real-weights file, in five parallel pytest processes, then the
    # files with timing assertions alone (carry .w1 too: part00 of the GGUF stays for s6_gpu.sh w2)
    [ -f .w1/part00 ] && mkdir -p /tmp/wts && cp .w1/part00 /tmp/wts/
    PYT="python3 -m pytest -q -p no:cacheprovider --timeout 200 -rs"
    SERIAL="test_streams test_scheduling test_async test_benchmarks test_examples test_backend"
    declare -A grp=()
    for f in tests/test_*.py; do
        b=$(basename "$f" .py); [ "$b" = test_nn_gpu ] && continue
        if [[ " $SERIAL " == *" $b "* ]]; then g=ser
        elif [[ "$b" == test_attention ]]; then g=k1
        elif [[ "$b" == test_gemm ]]; then g=k3  # with test_attention it ran past 400 s (ninth session)
        elif [[ " test_replay_gpu test_transformer_kernels test_kernel_ops test_elementwise " == *" $b "* ]]; then g=k2
        elif [[ "$b" == test_nn_* || "$b" == test_serve_* || "$b" == test_soak || "$b" == test_engine ]]; then g=nn
        else g=other; fi
        grp[$g]="${grp[$g]} $f"
    done
    pids=()
    for g in k1 k2 k3 nn other; do timeout ${T_PAR:-420} $PYT ${grp[$g]} > "$OUT/suite_$g.log" 2>&1 & pids+=($!); done
    for p in "${pids[@]}"; do wait $p; done
    for g in k1 k2 k3 nn other; do echo "$g: $(tail -1 "$OUT/suite_$g.log")"; grep -E "^(FAILED|ERROR)" "$OUT/suite_$g.log" | head -5; done
    t "parallel groups"
    timeout ${T_SER:-120} $PYT ${grp[ser]} > "$OUT/suite_serial.log" 2>&1; echo "serial rc=$?"
    tail -1 "$OUT/suite_serial.log"; grep -E "^(FAILED|ERROR)" "$OUT/suite_serial.log" | head; t "serial files" ;;
m32)  # the decode rows at M = 32 with the TMA skinny kernel and other skinny geometries forced
    (cd benchmarks && timeout 150 python3 gemm.py --m 32 --models smol,8b --variants "${V32:-tma,tma:2,skinny,skinny:8:2:2}" \
        --json "$OUT/m32.json" > "$OUT/m32.log" 2>&1); echo "m32 rc=$?"; python3 tools/gemm_sweep_report.py "$OUT/m32.json"
    t m32 ;;
overhead)  # issue 12's host-cost table (every KernelOp at decode sizes beside torch eager)
    (cd benchmarks && timeout 330 python3 overhead.py --samples-scale ${SCALE:-0.3} --json "$OUT/overhead.json" \
        > "$OUT/overhead.log" 2>&1); echo "overhead rc=$?"; sed -n '/^Per-op host/,$p' "$OUT/overhead.log"; t overhead ;;
host)
    (cd benchmarks && timeout 100 python3 gemm.py --models "" --host --json "$OUT/host.json" > "$OUT/host.log" 2>&1)
    echo "host rc=$?"; grep "host_us" "$OUT/host.log"; t host ;;
esac; done
