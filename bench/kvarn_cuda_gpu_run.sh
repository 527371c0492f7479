#!/usr/bin/env bash
# One H200 run for the CUDA KVarN decode kernel (issue 12, the CUDA route), about 6 minutes
# (9.5 if every step ran to its limit): compile csrc/kvarn/kvarn_decode.cu for sm_90 with ptxas -v
# (nothing prebuilt is needed: build outputs are git-ignored), the kernel's tests,
# compute-sanitizer memcheck/racecheck on two small launches, the decode table with
# "cuda" beside the Triton kernels, fp16 Triton, SDPA and the roofline, then ncu on one
# 64 x 16K launch at D=128 and one at D=256. Each step has its own time limit; a failed
# step does not stop the later ones (the bench and ncu rows say when the library is
# missing).
#   bash bench/kvarn_cuda_gpu_run.sh OUT_DIR [all | correctness | timing]
# correctness is steps 1-2b, timing steps 3-4 (after correctness, into the same OUT_DIR),
# so other GPU work can run beside the first and not beside the second.
# Writes OUT_DIR/summary.txt, build.log, tests.log, sanitizer.txt, bench_cuda.json,
# bench_cuda.txt, ncu.txt. KILN_NCU_HEAD_DIMS picks the ncu launches (default "128 256").
set -u
OUT=${1:?usage: bash bench/kvarn_cuda_gpu_run.sh OUT_DIR [all | correctness | timing]}
PHASE=${2:-all}
case "$PHASE" in all | correctness | timing) ;; *)
  echo "phase $PHASE: allowed: all, correctness, timing" >&2; exit 2 ;;
esac
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LIB_DIR=$PWD/build/kvarn_cuda
export KVARN_CUDA_LIB=$LIB_DIR/libkvarn_decode.so
SUMMARY=$OUT/summary.txt
[ "$PHASE" = timing ] || : > "$SUMMARY"
T0=$(date +%s)

note() {  # step name, rc, start time
  echo "$1: rc $2, $(($(date +%s) - $3)) s" >> "$SUMMARY"
}

if [ "$PHASE" != timing ]; then
# 1. build (sm_90 only here; tests/kernels/test_kvarn_decode_cuda.py compiles all four
#    archs on the CPU box)
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

# 2. the kernel's tests in two time-limited parts, the layout self-test and the D=128
#    sweep, verify rows and graphs first, then D=64/256 and the Triton comparison (its
#    JIT compiles are slow); the all-arch compile check is the CPU box's
: > "$OUT/tests.log"
for PART in core rest; do
  if [ $PART = core ]; then
    LIMIT=100
    SEL="not compiles_every_arch and not agrees_with_triton and not (decode_matches_reference and not D128)"
  else
    LIMIT=70
    SEL="agrees_with_triton or (decode_matches_reference and not D128)"
  fi
  S=$(date +%s)
  echo "===== tests $PART: -k '$SEL'" >> "$OUT/tests.log"
  timeout $LIMIT "$PY" -m pytest -q -p no:cacheprovider --maxfail=5 -rfE --durations=8 \
    tests/kernels/test_kvarn_decode_cuda.py -k "$SEL" >> "$OUT/tests.log" 2>&1
  note "tests $PART" $? "$S"
done
grep -E "^(FAILED|ERROR|=====)|passed|failed|skipped|error" "$OUT/tests.log" | tail -n 25 >> "$SUMMARY"

# 2b. compute-sanitizer memcheck and racecheck on two small launches (D=128 with splits,
#     D=256 with 16 verify rows: the split-channel warps): out-of-bounds accesses and
#     shared-memory races show up here even where the numbers happen to look right
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
: > "$OUT/sanitizer.txt"
for TOOL in memcheck racecheck; do
  S=$(date +%s)
  timeout 40 "$SAN" --tool "$TOOL" --error-exitcode 3 "$PY" - >> "$OUT/sanitizer.txt" 2>&1 <<'EOF'
import sys
sys.path[:0] = [".", "tests/kernels"]
import torch
from kvarn import Preset, decode_cuda
from kvarn_cases import make_state
for name, d, gqa, nq, splits in (("kvarn_k4v2_g128", 128, 4, 1, 2), ("kvarn_k4v4_g64", 256, 8, 2, 1)):
    st = make_state(Preset.parse(name), d, 2, [300, 129], nq, seed=1, device="cuda")
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
[ "$PHASE" = correctness ] && { echo "correctness: $(($(date +%s) - T0)) s" >> "$SUMMARY"; exit 0; }

# 3. the decode table: cuda, prefetch, pipelined, fp16 Triton, SDPA, roofline
S=$(date +%s)
timeout 90 "$PY" bench/kvarn_decode.py --no-tune --presets kvarn_k4v2_g128 kvarn_k4v4_g128 \
  --head-dims 128 256 --gqa 4 --shapes 64x16384 1x32768 1x4096 --repeats 3 --budget-s 60 \
  --json "$OUT/bench_cuda.json" > "$OUT/bench_cuda.txt" 2>&1
RC=$?
note bench $RC "$S"
grep -A 40 "^preset " "$OUT/bench_cuda.txt" >> "$SUMMARY"

# 4. ncu on the second of two launches at 64 x 16K, 8 KV heads, GQA 4, k4v2_g128
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
: > "$OUT/ncu.txt"
for D in ${KILN_NCU_HEAD_DIMS:-128 256}; do
  S=$(date +%s)
  timeout 35 "$NCU" --clock-control none --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section MemoryWorkloadAnalysis -k regex:kvarn_decode \
    --launch-skip 1 --launch-count 1 "$PY" - "$D" >> "$OUT/ncu.txt" 2>&1 <<'EOF'
import sys
sys.path[:0] = [".", "bench"]
import torch
from kvarn import Preset, decode_cuda
from kvarn_decode import HEADS, kvarn_state
D = int(sys.argv[1])
kv, bt, st, seq, nf, read = kvarn_state(Preset.parse("kvarn_k4v2_g128"), 64, 16384, D, "cuda")
q = torch.randn(64, 1, HEADS * 4, D, device="cuda", dtype=torch.float16)
for _ in range(2):
    decode_cuda.attend_rotated_cuda(q, kv, bt, st, seq, nf)
torch.cuda.synchronize()
print(f"D={D}: bytes the kernel must read {read}, roofline at 4.8 TB/s {read / 4.8e9:.4f} ms")
EOF
  note "ncu D=$D" $? "$S"
done
grep -E "D=[0-9]+: bytes|Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Dynamic Shared|Block Limit" \
  "$OUT/ncu.txt" >> "$SUMMARY"
echo "total: $(($(date +%s) - T0)) s" >> "$SUMMARY"
cat "$SUMMARY"
