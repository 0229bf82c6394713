#!/bin/bash
export DEVICEOPS_REQUIRE_GPU=${DEVICEOPS_REQUIRE_GPU:-1}  # a GPU test that would skip fails (tests/conftest.py)
# Issue 16 on the GPU, in one device call (~280 s): the reliability tests (beside a warm-up
# of the kernel cache), a 100k-op soak, a short host-overhead check, and the
# compute-sanitizer sweep over every kernel (4 tools in parallel).
# Usage (GPU machine, repo root): OUT=/some/dir bash tools/reliability_gpu_run.sh
OUT=${OUT:-/tmp/rel_out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
python3 -c "import trio" 2>/dev/null || { [ -d build/wheels_rel ] && python3 -m pip install -q --no-index \
  --no-deps --target /tmp/site build/wheels_rel/*.whl > "$OUT/pip_w.log" 2>&1 && export PYTHONPATH=/tmp/site; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || tail -3 "$OUT/pip.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t "tests + kernel-cache warm-up (the sweep's cases without a sanitizer)"
timeout 85 python3 tools/sanitize_all.py --worker > "$OUT/warm.log" 2>&1 &
timeout 90 python3 -m pytest -q -p no:cacheprovider --timeout 80 \
  tests/test_reliability_gpu.py tests/test_reliability_errors.py tests/test_bad_inputs.py \
  tests/test_reliability_deep.py tests/test_soak.py tests/test_properties.py \
  > "$OUT/tests.log" 2>&1; echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -15
wait; echo "warm-up: $(grep -c ' OK$' "$OUT/warm.log") ok, $(grep -c MISMATCH "$OUT/warm.log") mismatch, $(grep -c 'NO CASE' "$OUT/warm.log") no case"
grep -E "MISMATCH|NO CASE|Error" "$OUT/warm.log" | head -5
t "soak 100k"
timeout 45 python3 benchmarks/soak.py --ops 100000 --json "$OUT/soak.json" > "$OUT/soak.log" 2>&1
echo "soak rc=$?"; tail -3 "$OUT/soak.log"
t "overhead"
timeout 20 python3 benchmarks/overhead.py --samples-scale 0.2 --json "$OUT/overhead.json" > "$OUT/overhead.log" 2>&1
grep -E "chain|per op|PASS|FAIL" "$OUT/overhead.log" | head -14
t "sanitizers"
for tool in memcheck racecheck synccheck initcheck; do
  timeout 85 python3 tools/sanitize_all.py --tools $tool --timeout 75 --json "$OUT/san_$tool.json" \
    > "$OUT/san_$tool.log" 2>&1 &
done
wait
for tool in memcheck racecheck synccheck initcheck; do head -32 "$OUT/san_$tool.log"; done
t "done"
