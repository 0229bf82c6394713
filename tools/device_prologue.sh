export DEVICEOPS_REQUIRE_GPU=${DEVICEOPS_REQUIRE_GPU:-1}  # a GPU test that would skip fails (tests/conftest.py)
# Sourced by the GPU-machine scripts (tools/s6_*.sh): the output folder, a timer, the carried
# wheels (trio, pytest-timeout, ...) into /tmp/site, and this checkout installed editable.
OUT=${OUT:-/tmp/deviceops_out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
if ls .whl/*.whl >/dev/null 2>&1 || ls build/wheels_rel/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site $(ls .whl/*.whl build/wheels_rel/*.whl 2>/dev/null) > "$OUT/pip_whl.log" 2>&1 \
        && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || tail -5 "$OUT/pip.log"
