"""The one nvcc command that builds ``libkvarn_decode.so`` from csrc/kvarn/kvarn_decode.cu.

``decode_cuda.build_library`` and ``kiln build`` (which puts the library in the wheel)
both compile through ``compile_library``, so the flags are written once. kiln runs
without torch: this module imports the standard library only, and kiln loads it from
its file (``kvarn/__init__`` imports torch).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

LIB_NAME = "libkvarn_decode.so"
ARCHS = ("80", "86", "89", "90")
SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "kvarn" / "kvarn_decode.cu"
# Exact math (no --use_fast_math); -lineinfo maps SASS to source lines for ncu and
# compute-sanitizer at no run-time cost. --strip-all drops the host symbol table, which
# names nvcc's temporary files (a new name per run): the exports stay in .dynsym.
FLAGS = ("-std=c++17", "-O3", "-shared", "-Xcompiler", "-fPIC", "-lineinfo",
         "-Xlinker", "--strip-all")


def find_nvcc() -> str | None:
    """nvcc on PATH, else $CUDA_HOME/bin/nvcc (default /usr/local/cuda); None if neither."""
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    return home if os.path.isfile(home) else None


def nvcc_command(nvcc: str, source, out, archs=ARCHS, ptxas_verbose: bool = False,
                 threads: int = 0) -> list[str]:
    """SASS for each SM arch (no PTX); threads: nvcc's per-arch parallelism, 0 = all cores."""
    gencode = [f for a in archs for f in ("-gencode", f"arch=compute_{a},code=sm_{a}")]
    verbose = ["-Xptxas", "-v"] if ptxas_verbose else []
    return [nvcc, *verbose, *gencode, *FLAGS, f"--threads={threads}", "-o", str(out),
            str(source)]


def compile_library(out_dir, archs=ARCHS, source=None, nvcc: str | None = None,
                    ptxas_verbose: bool = False, threads: int = 0, cwd=None,
                    cleanup_guard=contextlib.nullcontext) -> Path:
    """out_dir/libkvarn_decode.so; nvcc's command and output go to out_dir/build.log.
    Raises RuntimeError naming what failed (no nvcc, or nvcc's own errors).

    nvcc runs in a process group of its own with its temporary files in a private
    folder: when the caller is interrupted (Ctrl-C, or SIGTERM raised as an exception)
    the whole group (cicc, ptxas, the host compiler) is killed and waited for, and the
    folder removed. ``cleanup_guard()`` wraps that cleanup, so a caller can keep a
    second signal from cutting it short (kiln passes kiln.signals.uninterrupted)."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (PATH or $CUDA_HOME/bin)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / LIB_NAME
    cmd = nvcc_command(nvcc, source or SOURCE, out, archs, ptxas_verbose, threads)
    scratch = tempfile.mkdtemp(prefix="kvarn-nvcc-")
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=cwd, env={**os.environ, "TMPDIR": scratch},
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate()
        except BaseException:
            with cleanup_guard():
                _end_group(proc)
            raise
    finally:
        with cleanup_guard():
            shutil.rmtree(scratch, ignore_errors=True)
    (out_dir / "build.log").write_text(" ".join(cmd) + "\n" + stdout + stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed ({proc.returncode}):\n{stderr[-4000:]}")
    return out


def _end_group(proc: subprocess.Popen, patience_s: float = 10.0) -> None:
    """Kill nvcc's process group and wait until none of it runs; give up after
    ``patience_s``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + patience_s
    while _runs(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.02)


def _runs(group: int) -> bool:
    """Whether a process of ``group`` is still running. nvcc's children are not ours to
    wait for, and once dead they may stay zombies (where pid 1 does not reap), so
    /proc is read rather than asking kill(0), which counts zombies."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError):  # it ended while we looked
            continue
        if state != "Z" and int(pgrp) == group:
            return True
    return False


def nvcc_version(nvcc: str) -> str:
    """`nvcc --version`'s text (part of a cached library's key)."""
    run = subprocess.run([nvcc, "--version"], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"{nvcc} --version failed ({run.returncode}): {run.stderr.strip()}")
    return run.stdout
