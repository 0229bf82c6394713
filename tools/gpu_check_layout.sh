#!/bin/bash
export DEVICEOPS_REQUIRE_GPU=${DEVICEOPS_REQUIRE_GPU:-1}  # a GPU test that would skip fails (tests/conftest.py)
# GPU tests of the code changed after the session's final verification: kernels layout
# (builder/workspace/gemm_op split, kernels.testing), ping-pong GEMM removal, nn.random_model.
OUT=${OUT:-/tmp/lay}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
python3 -c "import trio" 2>/dev/null || { python3 -m pip install -q --no-index --no-deps --target /tmp/site build/wheels_rel/*.whl > "$OUT/pip_w.log" 2>&1; export PYTHONPATH=/tmp/site; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || tail -3 "$OUT/pip.log"
timeout 100 python3 tools/gemm_precompile.py -j 16 > "$OUT/precompile.log" 2>&1; echo "precompile rc=$?"; t precompiled
timeout 330 python3 -m pytest -q -p no:cacheprovider --timeout 200 tests/test_gemm.py tests/test_kernel_ops.py \
  tests/test_transformer_kernels.py tests/test_elementwise.py tests/test_hazards.py tests/test_streams.py \
  tests/test_examples.py tests/test_nn_gpu_paged.py tests/test_plan_cache.py > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head; tail -2 "$OUT/tests.log"; t done
