#!/bin/bash
# compute-sanitizer sweep (memcheck, racecheck, synccheck, initcheck) over every kernel, on
# the GPU machine: a warm-up of the kernel cache, then the four tools in parallel.
OUT=${OUT:-/tmp/san}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1
timeout 100 python3 tools/sanitize_all.py --worker > "$OUT/warm.log" 2>&1
echo "warm-up: $(grep -c ' OK$' "$OUT/warm.log") ok, $(grep -c MISMATCH "$OUT/warm.log") mismatch"
grep -E "MISMATCH|NO CASE|Error" "$OUT/warm.log" | head -5; t "warm"
for tool in memcheck racecheck synccheck initcheck; do
  timeout 200 python3 tools/sanitize_all.py --tools $tool --timeout 190 --json "$OUT/san_$tool.json" \
    > "$OUT/san_$tool.log" 2>&1 &
done
wait
for tool in memcheck racecheck synccheck initcheck; do head -1 "$OUT/san_$tool.log"; done
grep -h "rope_kv_write\|flash_attention" "$OUT"/san_memcheck.log | head -3
t "done"
