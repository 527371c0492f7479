"""bench/kvarn_decode.py runs end to end (--smoke: tiny shapes, the interpreter on a CPU),
so a GPU session never spends device time on a benchmark that no longer starts."""
import hashlib
import importlib.util
import json
import lzma
import os
import subprocess
import sys
import zipfile
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "kvarn_decode.py"


def fa3_module():
    spec = importlib.util.spec_from_file_location("_fa3_upstream", BENCH.with_name("_fa3_upstream.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
        # every Triton variant side by side; the fastest one is the row's figure
        assert set(r["variants"]) == {"prefetch"}
        assert r["kvarn_ms"] == min(v["ms"] for v in r["variants"].values())
        assert r["prefetch_default_ms"] == r["variants"]["prefetch"]["ms"]  # untuned run
        assert r["fp16_triton_vs_sdpa_maxabs"] < 2e-3  # the fp16 baseline computes attention
        assert 0 < r["roofline_kvarn_ms"] < r["roofline_fp16_ms"]  # the format reads fewer bytes
        # no --fa3 folder: the FA3 column says how to get one
        assert r["fa3_ms"] is None and "--extract-fa3" in r["fa3_skipped"]
    (flush,) = result["flush"]
    assert flush["head_dim"] == 256 and flush["tiles"] == 8 * 8
    assert "targets:" in run.stdout and "kvarn_k4v2_g128  256" in run.stdout
    assert "fa3 column skipped: no --fa3 folder given" in run.stdout


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
        (v, 1, 200) for v in ("prefetch",)}
    assert len(sweep) == 2 and all(r["ms"] > 0 and r["error"] is None for r in sweep)
    for v in ("prefetch",):
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


def test_extract_fa3_packs_upstreams_library_from_the_pinned_wheel(tmp_path):
    # the same bytes as in the sha256-pinned wheel (fetched into kiln's cache if missing,
    # as the wheel build does), xz-packed small enough for a device call to carry
    from kiln.upstream.fetch import download_from_index, fetch_pinned
    from kiln.upstream.lock import UpstreamLock

    run = subprocess.run([sys.executable, str(BENCH), "--extract-fa3", str(tmp_path)],
                         capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
    fa3 = fa3_module()
    folder = tmp_path / "0.33.0"
    manifest = json.loads((folder / fa3.MANIFEST).read_text())
    pin = UpstreamLock.load().release("0.33.0").wheel
    assert (manifest["wheel"], manifest["wheel_sha256"]) == (pin.name, pin.sha256)
    wheel = fetch_pinned(pin, lambda d: download_from_index(pin, d), print)
    with zipfile.ZipFile(wheel) as zf:
        raw = zf.read(fa3.LIBRARY)
    packed = folder / fa3.PACKED
    assert lzma.decompress(packed.read_bytes()) == raw
    assert manifest["sha256"] == hashlib.sha256(raw).hexdigest() and manifest["size"] == len(raw)
    assert packed.stat().st_size < 24 * 2**20 < len(raw)
    loaded = fa3.load(folder)
    if isinstance(loaded, str):  # a CPU box or another GPU: the reason, after the file checks
        assert loaded.startswith("FA3 needs a CUDA device") or "sm_90a" in loaded, loaded


def test_fa3_folder_without_the_library_says_how_to_make_one(tmp_path):
    why = fa3_module().load(tmp_path)
    assert isinstance(why, str) and f"--fa3 {tmp_path}" in why and "--extract-fa3" in why
