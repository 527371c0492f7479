"""The KVarN CUDA library in the fork wheel (kiln/build/kvarncuda.py): where nvcc is it is
compiled once and then copied from the cache, any checkout compiles the same bytes, and
a build without nvcc still makes the wheel, less the library, saying why.

The cold compile (4 archs) takes about 35-50 s on 2 cores; the wheel build about a minute."""

from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path

import pytest

from kiln.abi import fatbin
from kiln.build.kvarncuda import SOURCE, WHEEL_PATH, build_kvarn_library, cuda_build
from kiln.build.wheel import build_wheel
from kiln.paths import REPO_ROOT

BUILD = cuda_build(REPO_ROOT)
needs_nvcc = pytest.mark.skipif(BUILD.find_nvcc() is None,
                                reason="no nvcc here: kiln build leaves the library out")


@needs_nvcc
def test_the_wheels_library_has_machine_code_for_every_arch(fork_zip):
    data = fork_zip.read(WHEEL_PATH)
    blobs = fatbin.read(data, WHEEL_PATH)
    assert blobs
    for blob in blobs:
        assert sorted(e.name for e in blob.entries) == [f"sm_{a} ELF" for a in BUILD.ARCHS]
    assert b"kvarn_decode_launch" in data  # the C ABI the ctypes loader binds


@needs_nvcc
def test_a_rebuild_copies_the_library_from_the_cache(fork_zip, tmp_path):
    lines: list[str] = []
    [(name, path)] = build_kvarn_library(REPO_ROOT, tmp_path, lines.append).items()
    assert name == WHEEL_PATH and path.read_bytes() == fork_zip.read(WHEEL_PATH)
    assert len(lines) == 1 and "from the cache" in lines[0]
    assert not any(tmp_path.iterdir())  # nothing compiled


@needs_nvcc
def test_a_cold_compile_in_another_checkout_gives_the_same_bytes(fork_zip, tmp_path,
                                                                 monkeypatch):
    checkout = tmp_path / "elsewhere"
    for rel in ("kvarn/cuda_build.py", SOURCE):
        (checkout / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO_ROOT / rel, checkout / rel)
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    lines: list[str] = []
    [path] = build_kvarn_library(checkout, tmp_path / "out", lines.append).values()
    assert any("compiled libkvarn_decode.so in" in line for line in lines), lines
    assert path.read_bytes() == fork_zip.read(WHEEL_PATH)
    assert list((tmp_path / "cache" / "kvarn-cuda").glob("*/libkvarn_decode.so"))


def test_without_nvcc_the_wheel_is_the_same_less_the_library(fork_zip, tmp_path, monkeypatch):
    path = [d for d in os.environ["PATH"].split(os.pathsep) if not (Path(d) / "nvcc").exists()]
    monkeypatch.setenv("PATH", os.pathsep.join(path))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    lines: list[str] = []
    built = build_wheel(tmp_path, log=lines.append)
    assert [line for line in lines if line.startswith("csrc/kvarn")] == [
        "csrc/kvarn: skipped libkvarn_decode.so: no nvcc (not on PATH nor in $CUDA_HOME/bin); "
        "the wheel's KVarN decode uses its Triton kernel"]
    with zipfile.ZipFile(built.path) as plain:
        names = set(plain.namelist())
        assert WHEEL_PATH not in names
        assert names == set(fork_zip.namelist()) - {WHEEL_PATH}
        for name in names:
            if not name.endswith(".dist-info/RECORD"):
                assert plain.read(name) == fork_zip.read(name), name
