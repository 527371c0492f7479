#!/usr/bin/env bash
# One H200 run for the CUDA KVarN decode kernel (issue 12, the CUDA route), in steps:
#   build      compile csrc/kvarn/kvarn_decode.cu for sm_90 with ptxas -v (build outputs
#              are git-ignored, so nothing prebuilt is needed)
#   tests      the kernel's tests less the all-arch compile (the CPU box's): the CUDA-only
#              ones in one process (4 and 8 xdist workers sharing the GPU finished 22-29
#              of 78 in 200-240 s, each test's reference encode slowed by the others),
#              beside them the Triton agreement ones, whose compiles take minutes
#   triton     every other kernel test (the Triton kernels at every preset and D up to
#              512, flush, plan, side pool, specattn) in four shards, in the background
#              from the start, so its compiles overlap the steps above
#   sanitizer  compute-sanitizer memcheck and racecheck on small launches
#   sweep      the kernel over split counts (bench/kvarn_decode.py --cuda-sweep), D=128
#              and 256, k4v2_g128
#   table      the decode table: every preset at D=128 and 256 with "cuda" beside the
#              Triton kernels, fp16 Triton, SDPA, upstream's FA3 (when $KILN_FA3, default
#              build/fa3/0.33.0, holds `bench/kvarn_decode.py --extract-fa3 build/fa3`'s
#              output: carry build/fa3), the plain torch path and the roofline;
#              then D=512 (Triton only: the CUDA kernel has no D=512 instance)
#   ncu        Nsight Compute on chosen launches (KILN_NCU_LAUNCHES, "D:BxL" items,
#              default "128:64x16384 256:64x16384 128:1x32768"), kernel and combine
#   bash bench/kvarn_cuda_gpu_run.sh OUT_DIR [STEP ... | all | correctness | timing]
# correctness = build tests triton sanitizer, timing = sweep table ncu (after correctness, into
# the same OUT_DIR), so other GPU work can run beside the first and not the second.
# Each step has its own time limit; a failed step does not stop the later ones.
# Writes OUT_DIR/summary.txt, build.log, tests.log, tests_triton.log, triton_shards.log,
# sanitizer.txt, sweep.json, sweep.txt, bench_cuda.json, bench_cuda.txt, bench_d512.json, ncu.txt.
set -u
OUT=${1:?usage: bash bench/kvarn_cuda_gpu_run.sh OUT_DIR [STEP ... | all | correctness | timing]}
shift
STEPS=()
for arg in "${@:-all}"; do
  case "$arg" in
    all) STEPS+=(build tests triton sanitizer sweep table ncu) ;;
    correctness) STEPS+=(build tests triton sanitizer) ;;
    timing) STEPS+=(sweep table ncu) ;;
    build | tests | triton | sanitizer | sweep | table | ncu) STEPS+=("$arg") ;;
    *) echo "step $arg: allowed: build tests triton sanitizer sweep table ncu, all, correctness," \
         "timing" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# logs written as they happen, so a step cut at its time limit still shows how far it got
export PYTHONUNBUFFERED=1
LIB_DIR=$PWD/build/kvarn_cuda
export KVARN_CUDA_LIB=$LIB_DIR/libkvarn_decode.so
SUMMARY=$OUT/summary.txt
touch "$SUMMARY"
T0=$(date +%s)

note() {  # step name, rc, start time
  echo "$1: rc $2, $(($(date +%s) - $3)) s" >> "$SUMMARY"
}
wants() { [[ " ${STEPS[*]} " == *" $1 "* ]]; }

SHARD_PIDS=()
if wants triton; then
  TS=$(date +%s)
  DECODE=tests/kernels/test_kvarn_decode.py
  shard() {  # name, pytest arguments...
    local name=$1
    shift
    timeout 420 "$PY" -m pytest -q -p no:cacheprovider -rfE --tb=short --timeout 300 "$@" \
      > "$OUT/shard.$name.log" 2>&1
    echo "== shard $name: rc $?" >> "$OUT/shard.$name.log"
  }
  shard every_dim "$DECODE" -k every_preset & SHARD_PIDS+=($!)
  shard sweep "$DECODE" -k test_decode_sweep & SHARD_PIDS+=($!)
  shard rest "$DECODE" -k "not every_preset and not test_decode_sweep" & SHARD_PIDS+=($!)
  shard other tests/kernels --ignore="$DECODE" --ignore=tests/kernels/test_kvarn_decode_cuda.py \
    --ignore=tests/kernels/test_bench_kvarn_decode.py & SHARD_PIDS+=($!)
