"""bench/specattn_verify.py runs end to end (--smoke: tiny fp16 shapes, the interpreter on
a CPU), against both upstream paths where vLLM is installed, so a GPU session never
spends device time on a benchmark that no longer starts."""
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from specattn_cases import has_upstream_vllm

BENCH = Path(__file__).resolve().parents[2] / "bench" / "specattn_verify.py"


def test_smoke_run_writes_a_complete_table(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    has_vllm = has_upstream_vllm()
    args = [sys.executable, str(BENCH), "--smoke", "--dtypes", "float16", "int4_per_token_head",
            "--json", str(tmp_path / "bench.json")]
    if has_vllm:
        extract = subprocess.run([sys.executable, str(BENCH), "--extract-upstream",
                                  str(tmp_path / "ops")], capture_output=True, text=True,
                                 timeout=600)
        assert extract.returncode == 0, extract.stderr[-3000:]
        args += ["--upstream-033", str(tmp_path / "ops" / "0.33.0")]
        if not torch.cuda.is_available():
            env["CUDA_VISIBLE_DEVICES"] = ""  # vLLM keeps Triton on a CPU host only so
    run = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    rows = result["rows"]
    assert [(r["kv_cache_dtype"], r["context"], r["query_len"]) for r in rows] == [
        (dtype, ctx, q) for dtype in ("float16", "int4_per_token_head")
        for ctx in (40, 100) for q in (2, 5)]
    assert all(r["fork_ms"] > 0 and r["fork_splits"] == 16 for r in rows)
    assert result["upstream_032"] == result["upstream_033"] == has_vllm
    if has_vllm:
        for r in rows:  # the fork and upstream compute the same attention
            assert r["fork_vs_up032_2d_relerr"] < 2e-3, r
            if r["kv_cache_dtype"] == "float16":
                assert r["fork_vs_up033_3d_relerr"] < 2e-3, r
            else:
                assert r["up033_3d_ms"] is None  # 0.33.0's 3D path does not take int4
    assert "float16" in run.stdout and "summary:" in run.stdout


def test_bad_arguments_are_refused_naming_what_is_allowed():
    run = subprocess.run([sys.executable, str(BENCH), "--smoke", "--query-lens", "17"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "allowed 1..16" in run.stderr
    run = subprocess.run([sys.executable, str(BENCH), "--dtypes", "kvarn_k4v2_g128"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "invalid choice: 'kvarn_k4v2_g128'" in run.stderr
