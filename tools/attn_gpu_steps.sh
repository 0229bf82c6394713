export DEVICEOPS_REQUIRE_GPU=${DEVICEOPS_REQUIRE_GPU:-1}  # a GPU test that would skip fails (tests/conftest.py)
# Sourced by the GPU-machine session scripts (tools/s11_gpu.sh, tools/s12_gpu.sh), after
# device_prologue.sh (OUT and the timer t): the attention steps they share.
#   var:     tools/attn_variants_gpu.py (VARS=..., ONLY=..., ALL=1, TAG=..., REPS=...)
#   attn:    tests/test_attention.py (whole file)
#   table:   benchmarks/attention.py --decode-tables (REPS, TAG; L2 flushed before every call)
#   attnsan: compute-sanitizer memcheck / racecheck over benchmarks/attention.py --check
attn_gpu_step() {
    case "$1" in
    var)
        timeout ${T_VAR:-300} python3 tools/attn_variants_gpu.py --reps ${REPS:-60} --only "${ONLY:-}" ${ALL:+--all} \
            ${VARS:+--variants "$VARS"} --json "$OUT/var_${TAG:-1}.json" > "$OUT/var_${TAG:-1}.log" 2>&1
        echo "var rc=$?"; grep -E "^[A-Z]" "$OUT/var_${TAG:-1}.log" | grep -v Warning; t var ;;
    attn)
        timeout ${T_ATTN:-300} python3 -m pytest -q -p no:cacheprovider --timeout 280 tests/test_attention.py \
            > "$OUT/test_attn.log" 2>&1; echo "test_attention rc=$?"; tail -3 "$OUT/test_attn.log"; t attn ;;
    table)
        (cd benchmarks && timeout ${T_TABLE:-300} python3 attention.py --decode-tables --reps ${REPS:-60} \
            --json "$OUT/decode_tables_${TAG:-1}.json" > "$OUT/decode_tables_${TAG:-1}.log" 2>&1)
        echo "table rc=$?"; grep -E "^(GQA|Smol|\|)" "$OUT/decode_tables_${TAG:-1}.log" | head -40; t table ;;
    attnsan)
        for tool in memcheck racecheck; do
            timeout 200 compute-sanitizer --tool $tool --error-exitcode 3 python3 benchmarks/attention.py --check \
                > "$OUT/attn_$tool.log" 2>&1; echo "attn $tool rc=$?"; grep -c " ok$" "$OUT/attn_$tool.log"; tail -2 "$OUT/attn_$tool.log"
        done; t attnsan ;;
    *) return 1 ;;
    esac
}
