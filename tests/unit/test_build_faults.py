"""`python -m kiln build` under faults: concurrent builds, SIGTERM (mid-write and
mid-compile), an unwritable --out.

Each test runs the real CLI in a subprocess on a checkout whose lock pins a small
synthetic upstream wheel (tests/unit/conftest.py: KilnCheckout).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
import zipfile
from pathlib import Path

import pytest

from kiln.build.kvarncuda import cuda_build
from kiln.paths import REPO_ROOT
from tests.unit.conftest import KilnCheckout, can_mount_in_own_namespace

ATTEMPTS = 5


def _writing(out: Path) -> bool:
    """A temporary wheel in ``out`` holds bytes already."""
    for path in out.glob(".*.tmp") if out.is_dir() else ():
        try:
            if path.stat().st_size > 0:
                return True
        except FileNotFoundError:
            pass
    return False


def _stopped_mid_write(proc: subprocess.Popen, out: Path) -> bool:
    """Stop the build (SIGSTOP) while it writes its wheel; False when it finished first."""
    deadline = time.monotonic() + 120
    while not _writing(out):
        if proc.poll() is not None:
            return False
        if time.monotonic() > deadline:
            pytest.fail("the build never started writing its wheel")
        time.sleep(0.001)
    os.kill(proc.pid, signal.SIGSTOP)
    if _writing(out):
        return True
    os.kill(proc.pid, signal.SIGCONT)  # it renamed its wheel in between
    return False


def _build_stopped_mid_write(checkout: KilnCheckout, base: Path, **env: str):
    """(stopped build, its --out): a build caught writing, retried on a loaded machine."""
    for attempt in range(ATTEMPTS):
        out = base / f"dist-{attempt}"
        proc = checkout.kiln("build", "--out", str(out), "--no-xgrammar", **env)
        if _stopped_mid_write(proc, out):
            return proc, out
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
    pytest.fail(f"no build was caught writing its wheel in {ATTEMPTS} attempts")


def _wheel(out: Path) -> Path:
    (wheel,) = [p for p in out.iterdir() if not p.name.startswith(".")]
    return wheel


def _built_alone(checkout: KilnCheckout, out: Path, epoch: str) -> bytes:
    result = checkout.run("build", "--out", str(out), "--no-xgrammar", SOURCE_DATE_EPOCH=epoch)
    assert result.returncode == 0, result.stderr
    return _wheel(out).read_bytes()


def test_two_builds_into_one_folder_each_leave_a_whole_wheel(checkout, tmp_path):
    # Two epochs make two different wheels of one name, so a mix of the two shows.
    first_bytes = _built_alone(checkout, tmp_path / "alone-1", "1700000000")
    second_bytes = _built_alone(checkout, tmp_path / "alone-2", "1800000000")
    assert first_bytes != second_bytes
    first, out = _build_stopped_mid_write(checkout, tmp_path, SOURCE_DATE_EPOCH="1700000000")
    try:
        second = checkout.run("build", "--out", str(out), "--no-xgrammar", SOURCE_DATE_EPOCH="1800000000")
        assert second.returncode == 0, second.stderr
        wheel = _wheel(out)
        assert f"built {wheel}" in second.stdout
        assert wheel.read_bytes() == second_bytes
    finally:
        os.kill(first.pid, signal.SIGCONT)
    stdout, stderr = first.communicate(timeout=120)
    assert wheel.read_bytes() == first_bytes, "the wheel at the final name is a mix of two builds"
    assert first.returncode == 0, stderr
    assert f"built {wheel}" in stdout
    with zipfile.ZipFile(wheel) as z:
        assert z.testzip() is None
    assert [p.name for p in out.iterdir()] == [wheel.name]


def test_sigterm_mid_write_removes_the_temporary_wheel(checkout, tmp_path):
    proc, out = _build_stopped_mid_write(checkout, tmp_path)
    try:
        os.kill(proc.pid, signal.SIGTERM)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert stderr.strip().endswith("kiln build: terminated") and "Traceback" not in stderr
    assert list(out.iterdir()) == []


def test_a_file_as_out_is_one_error_line_naming_it(checkout, tmp_path):
    out = tmp_path / "dist"
    out.write_text("a file, not a folder\n")
    result = checkout.run("build", "--out", str(out), "--no-xgrammar")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == f"kiln build: error: File exists ({out})"
    assert "Traceback" not in result.stderr
    assert out.read_text() == "a file, not a folder\n"


@pytest.mark.skipif(not can_mount_in_own_namespace(),
                    reason="needs unshare with a private mount namespace to make a read-only folder")
def test_a_read_only_out_reports_the_write_that_failed_not_the_cleanup(checkout, tmp_path):
    # A read-only mount (in a private mount namespace, gone when the process ends):
    # there even unlinking a file that does not exist fails (EROFS).
    out = tmp_path / "dist"
    out.mkdir()
    script = 'mount -t tmpfs -o ro none "$0" && exec "$@"'
    result = subprocess.run(
        ["unshare", "--mount", "--map-root-user", "sh", "-c", script, str(out),
         sys.executable, "-m", "kiln", "build", "--out", str(out), "--no-xgrammar"],
        cwd=checkout.root, env=checkout.env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"kiln build: error: Read-only file system ({out}/.vllm-1.0.0+kiln.")
    assert last.endswith(".tmp)")
    assert "Traceback" not in result.stderr


def _running_with(marker: str) -> list[str]:
    """The names of the running (not zombie) processes whose environment holds ``marker``."""
    names = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if marker.encode() not in (proc / "environ").read_bytes():
                continue
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            name = (proc / "comm").read_text().strip()
        except OSError:  # it ended while we looked
            continue
        if state != "Z":
            names.append(name)
    return names


@pytest.mark.skipif(cuda_build(REPO_ROOT).find_nvcc() is None, reason="needs nvcc to compile the KVarN library")
def test_sigterm_mid_compile_ends_every_nvcc_process_and_its_temporary_files(tmp_path):
    checkout = KilnCheckout(tmp_path, kvarn_cuda=True)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    marker = f"kiln-test-{uuid.uuid4().hex}"
    proc = checkout.kiln("build", "--out", str(tmp_path / "dist"), "--no-xgrammar",
                         TMPDIR=str(scratch), KILN_TEST_MARKER=marker)
    deadline = time.monotonic() + 180
    while "cicc" not in _running_with(marker):  # nvcc's device compiler, a grandchild
        if proc.poll() is not None:
            pytest.fail(f"the build ended before nvcc ran cicc: {proc.communicate()}")
        if time.monotonic() > deadline:
            pytest.fail("nvcc never ran cicc")
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    left = _running_with(marker)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert stderr.strip().endswith("kiln build: terminated") and "Traceback" not in stderr
    assert left == [], f"still running after kiln exited: {left}"
    assert sorted(p.name for p in scratch.iterdir()) == []
    assert not (tmp_path / "dist").exists() or list((tmp_path / "dist").iterdir()) == []


def test_a_wheel_left_by_a_killed_build_is_removed_by_the_next(checkout, tmp_path):
    proc, out = _build_stopped_mid_write(checkout, tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=120)
    [abandoned] = out.glob(".*.tmp")
    result = checkout.run("build", "--out", str(out), "--no-xgrammar")
    assert result.returncode == 0, result.stderr
    assert f"removed {abandoned}, left unfinished by a build that was killed" in result.stdout
    assert [p.name for p in out.iterdir()] == [_wheel(out).name]
