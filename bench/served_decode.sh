#!/usr/bin/env bash
# The served decode table as a user sees it: each cache dtype served alone on the GPU by
# the fork (from the offline bundle, `python3 -m kiln gpu-bundle --out BUNDLE`), prefix
# caching on as upstream defaults, decode timed after fresh prefills (tests/gpu/scenarios.py
# speed): ms per step, tokens/s, the step against bf16's, KV bytes per step and the
# fraction of the card's HBM roofline.
#   bash bench/served_decode.sh BUNDLE RESULTS_DIR
# Shapes, caches and models come from the environment (tests/gpu/specs.py checks them):
#   KILN_GPU_SPEED_SHAPES  "BxC ..." (default below: the dense model's 64x16K, 8x64K, 1x128K)
#   KILN_GPU_SPEED_DTYPES  default: auto fp8 int8_per_token_head int4_per_token_head and the
#                          four kvarn_* presets
#   KILN_GPU_SPEED_MODELS  large (dense, head dim 128) and/or hybrid27 (the 27B's layer
#                          shapes, head dim 256); default: large
#   KILN_GPU_SPEED_PROFILE decode steps to profile at the largest shape (default 0)
# Writes RESULTS_DIR/speed-table.json (one row per model, cache and shape) and prints the
# table; the GPU tier's other tests do not run.
set -euo pipefail
bundle=${1:?usage: bash bench/served_decode.sh BUNDLE RESULTS_DIR}
results=${2:?usage: bash bench/served_decode.sh BUNDLE RESULTS_DIR}
export KILN_GPU_SPEED_SHAPES=${KILN_GPU_SPEED_SHAPES:-"64x16384 8x65536 1x131072"}
export KILN_GPU_SPEED_DTYPES=${KILN_GPU_SPEED_DTYPES:-"auto fp8 int8_per_token_head int4_per_token_head kvarn_k4v2_g128 kvarn_k4v4_g128 kvarn_k4v2_g64 kvarn_k4v4_g64"}
exec bash "$bundle/run" "$results" -k decode_speed -s
