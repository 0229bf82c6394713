#!/bin/bash
# Host cost after the plan-cache, norm-plan and allocation changes: tests, eager step, op_cost.
OUT=${OUT:-/tmp/c3}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
python3 -c "import trio" 2>/dev/null || { python3 -m pip install -q --no-index --no-deps --target /tmp/site build/wheels_rel/*.whl > "$OUT/pip_w.log" 2>&1; export PYTHONPATH=/tmp/site; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || tail -3 "$OUT/pip.log"
timeout 120 python3 -m pytest -q -p no:cacheprovider --timeout 100 -x tests/test_transformer_kernels.py \
  tests/test_elementwise.py tests/test_kernel_ops.py tests/test_plan_cache.py tests/test_ops.py tests/test_hazards.py \
  > "$OUT/tests1.log" 2>&1; echo "tests rc=$?"; tail -2 "$OUT/tests1.log"; t "tests"
timeout 60 python3 tools/eager_profile.py --device cuda --steps 60 > "$OUT/eager.log" 2>&1
echo "eager rc=$?"; head -48 "$OUT/eager.log"; t "eager"
timeout 80 python3 benchmarks/op_cost.py --rounds 3 --n 100 --json "$OUT/op_cost.json" > "$OUT/op_cost.log" 2>&1
echo "op_cost rc=$?"; grep -v "^# " "$OUT/op_cost.log" | tail -18; t "done"
