"""A disk that fills up mid-write: the one error line names the file or folder being
written, whatever command was writing (the wheel, an applied tree, the tree cache).

Each test runs the real CLI on a small tmpfs mounted in a private mount namespace
(unshare; gone when the process ends), on a synthetic checkout (tests/unit/conftest.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.conftest import KilnCheckout, can_mount_in_own_namespace

pytestmark = pytest.mark.skipif(not can_mount_in_own_namespace(),
                                reason="needs unshare with a private mount namespace for a tmpfs")


def _on_small_tmpfs(checkout: KilnCheckout, mount: Path, size: str,
                    *args: str) -> subprocess.CompletedProcess:
    """``python -m kiln ARGS`` with a tmpfs of ``size`` mounted at ``mount``."""
    mount.mkdir(parents=True, exist_ok=True)
    script = 'mount -t tmpfs -o size="$1" none "$0" && shift && exec "$@"'
    return subprocess.run(
        ["unshare", "--mount", "--map-root-user", "sh", "-c", script, str(mount), size,
         sys.executable, "-m", "kiln", *args],
        cwd=checkout.root, env=checkout.env, capture_output=True, text=True, timeout=300)


def _error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    return result.stderr.strip().splitlines()[-1]


def test_a_full_out_names_the_wheel_being_written(checkout, tmp_path):
    out = tmp_path / "dist"  # 1 MiB for a wheel of 12 MiB that does not compress
    line = _error_line(_on_small_tmpfs(checkout, out, "1m", "build", "--out", str(out),
                                       "--no-xgrammar"))
    assert line.startswith(f"kiln build: error: No space left on device ({out}/.vllm-1.0.0+kiln.")
    assert line.endswith(".tmp)")


def test_a_full_into_names_the_file_being_copied(checkout, tmp_path):
    space = tmp_path / "space"  # one page: the first file copied fills it
    line = _error_line(_on_small_tmpfs(checkout, space, "4k", "apply", "--into",
                                       str(space / "applied")))
    assert line.startswith(f"kiln apply: error: copying {checkout.cache}/trees/vllm-1.0.0-")
    assert f" to {space}/.applied." in line and "No space left on device" in line


def test_a_full_tree_cache_names_the_folder_being_unpacked(checkout, tmp_path):
    trees = checkout.cache / "trees"
    line = _error_line(_on_small_tmpfs(checkout, trees, "4k", "apply", "--into",
                                       str(tmp_path / "applied")))
    assert line.startswith(f"kiln apply: error: No space left on device ({trees}/.vllm-1.0.0-")
    assert not (tmp_path / "applied").exists()
