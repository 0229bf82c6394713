#!/bin/bash
export DEVICEOPS_REQUIRE_GPU=${DEVICEOPS_REQUIRE_GPU:-1}  # a GPU test that would skip fails (tests/conftest.py)
# One device run for the transformer kernels: install, GPU tests, norms benchmark, sanitizers.
# Usage (GPU machine, repo root): OUT=/some/dir bash tools/transformer_device.sh
set -o pipefail
OUT=${OUT:-/tmp/deviceops_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || { echo "pip install failed"; tail -5 "$OUT/pip.log"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
python3 -c "import deviceops.kernels" || { echo "deviceops.kernels does not import"; exit 3; }
t0=$(date +%s)
# compile once (the CuPy disk cache serves the later processes)
python3 -c "
import time; t=time.time()
from deviceops.kernels._norms import tk_function, _names
for n in _names(): tk_function(0, n)
print(f'compiled transformer.cu ({len(_names())} kernels) in {time.time()-t:.1f} s')"
echo "=== pytest (gpu)"
timeout ${T_TEST:-110} python3 -m pytest -q -p no:cacheprovider tests/test_transformer_kernels.py \
    tests/test_kernel_ops.py -k "transformer or row_op or rms" 2>&1 | tail -40 | tee "$OUT/pytest.log"
echo "=== norms benchmark ($(( $(date +%s) - t0 )) s in)"
timeout ${T_BENCH:-60} python3 benchmarks/norms.py --json "$OUT/norms.json" 2>&1 | tail -60 | tee "$OUT/norms.log"
for tool in memcheck racecheck; do
    echo "=== compute-sanitizer $tool ($(( $(date +%s) - t0 )) s in)"
    timeout ${T_SAN:-40} compute-sanitizer --tool $tool --print-limit 20 python3 tests/gpu_sanitize_transformer.py \
        > "$OUT/sanitize_$tool.log" 2>&1; echo "rc=$?"; tail -8 "$OUT/sanitize_$tool.log"
done
echo "=== done ($(( $(date +%s) - t0 )) s)"
