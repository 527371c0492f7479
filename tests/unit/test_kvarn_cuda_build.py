"""kiln's side of the KVarN CUDA library (kiln/build/kvarncuda.py, kvarn/cuda_build.py): the one
nvcc command, the cache key, and the skip where no nvcc is. Compiling is tests/build's."""

import os
import subprocess
import sys

from kiln.build.kvarncuda import SOURCE, build_kvarn_library, cache_key, cuda_build, staged_source
from kiln.paths import REPO_ROOT

BUILD = cuda_build(REPO_ROOT)
CODE = (REPO_ROOT / SOURCE).read_bytes()
ARGS = BUILD.nvcc_command("nvcc", staged_source(), BUILD.LIB_NAME)[1:]


def test_the_command_has_sass_for_each_arch_and_exact_math():
    cmd = BUILD.nvcc_command("/x/nvcc", "k.cu", "out/lib.so", ("80", "90"), threads=1)
    assert cmd[0] == "/x/nvcc" and cmd[-3:] == ["-o", "out/lib.so", "k.cu"]
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "-gencode"] == [
        "arch=compute_80,code=sm_80", "arch=compute_90,code=sm_90"]
    assert "-O3" in cmd and "--threads=1" in cmd and "-lineinfo" in cmd
    assert not any("fast" in a for a in cmd)
    assert BUILD.ARCHS == ("80", "86", "89", "90")


def test_the_cache_key_follows_every_input():
    key = cache_key(CODE, BUILD.ARCHS, ARGS, "release 13.0")
    assert key == cache_key(CODE, BUILD.ARCHS, ARGS, "release 13.0")
    edited = CODE.replace(b"kvarn", b"kvarN", 1)
    assert cache_key(edited, BUILD.ARCHS, ARGS, "release 13.0") != key
    assert cache_key(CODE, ("80", "90"), ARGS, "release 13.0") != key
    assert cache_key(CODE, BUILD.ARCHS, [a for a in ARGS if a != "-O3"], "release 13.0") != key
    assert cache_key(CODE, BUILD.ARCHS, ARGS, "release 13.1") != key


def test_without_nvcc_the_library_is_skipped_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    lines = []
    assert build_kvarn_library(REPO_ROOT, tmp_path / "out", lines.append) == {}
    assert lines == [("csrc/kvarn: skipped libkvarn_decode.so: no nvcc (not on PATH nor in "
                     "$CUDA_HOME/bin); the wheel's KVarN decode uses its Triton kernel")]
    assert not (tmp_path / "out").exists()


def test_kiln_loads_the_command_without_importing_torch():
    code = ("import sys; from kiln.build.kvarncuda import cuda_build; from kiln.paths import REPO_ROOT; "
            "cuda_build(REPO_ROOT); assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == 0, result.stderr


def test_a_checkout_without_the_source_skips_it_in_one_line(tmp_path):
    lines = []
    assert build_kvarn_library(tmp_path, tmp_path / "out", lines.append) == {}
    assert lines == [f"csrc/kvarn: skipped: the checkout has no {SOURCE}"]
