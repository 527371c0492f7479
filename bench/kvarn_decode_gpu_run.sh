#!/usr/bin/env bash
# One GPU run for the KVarN Triton decode kernel (issue 12), under 7 minutes on one H200:
# the kernel tests at full shapes in four parallel shards (JIT compiles dominate) while
# the kernel's sweep grid compiles in the background (its binaries do not depend on
# shapes), then bench/kvarn_decode.py alone on the GPU (sweep at 64x16K and 1x32K, then
# the table with the best configurations, cut at --budget-s).
#   bash bench/kvarn_decode_gpu_run.sh OUT_DIR
# Writes OUT_DIR/summary.json, tests.log, prewarm.log, kvarn_decode.json, kvarn_decode.txt.
set -u
OUT=${1:?usage: bash bench/kvarn_decode_gpu_run.sh OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
T0=$(date +%s)

shard() {  # name, pytest arguments...
  local name=$1
  shift
  timeout 170 "$PY" -m pytest -q -p no:cacheprovider "$@" > "$OUT/tests.$name.log" 2>&1
  echo $? > "$OUT/tests.$name.rc"
}
DECODE=tests/kernels/test_kvarn_decode.py
SHARDS=(every_dim sweep rest other_kernels)
timeout 170 "$PY" bench/kvarn_decode.py --prewarm-only --workers 8 > "$OUT/prewarm.log" 2>&1 &
PREWARM=$!
shard every_dim "$DECODE" -k "every_preset" &
shard sweep "$DECODE" -k "test_decode_sweep" &
shard rest "$DECODE" -k "not test_decode_sweep and not every_preset" &
shard other_kernels tests/kernels --ignore="$DECODE" \
  --ignore=tests/kernels/test_bench_kvarn_decode.py &
wait "$PREWARM"
PREWARM_RC=$?
wait
T1=$(date +%s)

timeout 240 "$PY" bench/kvarn_decode.py --json "$OUT/kvarn_decode.json" --budget-s 190 \
  > "$OUT/kvarn_decode.txt" 2>&1
BENCH_RC=$?
T2=$(date +%s)

: > "$OUT/tests.log"
{
  printf '{"tests_seconds": %d, "bench_seconds": %d, "prewarm_rc": %d, "bench_rc": %d, "shards": {' \
    $((T1 - T0)) $((T2 - T1)) "$PREWARM_RC" "$BENCH_RC"
  sep=""
  for name in "${SHARDS[@]}"; do
    rc=$(cat "$OUT/tests.$name.rc" 2>/dev/null || echo 255)
    line=$(grep -E '[0-9]+ (passed|failed|error)' "$OUT/tests.$name.log" | tail -n 1 | tr -d '"=\\')
    printf '%s"%s": {"rc": %s, "summary": "%s"}' "$sep" "$name" "$rc" "$line"
    sep=", "
    { echo "===== $name (rc $rc)"; cat "$OUT/tests.$name.log"; } >> "$OUT/tests.log"
    rm -f "$OUT/tests.$name.log" "$OUT/tests.$name.rc"
  done
  printf '}}\n'
} > "$OUT/summary.json"
cat "$OUT/summary.json"
tail -n 45 "$OUT/kvarn_decode.txt"
