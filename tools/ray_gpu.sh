#!/bin/bash
# Issue 30 on a machine with two GPUs (nvidia-h100-x2 / nvidia-h200-x2): Ray replicas through
# our HTTP front. Four device calls, back to back (a call carries 64 MiB at most; the machine
# keeps /tmp while warm):
#   call a (carry .w1):                 bash tools/ray_gpu.sh a    # SmolLM2 GGUF, first half
#   call b (carry .w2):                 bash tools/ray_gpu.sh b    # second half, joined
#   call c (carry .wr1):                bash tools/ray_gpu.sh c    # Ray wheel, first part
#   call d (carry .wr2 .whlray .whl):   OUT=dir bash tools/ray_gpu.sh d
# Call d joins the Ray wheel (ray-2.60.0-cp312, checked against .whlray/*.sha256), installs
# it with the wheels Ray needs that the image lacks (.whlray: jsonschema and its deps) and the
# project's (.whl: starlette, uvicorn, gguf, ...) into /tmp/site, runs tests/test_ray.py there
# (local Ray cluster, cpu replicas) and then benchmarks/ray_serve.py on the two GPUs.
# If call b, c or d finds a part missing, the machine went cold: start again at call a.
set -o pipefail
case "$1" in
a) mkdir -p /tmp/wts && cp .w1/part00 /tmp/wts/ && echo "model part00 copied"; exit 0 ;;
b) [ -f /tmp/wts/part00 ] || { echo "machine went cold: no part00 (call a again)"; exit 2; }
   cp .w2/part01 /tmp/wts/ && cat /tmp/wts/part00 /tmp/wts/part01 > /tmp/wts/model.gguf \
       && sha256sum /tmp/wts/model.gguf | cut -c1-16; exit $? ;;
c) mkdir -p /tmp/rayw && cp .wr1/ray.part00 /tmp/rayw/ && echo "ray part00 copied"; exit 0 ;;
d) ;;
*) echo "usage: $0 a|b|c|d [benchmarks/ray_serve.py arguments]"; exit 2 ;;
esac
shift  # the rest goes to benchmarks/ray_serve.py
OUT=${OUT:-/tmp/ray_gpu}
WHEEL=ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
[ -f /tmp/wts/model.gguf ] || { echo "machine went cold: no /tmp/wts/model.gguf (calls a, b)"; exit 2; }
[ -f /tmp/rayw/ray.part00 ] || { echo "machine went cold: no ray part00 (call c)"; exit 2; }
cat /tmp/rayw/ray.part00 .wr2/ray.part01 > "/tmp/rayw/$WHEEL"
(cd /tmp/rayw && sha256sum -c "$OLDPWD/.whlray/ray-2.60.0-cp312.sha256") || exit 2
mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl .whlray/*.whl "/tmp/rayw/$WHEEL" > "$OUT/pip_whl.log" 2>&1 \
    || { echo "wheel install failed"; tail -5 "$OUT/pip_whl.log"; exit 2; }
export PYTHONPATH=/tmp/site   # Ray's workers inherit it (they start from this environment)
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 \
    || { echo "pip install -e . failed"; tail -5 "$OUT/pip.log"; exit 2; }
python3 -c "import ray, packaging, msgpack, google.protobuf as pb; print('ray', ray.__version__, \
'packaging', packaging.__version__, 'msgpack', msgpack.version, 'protobuf', pb.__version__)"
nvidia-smi --query-gpu=index,name,driver_version,memory.used --format=csv,noheader
export RAY_USAGE_STATS_ENABLED=0
t "installed"
timeout ${T_TESTS:-180} python3 -m pytest -q -p no:cacheprovider tests/test_ray.py \
    > "$OUT/test_ray.log" 2>&1; echo "test_ray rc=$? $(tail -1 "$OUT/test_ray.log")"
t "tests done"
timeout ${T_BENCH:-420} python3 benchmarks/ray_serve.py --gguf /tmp/wts/model.gguf \
    --json "$OUT/ray_serve.json" "$@" > "$OUT/ray_serve.log" 2>&1
echo "ray_serve rc=$?"; tail -25 "$OUT/ray_serve.log"
t "done"
