#!/usr/bin/env bash
# The fork's GPU test tier (tests/gpu) from an offline bundle made by
# `python3 -m kiln gpu-bundle`:   DIR/run RESULTS_DIR [extra pytest args]
# Needs an NVIDIA GPU of an arch the bundle was built for, Python 3.12 with a CUDA
# build of torch >= 2.11 (python3, or $KILN_PYTHON), and no network. Installs into a
# temporary prefix only, removed at exit unless KILN_KEEP_PREFIX=1. Writes junit.xml,
# pytest.log and summary.json (and what the tests write) into RESULTS_DIR, which must
# be new or empty, and exits with pytest's status (3: the machine was refused).
set -uo pipefail

if [ "$#" -lt 1 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  sed -n '2,8s/^# //p' "${BASH_SOURCE[0]}" >&2
  exit 2
fi
bundle=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
results=$(realpath -m "$1")
shift
python=${KILN_PYTHON:-python3}
say() { printf 'kiln gpu bundle: %s\n' "$*" >&2; }

if ! command -v "$python" >/dev/null; then
  say "refused: no $python on PATH (set KILN_PYTHON to a Python 3.12 with CUDA torch)"
  exit 3
fi
if [ -e "$results" ] && [ -n "$(ls -A "$results")" ]; then
  say "refused: $results is not empty; give a new or empty results folder"
  exit 2
fi

prefix=$(mktemp -d "${TMPDIR:-/tmp}/kiln-gpu.XXXXXX")
cleanup() {
  if [ "${KILN_KEEP_PREFIX:-0}" = 1 ]; then say "kept $prefix"; else rm -rf "$prefix"; fi
}
trap cleanup EXIT
# Bytecode goes under the prefix: the bundle's own files stay as the manifest lists them.
export PYTHONPYCACHEPREFIX="$prefix/pycache"
gpurun() { PYTHONPATH="$bundle/src" "$python" -m kiln.testing.gpurun "$@"; }

gpurun check "$bundle" "$prefix/machine.json" || exit $?
say "installing into $prefix"
gpurun install "$bundle" "$prefix/site" || exit $?
mkdir -p "$results"

export PYTHONPATH="$prefix/site:$bundle/src" PATH="$prefix/site/bin:$PATH"
# No FlashInfer here; the hub is out of reach; every cache lives and dies with the prefix.
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_CACHE_ROOT="$prefix/cache/vllm" TRITON_CACHE_DIR="$prefix/cache/triton"
export KILN_CACHE="$prefix/cache/kiln" HF_HOME="$prefix/cache/huggingface"
export TORCHINDUCTOR_CACHE_DIR="$prefix/cache/inductor"
# The FlashInfer stand-in holds only its Gemma norm. vLLM's has_flashinfer() is True
# wherever flashinfer imports and nvcc and ninja are found, as on the lent machines, and
# then every FlashInfer path runs (the kernel warm-up's autotuner first); a CUDA_HOME
# without nvcc keeps it False. Nothing the tier runs compiles CUDA.
export CUDA_HOME="$prefix/no-cuda-toolkit"
export KILN_GPU_RESULTS="$results"

cd "$bundle/src"
start=$(date +%s.%N)
# pytest runs in the background so a TERM or INT sent to this script (a time limit)
# reaches it: the session then ends its scenario engines instead of leaving them on the GPU.
"$python" -m pytest -p no:cacheprovider -rA "$bundle/src/tests/gpu" \
  --junitxml "$results/junit.xml" "$@" > >(tee "$results/pytest.log") 2>&1 &
pytest_pid=$!
trap 'kill -TERM "$pytest_pid" 2>/dev/null' TERM INT
wait "$pytest_pid"
status=$?
while kill -0 "$pytest_pid" 2>/dev/null; do  # a trapped signal cut the wait short
  wait "$pytest_pid"
  status=$?
done
gpurun summary "$bundle" "$prefix/machine.json" "$results" "$status" "$start"
exit "$status"
