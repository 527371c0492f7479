"""One commit, one wheel: kiln, `pip wheel .` and `python -m build` agree byte for byte."""

import subprocess
import sys

from kiln.build.wheel import build_wheel
from kiln.paths import REPO_ROOT


def test_a_second_kiln_build_is_byte_identical(fork_wheel, tmp_path):
    again = build_wheel(tmp_path, log=lambda _: None)
    assert again.path.name == fork_wheel.name
    assert again.path.read_bytes() == fork_wheel.read_bytes()


def test_pip_wheel_builds_the_same_wheel_through_setup_py(fork_wheel, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(REPO_ROOT)],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (built,) = tmp_path.glob("vllm-*.whl")
    assert built.name == fork_wheel.name
    assert built.read_bytes() == fork_wheel.read_bytes()
    # A vllm.egg-info in the root would shadow the installed wheel's entry points.
    assert not list(REPO_ROOT.glob("*.egg-info"))


def test_python_dash_m_build_builds_the_same_wheel(fork_wheel, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path), str(REPO_ROOT)],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (built,) = tmp_path.glob("vllm-*.whl")
    assert built.read_bytes() == fork_wheel.read_bytes()


def test_cmake_skips_csrc_without_a_cuda_torch_and_says_why(tmp_path):
    # A copy of the build files with one CUDA source, configured by a Python without
    # torch, as pip's isolated build env is (the test venv's torch may be a CUDA build).
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "probe.cu").write_text("__global__ void probe() {}\n")
    (tmp_path / "CMakeLists.txt").write_bytes((REPO_ROOT / "CMakeLists.txt").read_bytes())
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "env")],
                   check=True)
    python = tmp_path / "env" / "bin" / "python"
    result = subprocess.run(
        ["cmake", "-S", str(tmp_path), "-B", str(tmp_path / "build"), "-G", "Ninja",
         f"-DPython_EXECUTABLE={python}"],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr
    reasons = [line for line in result.stdout.splitlines() if "kiln: skipped csrc/" in line]
    assert len(reasons) == 1
    assert "no nvcc found" in reasons[0] or f"no CUDA build of torch in {python}" in reasons[0]
    assert not list((tmp_path / "build").rglob("*.so"))
