#!/usr/bin/env bash
# One H200 run for the speculative verify kernel (issue 11), about 9 minutes: the
# speculative-decoding scenarios of the GPU tier with the fork's verify kernel forced on
# (VLLM_TRITON_SPEC_VERIFY_ATTN=1: lossless, DFlash2 under CUDA graphs with no JIT
# compile after boot) while the kernel's own tests run beside them, then the kernel
# against upstream's cache writers, then bench/specattn_verify.py over the cases given.
#   bash bench/specattn_gpu_run.sh OUT_DIR BUNDLE UPSTREAM_OPS "BENCH ARGS" ["BENCH ARGS" ...]
# BUNDLE: `python3 -m kiln gpu-bundle --out build/gpu-bundle`; UPSTREAM_OPS:
# `bench/specattn_verify.py --extract-upstream build/upstream-ops`. Each step has its own
# time limit; a failed step does not stop the later ones. Writes OUT_DIR/summary.txt and
# OUT_DIR/results.tar.gz (every log, junit and JSON). KILN_RUN_BUDGET_S (default 560)
# bounds the whole run, so it ends inside the device tool's 600 s.
set -u
OUT=${1:?usage: bash bench/specattn_gpu_run.sh OUT_DIR BUNDLE UPSTREAM_OPS "BENCH ARGS"...}
BUNDLE=$(cd "${2:?bundle folder}" && pwd)
OPS=$(cd "${3:?upstream ops folder}" && pwd)
shift 3
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
R=/tmp/kiln-specattn-results  # logs stay outside OUT_DIR, packed after every step
rm -rf "$R" && mkdir -p "$R"
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
T0=$(date +%s)
BUDGET_S=${KILN_RUN_BUDGET_S:-560}
note() {  # step name, rc, start time; then pack what there is
  echo "$1: rc $2, $(($(date +%s) - $3)) s" >> "$SUMMARY"
  tar -czf "$OUT/results.tar.gz" -C "$R" .
}
left() {  # seconds a step may take: its own limit, or what is left of the budget
  local rest=$((BUDGET_S - $(date +%s) + T0 - 10))
  echo $(($1 < rest ? $1 : (rest > 1 ? rest : 1)))
}

# 1. serving scenarios (the bundle's installed wheel) and, beside them, the kernel tests
#    (torch and triton only); the bundle's install prefix is kept for steps 2 and 3
export TMPDIR=/tmp/kiln-specattn-run
rm -rf "$TMPDIR"
mkdir -p "$TMPDIR"
S=$(date +%s)
VLLM_TRITON_SPEC_VERIFY_ATTN=1 KILN_KEEP_PREFIX=1 timeout "$(left 330)" bash "$BUNDLE/run" \
  "$R/serve" -k spec_decode > "$R/serve.log" 2>&1 &
SERVE=$!
timeout "$(left 300)" "$PY" -m pytest -q -p no:cacheprovider -n 4 -rfE \
  tests/kernels/test_specattn_verify.py > "$R/kernel_tests.log" 2>&1
note "kernel tests" $? "$S"
wait $SERVE
note "spec_decode scenarios, fork verify kernel on" $? "$S"
grep -E "passed|failed|error" "$R/kernel_tests.log" | tail -n 3 >> "$SUMMARY"
grep -E "^(PASSED|FAILED|ERROR)|verify attention by|tokens per step|passed|failed" \
  "$R/serve.log" | tail -n 30 >> "$SUMMARY"
PREFIX=$(ls -d "$TMPDIR"/kiln-gpu.* 2>/dev/null | head -n 1)
export PYTHONPATH="$PREFIX/site:$BUNDLE/src" VLLM_USE_FLASHINFER_SAMPLER=0
export TRITON_CACHE_DIR="$PREFIX/cache/triton" VLLM_CACHE_ROOT="$PREFIX/cache/vllm"

# 2. the kernel over caches written by upstream's own writers (needs the installed wheel)
S=$(date +%s)
timeout "$(left 120)" "$PY" -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_specattn_upstream.py \
  > "$R/upstream_tests.log" 2>&1
note "kernel vs upstream's writers" $? "$S"
grep -E "passed|failed|error" "$R/upstream_tests.log" | tail -n 3 >> "$SUMMARY"

# 3. the benchmark, one run per argument set
I=0
for ARGS in "$@"; do
  I=$((I + 1))
  S=$(date +%s)
  # shellcheck disable=SC2086  # each set is a list of arguments
  timeout "$(left 200)" "$PY" bench/specattn_verify.py --upstream-033 "$OPS/0.33.0" $ARGS \
    --json "$R/bench$I.json" > "$R/bench$I.log" 2>&1
  note "bench $I ($ARGS)" $? "$S"
  grep -A 60 "^kv cache dtype" "$R/bench$I.log" >> "$SUMMARY"
  grep -iE "illegal|error" "$R/bench$I.log" | head -n 5 >> "$SUMMARY"
done
echo "total: $(($(date +%s) - T0)) s" >> "$SUMMARY"
tar -czf "$OUT/results.tar.gz" -C "$R" .
rm -rf "$TMPDIR"
cat "$SUMMARY"
