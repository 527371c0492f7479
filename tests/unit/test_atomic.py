"""kiln/atomic.py: a temporary file is removed once its writer is gone, never before."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kiln.atomic import remove_abandoned, replacing

# Above any pid this kernel hands out (pid_max is at most 2**22).
GONE = 2**22 + 1

# Holds an exclusive flock on ARGV[1] until its stdin closes.
HOLDER = """
import fcntl, sys
with open(sys.argv[1]) as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    print("locked", flush=True)
    sys.stdin.read()
"""


def _touch(folder: Path, name: str) -> Path:
    (folder / name).write_bytes(b"part of a wheel")
    return folder / name


def test_only_temporaries_whose_writer_is_gone_are_removed(tmp_path):
    gone = _touch(tmp_path, f".vllm-1.0.0+kiln.1-x.whl.a1b2c3d4.{GONE}.tmp")
    other_version = _touch(tmp_path, f".vllm-1.0.0+kiln.2-x.whl.e5f6g7h8.{GONE}.tmp")
    running = _touch(tmp_path, f".vllm-1.0.0+kiln.1-x.whl.zzzzzzzz.{os.getpid()}.tmp")
    unknown_writer = _touch(tmp_path, ".vllm-1.0.0+kiln.1-x.whl.a1b2c3d4.tmp")
    not_a_wheel = _touch(tmp_path, f".manifest.json.a1b2c3d4.{GONE}.tmp")
    # Its pid is not ours to see (as from another pid namespace), but its lock is held.
    locked = _touch(tmp_path, f".vllm-1.0.0+kiln.1-x.whl.lockedxx.{GONE}.tmp")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(locked)], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == "locked\n"
        assert remove_abandoned(tmp_path, "vllm-*.whl") == [gone, other_version]
    finally:
        holder.communicate(timeout=60)
    assert sorted(tmp_path.iterdir()) == sorted([running, unknown_writer, not_a_wheel, locked])
    assert remove_abandoned(tmp_path, "vllm-*.whl") == [locked]


def test_a_temporary_being_written_is_kept(tmp_path):
    target = tmp_path / "vllm-1.0.0-x.whl"
    with replacing(target) as tmp:
        tmp.write_bytes(b"half")
        assert tmp.name.endswith(f".{os.getpid()}.tmp")
        assert remove_abandoned(tmp_path, "vllm-*.whl") == []
    assert target.read_bytes() == b"half" and list(tmp_path.iterdir()) == [target]
