#!/bin/bash
# One device call: the 1M-op soak and the racecheck sweep (issue 16), and a profile of an
# eager decode step with SmolLM2-shaped random weights (issues 12/14).
OUT=${OUT:-/tmp/c1}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
python3 -c "import trio" 2>/dev/null || { python3 -m pip install -q --no-index --no-deps --target /tmp/site build/wheels_rel/*.whl > "$OUT/pip_w.log" 2>&1; export PYTHONPATH=/tmp/site; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || tail -3 "$OUT/pip.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t "racecheck (background) + soak 1M"
timeout 150 python3 tools/sanitize_all.py --tools racecheck --timeout 140 --json "$OUT/san_racecheck.json" > "$OUT/san_racecheck.log" 2>&1 &
timeout 150 python3 benchmarks/soak.py --ops 1000000 --json "$OUT/soak.json" > "$OUT/soak.log" 2>&1
echo "soak rc=$?"; tail -12 "$OUT/soak.log"
t "soak done"
wait; echo "racecheck:"; head -40 "$OUT/san_racecheck.log"; t "racecheck done"
timeout 120 python3 tools/eager_profile.py --device cuda --steps 40 > "$OUT/eager_prof.log" 2>&1; echo "prof rc=$?"
head -130 "$OUT/eager_prof.log"
t "done"
