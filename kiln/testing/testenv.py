"""The test virtualenv: CPU torch, the fork's dependencies and the test tools.

Two layers, both cached outside the repository. The base venv holds the dependencies,
keyed by a hash of everything installed into it, so a rerun reuses it and any change of
requirements makes a new one; it never holds the fork itself. Each fork build gets a
small venv of its own, keyed by the bytes of its wheels, that sees the base's packages
through a ``.pth`` file: two builds tested at once never swap each other's vllm. A venv
cannot be moved once made, so each is built in place and marked complete last; an
unmarked one is a failed attempt and is rebuilt.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

from kiln.build.pins import requirement_name
from kiln.errors import KilnError, naming
from kiln.paths import REPO_ROOT, cache_dir

# The CPU torch on this machine's disk, for kiln's own tool venvs (the xgrammar suite).
TORCH = "torch==2.13.0"
# PyPI's builds of the torch* ones fail to import beside the CPU torch wheel.
# flashinfer holds GPU kernels that no CPU tier runs, and the registry lacks
# vLLM 0.34.0's pin of it (0.7.3).
LEFT_OUT = ("torchvision", "torchaudio", "torchcodec", "flashinfer-python")
COMPLETE = ".kiln-complete"
BASE_PTH = "kiln-test-base.pth"
# A fork venv unused this long is removed when another is made (each holds a whole vllm).
STALE_S = 24 * 3600


def _requires_dist(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist lines without extras."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = zf.read(name).decode()
    head = metadata.partition("\n\n")[0]
    return [line[len("Requires-Dist: "):] for line in head.splitlines()
            if line.startswith("Requires-Dist: ") and "extra ==" not in line]


def runtime_requirements(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist without extras, torch and the left-out packages."""
    return [r for r in _requires_dist(wheel)
            if requirement_name(r) not in LEFT_OUT and requirement_name(r) != "torch"]


def torch_requirement(wheel: Path) -> str:
    """The torch the wheel pins. 2.13.0 (vLLM 0.32.0's) is the CPU build on this machine's
    disk; a newer pin comes from the registry, whose Linux wheels are CUDA builds that
    also run on a CPU."""
    pins = [r for r in _requires_dist(wheel) if requirement_name(r) == "torch"]
    if len(pins) != 1 or "==" not in pins[0]:
        raise KilnError(f"{wheel.name}: expected one exact torch pin in Requires-Dist, "
                        f"found {pins or 'none'}")
    return pins[0].split(";")[0].strip()


def upstream_version(wheel: Path) -> str:
    """The upstream release a wheel is, or is built on: vllm-0.33.0+kiln.3-... -> 0.33.0."""
    parts = wheel.name.split("-")
    if len(parts) < 5 or not wheel.name.endswith(".whl"):
        raise KilnError(f"{wheel.name}: not a wheel file name (name-version-python-abi-platform.whl)")
    return parts[1].split("+")[0]


def venv_key(torch: str, requirements: list[str], test_requirements: str) -> str:
    text = "\n".join([sys.version, torch, *requirements, test_requirements])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _run(cmd: list[str], what: str, log) -> None:
    log(f"{what}: {' '.join(cmd[:4])} ...")
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise KilnError(f"{what} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")


def test_venv(wheel: Path, log=print) -> Path:
    """Path of a complete test venv for this wheel's requirements (made if missing)."""
    requirements, torch = runtime_requirements(wheel), torch_requirement(wheel)
    test_reqs = (REPO_ROOT / "requirements" / "test.txt").read_text()
    path = cache_dir() / "venvs" / f"test-{venv_key(torch, requirements, test_reqs)}"
    if (path / COMPLETE).exists():
        return path
    shutil.rmtree(path, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    python = str(path / "bin" / "python")
    reqs_file = path.parent / f"{path.name}.requirements.txt"
    with naming(reqs_file):
        reqs_file.write_text("\n".join(requirements) + "\n")
    _run([sys.executable, "-m", "venv", str(path)], "create the test venv", log)
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    _run([*pip, torch], f"install {torch}", log)
    _run([*pip, "-r", str(reqs_file), "-r", str(REPO_ROOT / "requirements" / "test.txt")],
         "install the fork's dependencies and the test tools", log)
    with naming(path / COMPLETE):
        (path / COMPLETE).write_text(wheel.name + "\n")
    return path


def _site_packages(venv: Path) -> Path:
    """The venv's site-packages (its Python is the one running kiln: test_venv made it)."""
    return Path(sysconfig.get_path("purelib", vars={"base": str(venv)}))


def fork_venv(base: Path, wheels: list[Path], log=print) -> Path:
    """A complete venv with exactly these wheels installed over the base venv's packages
    (made if missing). The base's own site-packages come after the wheels' on sys.path,
    and its pip is the one that runs, so nothing is ever installed into the base."""
    digest = hashlib.sha256(str(base).encode())
    for wheel in wheels:
        digest.update(wheel.name.encode() + b"\0" + hashlib.sha256(wheel.read_bytes()).digest())
    path = base.parent / f"fork-{digest.hexdigest()[:16]}"
    if (path / COMPLETE).exists():
        (path / COMPLETE).touch()
        return path
    _remove_stale(base.parent, keep=path)
    shutil.rmtree(path, ignore_errors=True)
    _run([str(base / "bin" / "python"), "-m", "venv", "--without-pip", str(path)],
         "create the fork venv", log)
    site = _site_packages(path)
    with naming(site / BASE_PTH):
        (site / BASE_PTH).write_text(f"{_site_packages(base)}\n")
    _run([str(path / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
          "-q", "--no-deps", *map(str, wheels)], f"install {', '.join(w.name for w in wheels)}",
         log)
    with naming(path / COMPLETE):
        (path / COMPLETE).write_text("".join(f"{w.name}\n" for w in wheels))
    return path


def _remove_stale(folder: Path, keep: Path) -> None:
    now = time.time()
    for venv in folder.glob("fork-*"):
        marker = venv / COMPLETE
        if venv != keep and marker.exists() and now - marker.stat().st_mtime > STALE_S:
            shutil.rmtree(venv, ignore_errors=True)
