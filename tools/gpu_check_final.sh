#!/bin/bash
export DEVICEOPS_REQUIRE_GPU=${DEVICEOPS_REQUIRE_GPU:-1}  # a GPU test that would skip fails (tests/conftest.py)
# GPU check of the last changes: core hooks (sync/await/graph), one launch path (sm_90
# attention, slow_copy through KernelFn; libcuda in one place), layering.
OUT=${OUT:-/tmp/fin}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
python3 -c "import trio" 2>/dev/null || { python3 -m pip install -q --no-index --no-deps --target /tmp/site build/wheels_rel/*.whl > "$OUT/pip_w.log" 2>&1; export PYTHONPATH=/tmp/site; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || tail -3 "$OUT/pip.log"
timeout 60 python3 tools/gemm_precompile.py -j 16 > "$OUT/precompile.log" 2>&1 &
timeout 240 python3 -m pytest -q -p no:cacheprovider --timeout 200 tests/test_attention.py tests/test_async.py \
  tests/test_graphs.py tests/test_hazards.py tests/test_streams.py tests/test_layering.py \
  tests/test_scheduling.py tests/test_api.py tests/test_reliability_gpu.py > "$OUT/t1.log" 2>&1
echo "tests1 rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/t1.log" | head; tail -1 "$OUT/t1.log"; wait; t t1
timeout 150 python3 -m pytest -q -p no:cacheprovider --timeout 140 tests/test_gemm.py tests/test_nn_gpu_paged.py \
  tests/test_examples.py > "$OUT/t2.log" 2>&1
echo "tests2 rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/t2.log" | head; tail -1 "$OUT/t2.log"; t done
