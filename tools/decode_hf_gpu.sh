#!/bin/bash
# benchmarks/decode.py with transformers (eager generate, static cache + torch.compile) in the
# same run, on the real GGUF (two calls: a carries .w1, b carries .w2; see final_gpu.sh).
OUT=${OUT:-/tmp/dhf}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
case "$1" in
a) mkdir -p /tmp/wts && cp .w1/part00 /tmp/wts/ && t "part00 copied" ;;
b)
    [ -f /tmp/wts/part00 ] || { echo "machine went cold: no part00"; exit 2; }
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > "$OUT/pip_whl.log" 2>&1 \
        && export PYTHONPATH=/tmp/site
    python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1
    cp .w2/part01 /tmp/wts/ && cat /tmp/wts/part00 /tmp/wts/part01 > /tmp/wts/model.gguf
    timeout ${T_DEC:-480} python3 benchmarks/decode.py --gguf /tmp/wts/model.gguf \
        --compile-budget ${COMPILE_BUDGET:-200} --json "$OUT/decode_hf.json" 2>&1 \
        | grep -v "it/s\]" > "$OUT/decode_hf.log"; echo "decode rc=$?"; tail -30 "$OUT/decode_hf.log"; t done ;;
esac
