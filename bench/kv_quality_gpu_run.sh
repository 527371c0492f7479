#!/usr/bin/env bash
# KVarN and upstream's quantized KV caches against bf16 on trained models, one GPU:
# train the d128 and d256 reference models (`kiln trained-model`, minutes each), then
# bench/kv_quality.py on each with every default cache dtype.
#   bash bench/kv_quality_gpu_run.sh OUT_DIR
# $PYTHON (default python3) must import torch with CUDA, transformers, tokenizers and
# the fork's vllm (the GPU bundle's install prefix on PYTHONPATH). Writes OUT_DIR/
# train-SIZE.log, quality-SIZE.json, quality-SIZE.txt (table) and quality-SIZE.log.
set -u
OUT=${1:?usage: bash bench/kv_quality_gpu_run.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
status=0
for size in d128 d256; do
  "$PY" -m kiln trained-model --size "$size" > "$OUT/train-$size.log" 2>&1 || { status=1; continue; }
  model=$(tail -n 1 "$OUT/train-$size.log")
  "$PY" bench/kv_quality.py "$model" --json "$OUT/quality-$size.json" \
    > "$OUT/quality-$size.txt" 2> "$OUT/quality-$size.log" || status=1
done
exit "$status"
