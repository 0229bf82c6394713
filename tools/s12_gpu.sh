#!/bin/bash
export DEVICEOPS_REQUIRE_GPU=${DEVICEOPS_REQUIRE_GPU:-1}  # a GPU test that would skip fails (tests/conftest.py)
# Twelfth-session GPU work (issue 13): the bulk-copy K/V ring of the split-KV decode kernel.
#   bulk:  tests/test_attention.py -k bulk_ring (the ring against the float64 reference)
#   var:   tools/attn_variants_gpu.py (VARS=..., ONLY=..., ALL=1, TAG=..., REPS=...)
#   attn:  tests/test_attention.py (whole file)
#   table: benchmarks/attention.py --decode-tables (REPS, TAG)
#   attnsan: compute-sanitizer memcheck / racecheck over benchmarks/attention.py --check
# Usage: OUT=out bash tools/s12_gpu.sh bulk var
OUT=${OUT:-/tmp/s12}
source "$(dirname "$0")/device_prologue.sh"
source "$(dirname "$0")/attn_gpu_steps.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; python3 --version
for step in "$@"; do case "$step" in
info)  # the peak bandwidth per SM the planner reads, and the decode plans it gives
    python3 - <<'PY'
from deviceops.kernels import _attention as attn
from deviceops.kernels._attention_cuda import _bw_per_sm, _device_info
cc, n_sm = _device_info(0)
bw = _bw_per_sm(0, n_sm)
print(f"cc {cc} SMs {n_sm} peak bandwidth {bw * n_sm / 1e12:.2f} TB/s, {bw / 1e9:.1f} GB/s per SM;"
      f" ring threshold {attn.BULK_MIN_BW_PER_SM / 1e9:.0f} GB/s per SM")
for hq, hkv, d, b, lk in [(32, 8, 128, b, lk) for b in (1, 8, 32) for lk in (1024, 4096, 32768)]:
    w, may = attn.splitkv_warps(b, hq, hkv, 1, lk, d, f32=False, n_sm=n_sm)
    _, _, ns = attn.plan_splitkv(b, hq, hkv, 1, lk, d, n_sm=n_sm, split=may, warps=w)
    print(f"  GQA B{b} Lk{lk}: (stages, warps, splits) =",
          attn.splitkv_bulk(b, hq, hkv, 1, lk, d, warps=w, n_split=ns, may_split=may, n_sm=n_sm,
                            bw_per_sm=bw))
PY
    t info ;;
bulk)
    timeout ${T_BULK:-300} python3 -m pytest -q -p no:cacheprovider --timeout 280 tests/test_attention.py \
        -k bulk_ring > "$OUT/test_bulk.log" 2>&1; echo "bulk tests rc=$?"; tail -3 "$OUT/test_bulk.log"; t bulk ;;
var|attn|table|attnsan) attn_gpu_step "$step" ;;
*) echo "unknown step $step" ;;
esac; done