fi

if wants build; then
  S=$(date +%s)
  timeout 90 "$PY" -c "
import sys
sys.path.insert(0, '.')
from kvarn.decode_cuda import build_library
print(build_library('$LIB_DIR', archs=('90',), ptxas_verbose=True))
" > "$OUT/build.log" 2>&1
  RC=$?
  cat "$LIB_DIR/build.log" >> "$OUT/build.log" 2>/dev/null
  note build $RC "$S"
  # registers and spills per template instance, one line each
  grep -E "Compiling entry|registers|spill" "$OUT/build.log" | paste - - - | sed -E \
    -e 's/.*(kernelILi([0-9]+)ELi([0-9]+)ELi([0-9]+)ELi([0-9]+)|combine_kernel|selftest_kernel)[^ ]* for .(sm_[0-9]+).\s+/\1 \6 /' \
    -e 's/kernelILi([0-9]+)ELi([0-9]+)ELi([0-9]+)ELi([0-9]+)/D=\1 G=\2 VB=\3 NT=\4/' \
    -e 's/ptxas info\s+: //' >> "$SUMMARY"
fi

if wants tests; then
  S=$(date +%s)
  timeout 300 "$PY" -m pytest -q -p no:cacheprovider -rfE --timeout 200 \
    tests/kernels/test_kvarn_decode_cuda.py -k agrees_with_triton > "$OUT/tests_triton.log" 2>&1 &
  TRITON_PID=$!
  timeout 300 "$PY" -m pytest -v -p no:cacheprovider -rfE --durations=8 --timeout 120 \
    tests/kernels/test_kvarn_decode_cuda.py -k "not compiles_every_arch and not agrees_with_triton" \
    > "$OUT/tests.log" 2>&1
  note "tests cuda" $? "$S"
  wait $TRITON_PID
  note "tests agrees_with_triton" $? "$S"
  grep -hE "^(FAILED|ERROR)|passed|failed|skipped|error" "$OUT/tests.log" "$OUT/tests_triton.log" \
    | tail -n 25 >> "$SUMMARY"
fi

if wants sanitizer; then
  # D=128 with splits (part 0 the side pool, a combine), D=256 with 16 verify rows (the
  # split-channel warps), and 200 splits (a combine with more parts than threads): bad
  # accesses and shared-memory races show up here even where the numbers look right
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  : > "$OUT/sanitizer.txt"
  for TOOL in memcheck racecheck; do
    S=$(date +%s)
    timeout 60 "$SAN" --tool "$TOOL" --error-exitcode 3 "$PY" - >> "$OUT/sanitizer.txt" 2>&1 <<'EOF'
import sys
sys.path[:0] = [".", "tests/kernels"]
import torch
from kvarn import Preset, decode_cuda
from kvarn_cases import make_state
for name, d, gqa, nq, splits, lens in (
        ("kvarn_k4v2_g128", 128, 4, 1, 2, [300, 129]),
        ("kvarn_k4v4_g64", 256, 8, 2, 1, [300, 129]),
        ("kvarn_k4v2_g64", 128, 4, 1, 200, [4000, 129])):
    st = make_state(Preset.parse(name), d, 2, lens, nq, seed=1, device="cuda")
    q = torch.randn(2, nq, 2 * gqa, d, device="cuda")
    decode_cuda.attend_rotated_cuda(q, st.kv, st.block_table, st.side_table, st.seq_lens,
                                    st.num_flushed, num_splits=splits)
torch.cuda.synchronize()
print("sanitized launches done")
EOF
    note "sanitizer $TOOL" $? "$S"
  done
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Invalid|hazard" "$OUT/sanitizer.txt" | sort | uniq -c \
    | head -20 >> "$SUMMARY"
fi

