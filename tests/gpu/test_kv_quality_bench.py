"""bench/kv_quality.py on the GPU, from the bundle's environment: trains each reference
model (`kiln trained-model --device cuda`, minutes) and compares every cache dtype with
bf16 on it. Writes quality-SIZE.json, .txt and the logs into $KILN_GPU_RESULTS. A
benchmark: it asserts that every dtype ran on the same windows, never a quality target
(RELEASE-NOTES and the ledger carry the figures). $KILN_KV_QUALITY_SIZES picks the
models (default "d128 d256"), $KILN_KV_QUALITY_ARGS adds bench arguments.

    bash build/gpu-bundle/run $OUT/r -k kv_quality
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SIZES = os.environ.get("KILN_KV_QUALITY_SIZES", "d128 d256").split()
TIMEOUT_S = int(os.environ.get("KILN_KV_QUALITY_TIMEOUT", "900"))


@pytest.mark.parametrize("size", SIZES)
def test_kv_quality_bench(tmp_path, size):
    out = Path(os.environ.get("KILN_GPU_RESULTS") or tmp_path)
    with open(out / f"train-{size}.log", "w") as log:
        train = subprocess.run([sys.executable, "-m", "kiln", "trained-model", "--size", size,
                                "--device", "cuda"], stdout=subprocess.PIPE, stderr=log,
                               text=True, timeout=TIMEOUT_S, cwd=ROOT)
    with open(out / f"train-{size}.log", "a") as log:
        log.write(train.stdout)
    assert train.returncode == 0, (out / f"train-{size}.log").read_text()[-4000:]
    model = train.stdout.strip().splitlines()[-1]
    result_path = out / f"quality-{size}.json"
    args = [sys.executable, str(ROOT / "bench" / "kv_quality.py"), model, "--json",
            str(result_path), *os.environ.get("KILN_KV_QUALITY_ARGS", "").split()]
    with open(out / f"quality-{size}.txt", "w") as table, \
            open(out / f"quality-{size}.log", "w") as log:
        run = subprocess.run(args, stdout=table, stderr=log, timeout=TIMEOUT_S, cwd=ROOT)
    assert run.returncode == 0, (out / f"quality-{size}.log").read_text()[-4000:]
    print((out / f"quality-{size}.txt").read_text())
    results = json.loads(result_path.read_text())["results"]
    assert results[0]["dtype"] == "auto" and results[0]["ratio"] == 1.0
    for row in results:
        assert math.isfinite(row["perplexity"]) and row["perplexity"] > 1.0, row
        assert 0.0 <= row["agreement"] <= 1.0, row
