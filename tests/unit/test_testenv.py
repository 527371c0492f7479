"""The test venv's two layers: a fork venv per build over a shared base venv."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kiln.errors import KilnError
from kiln.testing.testenv import COMPLETE, fork_venv


def _wheel(folder: Path, version: str) -> Path:
    """A pure-Python wheel of a package `kilnprobe` that reports its version."""
    path = folder / f"kilnprobe-{version}-py3-none-any.whl"
    info = f"kilnprobe-{version}.dist-info"
    files = {
        "kilnprobe/__init__.py": f"VERSION = {version!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: kilnprobe\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
        zf.writestr(f"{info}/RECORD", "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n")
    return path


def _python(venv: Path, code: str) -> str:
    return subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True,
                          text=True, check=True).stdout.strip()


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("venvs") / "test-base"
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    (path / COMPLETE).write_text("test\n")
    return path


def test_two_builds_get_their_own_venvs_and_the_base_stays_clean(base, tmp_path):
    one, two = _wheel(tmp_path, "1.0"), _wheel(tmp_path, "2.0")
    venv_one, venv_two = fork_venv(base, [one], log=lambda _: None), fork_venv(
        base, [two], log=lambda _: None)
    assert venv_one != venv_two and venv_one.parent == base.parent
    probe = "import kilnprobe, importlib.metadata as m; print(kilnprobe.VERSION, m.version('kilnprobe'))"
    assert _python(venv_one, probe) == "1.0 1.0"
    assert _python(venv_two, probe) == "2.0 2.0"
    # The base's packages are visible (its pip ran the installs), the fork is not in it.
    assert _python(venv_one, "import pip; print(pip.__file__)").startswith(str(base))
    missing = subprocess.run([str(base / "bin" / "python"), "-c", "import kilnprobe"],
                             capture_output=True)
    assert missing.returncode != 0


def test_the_same_wheel_reuses_its_venv_and_a_changed_one_does_not(base, tmp_path):
    wheel = _wheel(tmp_path, "3.0")
    first = fork_venv(base, [wheel], log=lambda _: None)
    seen: list[str] = []
    assert fork_venv(base, [wheel], log=seen.append) == first and seen == []
    (tmp_path / "other").mkdir()
    rebuilt = _wheel(tmp_path / "other", "3.0")  # same name, other bytes
    with zipfile.ZipFile(rebuilt, "a") as zf:
        zf.writestr("kilnprobe/extra.py", "")
    assert fork_venv(base, [rebuilt], log=lambda _: None) != first


def test_an_unfinished_fork_venv_is_made_again(base, tmp_path):
    wheel = _wheel(tmp_path, "4.0")
    venv = fork_venv(base, [wheel], log=lambda _: None)
    (venv / COMPLETE).unlink()
    (venv / "leftover").write_text("from a failed attempt")
    assert fork_venv(base, [wheel], log=lambda _: None) == venv
    assert not (venv / "leftover").exists() and (venv / COMPLETE).exists()


def _fork_wheel(folder: Path, version: str, requires: list[str]) -> Path:
    path = folder / f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    metadata = "Metadata-Version: 2.1\nName: vllm\nVersion: " + version + "\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires) + "\nlong description\nRequires-Dist: torch==0\n"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"vllm-{version}.dist-info/METADATA", metadata)
    return path


def test_the_venvs_torch_is_the_one_the_wheel_pins(tmp_path):
    from kiln.testing.testenv import runtime_requirements, torch_requirement

    wheel = _fork_wheel(tmp_path, "0.33.0+kiln.1", [
        "numpy", "torch==2.14.0", "torchvision==0.29.0", "xgrammar==0.2.8; platform_machine == 'x86_64'",
        "flashinfer-python==0.7.3", "pytest; extra == 'test'"])
    assert torch_requirement(wheel) == "torch==2.14.0"
    assert runtime_requirements(wheel) == ["numpy", "xgrammar==0.2.8; platform_machine == 'x86_64'"]
    (tmp_path / "loose").mkdir()
    loose = _fork_wheel(tmp_path / "loose", "0.33.0+kiln.2", ["torch>=2.14"])
    with pytest.raises(KilnError, match="one exact torch pin.*torch>=2.14"):
        torch_requirement(loose)


def test_a_wheel_built_on_another_pin_is_refused_naming_both(tmp_path, capsys):
    from kiln.cli import main

    wheel = _fork_wheel(tmp_path, "0.33.0+kiln.1", ["torch==2.14.0"])
    assert main(["test-env", "--wheel", str(wheel), "--version", "0.34.0"]) != 0
    err = capsys.readouterr().err
    assert "built on vLLM 0.33.0, not on the pin 0.34.0" in err and "--version 0.33.0" in err
