#!/bin/bash
# Every GPU-machine run of the project, one step an argument, run in the order given.
# Usage (repository root on the GPU machine):
#   OUT=out bash tools/gpu.sh <step> [<step> ...]
#
# Steps:
#   tests          the whole suite on one GPU, in parallel groups (attention, other kernels,
#                  nn/serve, the rest),
#                  then the files with timing assertions alone; DEVICEOPS_REQUIRE_GPU=1
#   tests-groups   only the parallel groups of `tests`
#   tests-serial   only the files with timing assertions, alone (the second half of `tests`)
#   tests-multi    the whole suite on a two-GPU machine: the multi-device files see both GPUs
#                  (DEVICEOPS_REQUIRE_GPU=2), the other groups are pinned to one GPU each
#   tests-files    only the test files named in $FILES (space-separated), with $PYTEST_ARGS
#   precompile     tools/gemm_precompile.py (fills the kernel cache in parallel)
#   bench-core     benchmarks/overhead.py, graph_replay.py, overlap.py, await_latency.py
#   bench-op-cost  benchmarks/op_cost.py
#   bench-gemm     benchmarks/gemm.py (the decode rows M = 1, 8, 32; $GEMM_ARGS replaces them)
#   bench-attention benchmarks/attention.py --decode-tables ($ATTN_ARGS replaces them)
#   bench-norms    benchmarks/norms.py
#   generate-timing tools/generate_timing.py: `generate` (the next step queued) against the same
#                  steps read one at a time, batch 1 and 32, a SmolLM2-shaped random model
#   fused-check    tools/fused_check.py: the fused decode kernel against the unfused ops (logits),
#                  then graph step times of both and the fused kernel's per-phase clock
#   bench-decode   benchmarks/decode.py on the SmolLM2 GGUF (HF=1: with transformers beside it)
#   bench-serve    benchmarks/serve.py on the SmolLM2 GGUF ($SERVE_ARGS appended)
#   bench-soak     benchmarks/soak.py ($SOAK_OPS ops, default 1,000,000)
#   bench-multi-gpu benchmarks/multi_gpu.py (two GPUs; with --serve when the GGUF is here)
#   ray            tests/test_ray.py and benchmarks/ray_serve.py (two GPUs; Ray wheels below)
#   first-use      tools/first_use_gpu.py with an empty kernel cache ($FIRST_USE_PARTS)
#   sanitize       compute-sanitizer memcheck, racecheck, synccheck, initcheck over every
#                  kernel (tools/sanitize_all.py), after a warm-up of the kernel cache
#   stage          nothing beyond the common set-up below (e.g. to carry the first half of
#                  the weights in one call and run the steps in the next)
#
# Set-up before the steps:
#   - outputs (logs, JSON) go to $OUT (default /tmp/deviceops_out);
#   - wheels carried in .whl/ (and .whlray/ for the ray step) are installed offline
#     (pip --no-index --find-links) into /tmp/site, put on PYTHONPATH; then this checkout
#     is installed editable;
#   - the SmolLM2-135M GGUF travels in two halves, each under the 64 MiB a call carries:
#     a call carrying .w1/part00 leaves it in /tmp/wts; a call carrying .w2/part01 joins
#     both into /tmp/wts/model.gguf (the machine must still be warm). When that file
#     exists, DEVICEOPS_SMOLLM2_GGUF points at it (tests and benchmarks use it);
#   - the Ray wheel travels the same way: .wr1/ray.part00, then .wr2/ray.part01, joined
#     into /tmp/rayw and checked against .whlray/*.sha256;
#   - DEVICEOPS_REQUIRE_GPU=1 (set it to the GPU count to require the multi-GPU tests):
#     a GPU test that would skip fails instead (tests/conftest.py).
# Time limits: T_TESTS (per test group, default 480 s), T_BENCH (per benchmark, 300 s).
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/deviceops_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export DEVICEOPS_REQUIRE_GPU=${DEVICEOPS_REQUIRE_GPU:-1}
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
T_TESTS=${T_TESTS:-480}; T_BENCH=${T_BENCH:-300}
PYT="python3 -m pytest -q -p no:cacheprovider --timeout 300 -rs"

