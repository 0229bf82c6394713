#!/bin/bash
# Device-side GEMM run: install, SASS report, tests, sanitizer sweep, benchmark.
# Usage: [SKIP_SASS=1] [SKIP_TESTS=1] [SANITIZE=1] [SKIP_BENCH=1] bash benchmarks/gemm_device.sh [bench args]
set -o pipefail
OUT=${OUT:-/tmp/gemm_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || { echo "pip install failed"; tail -5 "$OUT/pip.log"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader
if [ -z "$SKIP_SASS" ]; then python3 benchmarks/gemm_sass.py "$OUT" 2>&1 | tee "$OUT/sass.log"; fi
if [ -z "$SKIP_TESTS" ]; then python3 -m pytest -q -x -p no:cacheprovider tests/test_gemm.py -s 2>&1 | tee "$OUT/pytest.log" | grep -E "seed=|passed|failed|Error|error|assert" | head -40; fi
if [ -n "$SANITIZE" ]; then compute-sanitizer --tool memcheck --error-exitcode 3 python3 benchmarks/gemm_sanitize.py > "$OUT/memcheck.log" 2>&1; echo "memcheck rc=$?"; tail -4 "$OUT/memcheck.log"; fi
if [ -z "$SKIP_BENCH" ]; then python3 benchmarks/gemm.py --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"; fi
if [ -n "$BENCH2" ]; then python3 benchmarks/gemm.py --json "$OUT/bench2.json" $BENCH2 2>&1 | tee "$OUT/bench2.log"; fi
