"""bench/kvarn_decode.py runs end to end (--smoke: tiny shapes, the interpreter on a CPU),
so a GPU session never spends device time on a benchmark that no longer starts."""
import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "kvarn_decode.py"


def test_smoke_run_writes_a_complete_table(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--presets", "kvarn_k4v2_g128",
         "--head-dims", "256", "--gqa", "4", "--json", str(out)],
        capture_output=True, text=True, timeout=900, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["decode"]
    # the reference shape (the smoke run's last) comes first: a --budget-s cut keeps it
    assert [(r["head_dim"], r["batch"], r["context"]) for r in rows] == [(256, 2, 300), (256, 1, 520)]
    for r in rows:
        assert r["kvarn_ms"] > 0 and r["fp16_triton_ms"] > 0 and r["sdpa_ms"] > 0
        # old and new kernel side by side; the fastest one is the row's figure
        assert set(r["variants"]) == {"prefetch", "pipelined"}
        assert r["kvarn_ms"] == min(v["ms"] for v in r["variants"].values())
        assert r["prefetch_default_ms"] == r["variants"]["prefetch"]["ms"]  # untuned run
        assert r["fp16_triton_vs_sdpa_maxabs"] < 2e-3  # the fp16 baseline computes attention
        assert 0 < r["roofline_kvarn_ms"] < r["roofline_fp16_ms"]  # the format reads fewer bytes
    (flush,) = result["flush"]
    assert flush["head_dim"] == 256 and flush["tiles"] == 8 * 8
    assert "targets:" in run.stdout and "kvarn_k4v2_g128  256" in run.stdout


def test_smoke_sweep_times_every_config_and_picks_a_best_one(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--smoke-sweep", "--presets", "kvarn_k4v2_g64",
         "--head-dims", "64", "--gqa", "4", "--shapes", "1x200", "--json", str(out)],
        capture_output=True, text=True, timeout=900, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    sweep = result["sweep"]
    assert {(r["variant"], r["batch"], r["context"]) for r in sweep} == {
        (v, 1, 200) for v in ("prefetch", "pipelined")}
    assert len(sweep) == 4 and all(r["ms"] > 0 and r["error"] is None for r in sweep)
    for v in ("prefetch", "pipelined"):
        best = result["best_config"][f"{v}/64"]
        mine = [r for r in sweep if r["variant"] == v]
        assert best["ms"]["1x200"] == min(r["ms"] for r in mine)
        # the table row runs the chosen configuration
        (row,) = result["decode"]
        assert row["variants"][v]["config"] == best["config"]
    assert "best configurations" in run.stdout


def test_cuda_sweep_alone_reports_each_shape_or_why_it_could_not_run(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--cuda-sweep", "--no-table", "--presets",
         "kvarn_k4v2_g128", "--head-dims", "128", "--shapes", "1x700", "--json", str(out)],
        capture_output=True, text=True, timeout=900, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["decode"] == [] and result["flush"] == []  # --no-table
    (best,) = result["cuda_best"]
    if result["cuda_unavailable"]:  # a CPU box: the reason is recorded and printed
        assert best["skipped"] == result["cuda_unavailable"]
        assert result["cuda_sweep"] == [] and "skipped: " in run.stdout
    else:  # every split count timed, the default among them, the best the fastest
        times = [r["ms"] for r in result["cuda_sweep"]]
        assert best["best"]["ms"] == min(times) <= best["default"]["ms"]
        assert sum(r["default"] for r in result["cuda_sweep"]) == 1


def test_bad_arguments_are_refused_naming_what_is_allowed():
    run = subprocess.run([sys.executable, str(BENCH), "--head-dims", "96"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "invalid choice: 96" in run.stderr
    run = subprocess.run([sys.executable, str(BENCH), "--smoke", "--repeats", "0"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "allowed: 1 or more" in run.stderr
    run = subprocess.run([sys.executable, str(BENCH), "--smoke", "--shapes", "64"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "allowed: BATCHxCONTEXT" in run.stderr