# --- set-up ----------------------------------------------------------------------------
[ $# -gt 0 ] || { sed -n '2,44p' "$0"; exit 2; }
WHEELS=()
if ls .whl/*.whl >/dev/null 2>&1; then WHEELS+=(.whl/*.whl); fi
if [[ " $* " == *" ray "* ]]; then
    mkdir -p /tmp/rayw
    [ -f .wr1/ray.part00 ] && cp .wr1/ray.part00 /tmp/rayw/
    if [ -f .wr2/ray.part01 ]; then
        [ -f /tmp/rayw/ray.part00 ] || { echo "machine went cold: no ray.part00 (carry .wr1 first)"; exit 2; }
        RAYWHEEL=$(basename "$(ls .whlray/*.sha256 | head -1)" .sha256)
        RAYWHEEL=$(awk '{print $2}' ".whlray/$RAYWHEEL.sha256")
        cat /tmp/rayw/ray.part00 .wr2/ray.part01 > "/tmp/rayw/$RAYWHEEL"
        (cd /tmp/rayw && sha256sum -c "$OLDPWD"/.whlray/*.sha256) || exit 2
    fi
    if ls .whlray/*.whl >/dev/null 2>&1; then WHEELS+=(.whlray/*.whl); fi
    if ls /tmp/rayw/*.whl >/dev/null 2>&1; then WHEELS+=(/tmp/rayw/*.whl); fi
fi
if [ ${#WHEELS[@]} -gt 0 ]; then
    LINKS=(--find-links .whl); [ -d .whlray ] && LINKS+=(--find-links .whlray)
    python3 -m pip install -q --no-index "${LINKS[@]}" --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site "${WHEELS[@]}" > "$OUT/pip_whl.log" 2>&1 \
        || { echo "wheel install failed"; tail -5 "$OUT/pip_whl.log"; }
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 \
    || { echo "pip install -e . failed"; tail -5 "$OUT/pip.log"; }
mkdir -p /tmp/wts
[ -f .w1/part00 ] && cp .w1/part00 /tmp/wts/ && echo "weights: part00 staged"
if [ -f .w2/part01 ]; then
    [ -f /tmp/wts/part00 ] || { echo "machine went cold: no part00 (carry .w1 first)"; exit 2; }
    cat /tmp/wts/part00 .w2/part01 > /tmp/wts/model.gguf
    echo "weights: model.gguf $(sha256sum /tmp/wts/model.gguf | cut -c1-16)"
fi
GGUF=""
if [ -f /tmp/wts/model.gguf ]; then GGUF=/tmp/wts/model.gguf; export DEVICEOPS_SMOLLM2_GGUF=$GGUF; fi
nvidia-smi --query-gpu=index,name,driver_version,memory.used --format=csv,noheader; python3 --version
t "set-up done"

summary() {  # the last line and the failures of a pytest log
    echo "== $1: $(tail -1 "$OUT/$1.log")"
    grep -E "^(FAILED|ERROR)" "$OUT/$1.log" | head -10
}
bench() {  # bench NAME ARGS...: benchmarks/NAME.py ARGS --json $OUT/NAME.json
    local name=$1; shift
    timeout "$T_BENCH" python3 "benchmarks/$name.py" "$@" --json "$OUT/$name.json" \
        2>&1 | grep -v "tensor/s" > "$OUT/$name.log"
    echo "$name rc=${PIPESTATUS[0]}"; tail -${TAIL:-30} "$OUT/$name.log"; t "$name"
}
need_gguf() { [ -n "$GGUF" ] || { echo "$1: no /tmp/wts/model.gguf (carry .w1, then .w2)"; return 1; }; }

# files with timing assertions run alone, after the parallel groups
SERIAL="test_streams test_scheduling test_async test_benchmarks test_examples test_backend"
KERNELS="test_gemm test_replay_gpu test_transformer_kernels test_kernel_ops test_elementwise"  # test_attention: a group of its own
MULTI="test_multi_device test_nn_devices test_serve_devices"

# `tests` is its two halves in order
STEPS=(); for s in "$@"; do if [ "$s" = tests ]; then STEPS+=(tests-groups tests-serial); else STEPS+=("$s"); fi; done
for step in "${STEPS[@]}"; do case "$step" in
stage) ;;
precompile)
    timeout 120 python3 tools/gemm_precompile.py -j "$(nproc)" > "$OUT/precompile.log" 2>&1
    echo "precompile rc=$?"; tail -2 "$OUT/precompile.log"; t precompile ;;
tests-serial)
    timeout "$T_TESTS" $PYT $(for b in $SERIAL; do echo "tests/$b.py"; done) > "$OUT/t_serial.log" 2>&1
    summary t_serial; t "$step" ;;
tests-groups|tests-multi)
    g1=""; g2=""; g3=""; gm=""; ser=""; ga="tests/test_attention.py"
    for f in tests/test_*.py; do
        b=$(basename "$f" .py)
        if [ "$b" = test_attention ]; then continue
        elif [[ " $SERIAL " == *" $b "* ]]; then ser="$ser $f"
        elif [[ " $MULTI " == *" $b "* ]]; then gm="$gm $f"
        elif [[ " $KERNELS " == *" $b "* ]]; then g1="$g1 $f"
        elif [[ "$b" == test_nn_* || "$b" == test_serve_* || "$b" == test_soak || "$b" == test_engine* ]]; then g2="$g2 $f"
        else g3="$g3 $f"; fi
    done
    if [ "$step" = tests-multi ]; then
        ( DEVICEOPS_REQUIRE_GPU=2 timeout "$T_TESTS" $PYT $gm $ser > "$OUT/t_multi.log" 2>&1 ) &
        ( CUDA_VISIBLE_DEVICES=0 timeout "$T_TESTS" $PYT $g1 > "$OUT/t_kernels.log" 2>&1 ) &
        ( CUDA_VISIBLE_DEVICES=0 timeout "$T_TESTS" $PYT $ga > "$OUT/t_attention.log" 2>&1 ) &
        ( CUDA_VISIBLE_DEVICES=1 timeout "$T_TESTS" $PYT $g2 > "$OUT/t_nn.log" 2>&1 ) &
        ( CUDA_VISIBLE_DEVICES=1 timeout "$T_TESTS" $PYT $g3 > "$OUT/t_rest.log" 2>&1 ) &
        wait
        for g in t_multi t_kernels t_attention t_nn t_rest; do summary $g; done
    else
        ( timeout "$T_TESTS" $PYT $g1 > "$OUT/t_kernels.log" 2>&1 ) &
        ( timeout "$T_TESTS" $PYT $ga > "$OUT/t_attention.log" 2>&1 ) &
        ( timeout "$T_TESTS" $PYT $g2 $gm > "$OUT/t_nn.log" 2>&1 ) &
        ( timeout "$T_TESTS" $PYT $g3 > "$OUT/t_rest.log" 2>&1 ) &
        wait
        for g in t_kernels t_attention t_nn t_rest; do summary $g; done
    fi
    t "$step" ;;
tests-files)
    timeout "$T_TESTS" $PYT ${PYTEST_ARGS:-} ${FILES:?set FILES} > "$OUT/t_files.log" 2>&1
    summary t_files; t tests-files ;;
bench-core)
    for b in overhead graph_replay await_latency; do bench $b; done
    bench overlap --trace "$OUT/overlap_trace.json" ;;
bench-op-cost) bench op_cost ;;
bench-gemm) bench gemm ${GEMM_ARGS:---m 1,8,32} ;;
bench-attention) bench attention ${ATTN_ARGS:---decode-tables} ;;
bench-norms) bench norms ;;
generate-timing)
    timeout 300 python3 tools/generate_timing.py > "$OUT/generate_timing.log" 2>&1
    echo "generate-timing rc=$?"; tail -3 "$OUT/generate_timing.log"; t generate-timing ;;
fused-check)
    timeout 500 python3 tools/fused_check.py > "$OUT/fused_check.log" 2>&1
    echo "fused-check rc=$?"; tail -22 "$OUT/fused_check.log"; t fused-check ;;
bench-soak) bench soak --ops "${SOAK_OPS:-1000000}" ;;
bench-decode)
    need_gguf bench-decode || continue
    if [ -n "${HF:-}" ]; then bench decode --gguf "$GGUF"; else bench decode --gguf "$GGUF" --no-transformers; fi ;;
bench-serve)
    need_gguf bench-serve || continue
    TAIL=80 bench serve --gguf "$GGUF" ${SERVE_ARGS:-} ;;
bench-multi-gpu)
    if [ -n "$GGUF" ]; then TAIL=45 bench multi_gpu --no-host --serve "$GGUF"
    else TAIL=45 bench multi_gpu --no-host; fi ;;
ray)
    need_gguf ray || continue
    python3 -c "import ray; print('ray', ray.__version__)" || { echo "ray: not importable (carry .wr1, then .wr2 .whlray)"; continue; }
    export RAY_USAGE_STATS_ENABLED=0
    timeout 180 $PYT tests/test_ray.py > "$OUT/t_ray.log" 2>&1; summary t_ray
    TAIL=25 bench ray_serve --gguf "$GGUF" ;;
first-use)
    timeout 300 python3 tools/first_use_gpu.py --parts "${FIRST_USE_PARTS:-ticker,server}" \
        --json "$OUT/first_use.json" > "$OUT/first_use.log" 2>&1
    echo "first use rc=$?"; grep -E "PASS|FAIL" "$OUT/first_use.log" | head -12; t first-use ;;
sanitize)
    timeout 120 python3 tools/sanitize_all.py --worker > "$OUT/san_warm.log" 2>&1
    echo "warm-up: $(grep -c ' OK$' "$OUT/san_warm.log") ok, $(grep -c MISMATCH "$OUT/san_warm.log") mismatch"
    for tool in memcheck racecheck synccheck initcheck; do
        timeout 300 python3 tools/sanitize_all.py --tools $tool --timeout 290 \
            --json "$OUT/san_$tool.json" > "$OUT/san_$tool.log" 2>&1 &
    done
    wait
    for tool in memcheck racecheck synccheck initcheck; do head -1 "$OUT/san_$tool.log"; done
    t sanitize ;;
*) echo "unknown step: $step (bash tools/gpu.sh with no step lists them)"; exit 2 ;;
esac; done