if wants sweep; then
  S=$(date +%s)
  timeout 170 "$PY" bench/kvarn_decode.py --no-tune --cuda-sweep --no-table \
    --presets kvarn_k4v2_g128 --head-dims 128 256 --repeats 3 --budget-s 150 \
    --json "$OUT/sweep.json" > "$OUT/sweep.txt" 2>&1
  note sweep $? "$S"
  grep -E "^cuda sweep|truncated" "$OUT/sweep.txt" >> "$SUMMARY"
fi

if wants table; then
  FA3=${KILN_FA3:-build/fa3/0.33.0}
  FA3_ARGS=()
  if [ -d "$FA3" ]; then FA3_ARGS=(--fa3 "$FA3"); fi
  S=$(date +%s)
  timeout 200 "$PY" bench/kvarn_decode.py --no-tune --head-dims 128 256 --gqa 4 \
    --shapes 64x16384 256x8192 1x32768 1x4096 --repeats 3 --budget-s 170 "${FA3_ARGS[@]}" \
    --json "$OUT/bench_cuda.json" > "$OUT/bench_cuda.txt" 2>&1
  note table $? "$S"
  grep -A 42 "^preset " "$OUT/bench_cuda.txt" >> "$SUMMARY"
  S=$(date +%s)
  timeout 80 "$PY" bench/kvarn_decode.py --no-tune --presets kvarn_k4v2_g128 --head-dims 512 \
    --gqa 4 --shapes 64x16384 1x32768 --repeats 3 --budget-s 60 \
    --json "$OUT/bench_d512.json" > "$OUT/bench_d512.txt" 2>&1
  note "table D=512" $? "$S"
  grep -A 5 "^preset " "$OUT/bench_d512.txt" >> "$SUMMARY"
fi

if wants ncu; then
  # the second call's two launches (kernel, combine) of three at each shape, k4v2_g128,
  # 8 KV heads, GQA 4, at the default splits
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  : > "$OUT/ncu.txt"
  for LAUNCH in ${KILN_NCU_LAUNCHES:-128:64x16384 256:64x16384 128:1x32768}; do
    S=$(date +%s)
    timeout 60 "$NCU" --clock-control none --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
      --section SchedulerStats --section WarpStateStats --section InstructionStats \
      -k regex:kvarn_ --launch-skip 2 --launch-count 2 "$PY" - "$LAUNCH" >> "$OUT/ncu.txt" 2>&1 <<'EOF'
import sys
sys.path[:0] = [".", "bench"]
import torch
from kvarn import Preset, decode_cuda
from kvarn_decode import HEADS, kvarn_state
D, shape = sys.argv[1].split(":")
D, (B, L) = int(D), (int(x) for x in shape.split("x"))
kv, bt, st, seq, nf, read = kvarn_state(Preset.parse("kvarn_k4v2_g128"), B, L, D, "cuda")
q = torch.randn(B, 1, HEADS * 4, D, device="cuda", dtype=torch.float16)
for _ in range(3):
    decode_cuda.attend_rotated_cuda(q, kv, bt, st, seq, nf)
torch.cuda.synchronize()
splits = decode_cuda.default_splits(B, HEADS, bt.shape[1])
print(f"launch D={D} {B}x{L}: splits {splits}, bytes the kernel must read {read}, "
      f"roofline at 4.8 TB/s {read / 4.8e9:.4f} ms")
EOF
    note "ncu $LAUNCH" $? "$S"
  done
  grep -E "^launch D=|kvarn_[a-z]+_kernel|Duration|DRAM Throughput|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Dynamic Shared|Block Limit Reg|Issue Slots Busy|No Eligible|Active Warps Per Scheduler|Eligible Warps Per Scheduler|Warp Cycles Per Issued|Executed Instructions  |L2 Hit Rate" \
    "$OUT/ncu.txt" >> "$SUMMARY"
fi
if [ "${#SHARD_PIDS[@]}" -gt 0 ]; then
  wait "${SHARD_PIDS[@]}"
  cat "$OUT"/shard.*.log > "$OUT/triton_shards.log" && rm -f "$OUT"/shard.*.log
  note triton 0 "$TS"
  grep -E "^== shard|^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT/triton_shards.log" \
    | tail -n 30 >> "$SUMMARY"
fi
echo "total: $(($(date +%s) - T0)) s" >> "$SUMMARY"
cat "$SUMMARY"
