#!/bin/bash
# Issue 16 on the GPU, in one device call (~280 s): the reliability tests, a 100k-op soak,
# a short host-overhead check, and the compute-sanitizer sweep (4 tools in parallel).
# Usage (GPU machine, repo root): OUT=/some/dir bash tools/reliability_gpu_run.sh
OUT=${OUT:-/tmp/rel_out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || tail -3 "$OUT/pip.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t "tests"
timeout 110 python3 -m pytest -q -p no:cacheprovider --timeout 100 \
  tests/test_reliability_gpu.py tests/test_reliability_errors.py tests/test_bad_inputs.py \
  tests/test_reliability_deep.py tests/test_soak.py tests/test_properties.py \
  > "$OUT/tests.log" 2>&1; echo "pytest rc=$?"; tail -4 "$OUT/tests.log"
t "soak 100k"
timeout 60 python3 benchmarks/soak.py --ops 100000 --json "$OUT/soak.json" > "$OUT/soak.log" 2>&1
echo "soak rc=$?"; tail -3 "$OUT/soak.log"
t "overhead"
timeout 25 python3 benchmarks/overhead.py --samples-scale 0.2 --json "$OUT/overhead.json" > "$OUT/overhead.log" 2>&1
grep -E "async_on|sync_on|then|PASS|FAIL" "$OUT/overhead.log" | head -12
t "sanitizers"
for tool in memcheck racecheck synccheck initcheck; do
  timeout 100 python3 tools/sanitize_all.py --tools $tool --timeout 90 --json "$OUT/san_$tool.json" \
    > "$OUT/san_$tool.log" 2>&1 &
done
wait
for tool in memcheck racecheck synccheck initcheck; do head -30 "$OUT/san_$tool.log"; done
t "done"
