"""kiln.testing.gpurun, the GPU bundle's side on the GPU machine: what it refuses, what it reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.testing.gpurun import MANIFEST, Machine, glibc_version, gpu_visible, junit_counts, main, refusal, summary

MANIFEST_DATA = {"fork_version": "0.32.0+kiln.1", "archs": [90], "python_version": "3.12",
                 "platforms": ["manylinux_2_31_x86_64"], "files": {}}
H200 = Machine(python="3.12.3", torch="2.11.0+cu130", torch_cuda="13.0", triton="3.6.0",
               gpus=1, device="NVIDIA H200", capability="9.0")


def test_the_lent_h200_is_accepted():
    assert refusal(H200, MANIFEST_DATA) is None
    assert refusal(Machine(**{**H200.__dict__, "torch": "2.13.0+cu130"}), MANIFEST_DATA) is None


@pytest.mark.parametrize("change, message", [
    ({"python": "3.11.7"}, "this is Python 3.11.7; the bundle's wheels are for Python 3.12"),
    ({"torch": None, "torch_cuda": None, "gpus": 0},
     "no torch in Python 3.12.3; a CUDA build of torch >= 2.11 is needed"),
    ({"torch": "2.13.0+cpu", "torch_cuda": None, "gpus": 0},
     "torch 2.13.0+cpu is a CPU build; a CUDA build of torch >= 2.11 is needed"),
    ({"torch": "2.10.1+cu128"}, "torch 2.10.1+cu128 is older than 2.11"),
    ({"gpus": 0, "device": None, "capability": None},
     "torch 2.11.0+cu130 (CUDA 13.0) sees no CUDA GPU"),
    ({"device": "NVIDIA GeForce RTX 3090", "capability": "8.6"},
     ("the GPU is NVIDIA GeForce RTX 3090, compute capability 8.6 (sm_86); the bundle was built "
     "for sm_90: build one with `python3 -m kiln gpu-bundle --arch 86`")),
])
def test_a_machine_the_bundle_cannot_run_on_is_refused_with_the_reason(change, message):
    assert message in (refusal(Machine(**{**H200.__dict__, **change}), MANIFEST_DATA) or "")


def test_a_glibc_older_than_the_wheels_need_is_refused():
    manifest = {**MANIFEST_DATA, "glibc": "2.36"}
    assert refusal(Machine(**{**H200.__dict__, "glibc": "2.39"}), manifest) is None
    assert refusal(Machine(**{**H200.__dict__, "glibc": "2.36"}), manifest) is None
    assert refusal(Machine(**{**H200.__dict__, "glibc": "2.35"}), manifest) == (
        "this machine's glibc is 2.35; the bundle's wheels need glibc >= 2.36 (their "
        "manylinux tags)")
    # Unknown (not a glibc system, or a manifest from before the field): not refused here.
    assert refusal(H200, manifest) is None
    assert refusal(Machine(**{**H200.__dict__, "glibc": "2.35"}), MANIFEST_DATA) is None


def test_this_machine_reads_its_glibc():
    version = glibc_version()
    assert version == os.confstr("CS_GNU_LIBC_VERSION").split()[1]
    assert version.startswith("2.") and int(version.split(".")[1]) >= 17


def test_a_capability_among_several_built_archs_is_accepted():
    ada = Machine(**{**H200.__dict__, "device": "NVIDIA L4", "capability": "8.9"})
    assert refusal(ada, {**MANIFEST_DATA, "archs": [86, 89, 90]}) is None


@pytest.mark.skipif(gpu_visible(), reason="this machine has an NVIDIA GPU")
def test_check_refuses_a_machine_without_a_gpu_first(tmp_path: Path, capsys):
    (tmp_path / MANIFEST).write_text(json.dumps(MANIFEST_DATA))
    assert main(["check", str(tmp_path), str(tmp_path / "machine.json")]) == 3
    err = capsys.readouterr().err
    assert err.startswith("kiln gpu bundle: refused: no CUDA GPU on this machine")
    assert not (tmp_path / "machine.json").exists()


def _pytest_junit(tmp_path: Path) -> Path:
    """A JUnit report written by a real pytest run: 2 passed, 1 failed, 1 skipped, 1 error."""
    (tmp_path / "test_mix.py").write_text(
        "import pytest\n"
        "@pytest.fixture\ndef broken():\n    raise RuntimeError('setup fails')\n"
        "def test_a(): pass\n"
        "def test_b(): pass\n"
        "def test_c(): assert False\n"
        "def test_d(): pytest.skip('not here')\n"
        "def test_e(broken): pass\n")
    junit = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    str(tmp_path / "test_mix.py"), "--junitxml", str(junit)],
                   capture_output=True, cwd=tmp_path)
    return junit


def test_junit_counts_read_a_real_pytest_report(tmp_path: Path):
    junit = _pytest_junit(tmp_path)
    assert junit_counts(junit) == {"passed": 2, "failed": 1, "skipped": 1, "errors": 1}
    assert junit_counts(tmp_path / "missing.xml") is None


def test_summary_names_machine_fork_counts_and_status(tmp_path: Path, capsys):
    bundle, results = tmp_path / "bundle", tmp_path / "results"
    bundle.mkdir()
    results.mkdir()
    (bundle / MANIFEST).write_text(json.dumps(MANIFEST_DATA))
    (tmp_path / "machine.json").write_text(json.dumps(H200.__dict__))
    _pytest_junit(results)
    (results / "test_mix.py").unlink()
    data = summary(bundle, tmp_path / "machine.json", results, 1, time.time() - 12.5)
    assert json.loads((results / "summary.json").read_text()) == data
    assert {k: data[k] for k in ("device", "capability", "torch", "triton", "fork_version",
                                 "exit_status")} == {
        "device": "NVIDIA H200", "capability": "9.0", "torch": "2.11.0+cu130",
        "triton": "3.6.0", "fork_version": "0.32.0+kiln.1", "exit_status": 1}
    assert data["counts"] == {"passed": 2, "failed": 1, "skipped": 1, "errors": 1}
    assert 12 <= data["wall_seconds"] < 60
    assert "warning" not in capsys.readouterr().err
    for n in range(7):
        (results / f"extra-{n}.json").write_text("{}")
    summary(bundle, tmp_path / "machine.json", results, 0, time.time())
    assert "9 files in" in capsys.readouterr().err
