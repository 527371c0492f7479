"""bench/specattn_verify.py on the GPU, from the bundle's environment (the fork wheel
installed, so the installed vLLM's unified_attention imports; 0.33.0's op files come from
$KILN_UPSTREAM_OPS/0.33.0 when set, made by the bench's --extract-upstream on the CPU box
and carried beside the bundle). Writes specattn_verify.json and .log into
$KILN_GPU_RESULTS. A benchmark: it asserts that every path ran and agreed, never a speed.
$KILN_SPECATTN_BENCH_ARGS adds arguments (a subset: --dtypes, --geometries, ...).

    KILN_UPSTREAM_OPS=$PWD/build/upstream-ops bash build/gpu-bundle/run $OUT/r -k specattn
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "specattn_verify.py"
TIMEOUT_S = int(os.environ.get("KILN_SPECATTN_BENCH_TIMEOUT", "420"))


def test_specattn_verify_bench(tmp_path):
    out = Path(os.environ.get("KILN_GPU_RESULTS") or tmp_path)
    args = [sys.executable, str(BENCH), "--json", str(out / "specattn_verify.json")]
    ops = os.environ.get("KILN_UPSTREAM_OPS")
    if ops:
        args += ["--upstream-033", str(Path(ops) / "0.33.0")]
    args += os.environ.get("KILN_SPECATTN_BENCH_ARGS", "").split()
    with open(out / "specattn_verify.log", "w") as log:
        run = subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, timeout=TIMEOUT_S,
                             cwd=ROOT)
    assert run.returncode == 0, (out / "specattn_verify.log").read_text()[-4000:]
    result = json.loads((out / "specattn_verify.json").read_text())
    assert result["upstream_032"] and result["upstream_033"] == bool(ops)
    for r in result["rows"]:
        assert r["fork_ms"] > 0 and r["up032_2d_ms"] > 0, r
        assert r["fork_vs_up032_2d_relerr"] < 2e-2, r
        if r["up033_3d_ms"] is not None:
            assert r["fork_vs_up033_3d_relerr"] < 2e-2, r
