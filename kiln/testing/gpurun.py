"""The GPU bundle's steps on the GPU machine, called by the bundle's ``run`` script.

This file travels inside the bundle (src/kiln) and runs there with the machine's own
Python, before anything is installed: standard library only, torch imported only to
read what the machine has.

    python3 -m kiln.testing.gpurun check BUNDLE MACHINE_JSON      refuse a machine it cannot run on
    python3 -m kiln.testing.gpurun install BUNDLE SITE            verify the bundle, lay out SITE
    python3 -m kiln.testing.gpurun summary BUNDLE MACHINE_JSON RESULTS STATUS START

A refusal (or a broken bundle) is one line on stderr and exit status 3.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass
from pathlib import Path

from kiln.errors import KilnError, naming

# The bundle's layout, shared with kiln/testing/gpubundle.py, which writes it.
MANIFEST = "manifest.json"
PYTHON_TREE = "vllm-python.tar.xz"
COMPILED = "compiled"  # compiled/<path in the wheel>.xz
STANDINS = "standins"  # standins/<path in the wheel>
WHEELS = "wheels"
SOURCES = "src"
RUN = "run"

MIN_TORCH = (2, 11)
REFUSED = 3
# The device tool hands back at most this many files from a results folder.
MAX_RESULT_FILES = 8
VLLM_LAUNCHER = """#!/usr/bin/env python3
import sys
from vllm.entrypoints.cli.main import main
sys.exit(main())
"""


@dataclass(frozen=True)
class Machine:
    """What the GPU machine has, as its own Python and torch report it."""

    python: str
    torch: str | None = None  # None: torch does not import
    torch_cuda: str | None = None  # None: a CPU build
    triton: str | None = None
    gpus: int = 0
    device: str | None = None
    capability: str | None = None  # "9.0"
    glibc: str | None = None  # "2.39"; None: not a glibc system, or unknown

    @classmethod
    def read(cls) -> Machine:
        python = ".".join(map(str, sys.version_info[:3]))
        glibc = glibc_version()
        try:
            import torch
        except ImportError:
            return cls(python, glibc=glibc)
        try:
            import triton
            triton_version = triton.__version__
        except ImportError:
            triton_version = None
        cuda = torch.version.cuda
        gpus = torch.cuda.device_count() if cuda else 0
        if not gpus:
            return cls(python, torch.__version__, cuda, triton_version, glibc=glibc)
        major, minor = torch.cuda.get_device_capability(0)
        return cls(python, torch.__version__, cuda, triton_version, gpus,
                   torch.cuda.get_device_name(0), f"{major}.{minor}", glibc)


def glibc_version() -> str | None:
    """This machine's glibc version ("2.39"), or None where the C library is not glibc."""
    try:
        name, _, version = (os.confstr("CS_GNU_LIBC_VERSION") or "").partition(" ")
    except (ValueError, OSError):
        return None
    return version if name == "glibc" else None


def load_manifest(bundle: Path) -> dict:
    try:
        return json.loads((bundle / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise KilnError(f"{bundle}: no readable {MANIFEST} ({e}); is this a GPU bundle?") from None


def gpu_visible() -> bool:
    """An NVIDIA GPU the driver exposes, whatever Python and torch are there."""
    if glob.glob("/dev/nvidia[0-9]*"):
        return True
    if shutil.which("nvidia-smi"):
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        return listed.returncode == 0 and "GPU " in listed.stdout
    return False


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:2])


def refusal(machine: Machine, manifest: dict) -> str | None:
    """Why the bundle cannot run on this machine, or None when it can."""
    python = manifest["python_version"]
    archs = manifest["archs"]
    built_for = ", ".join(f"sm_{a}" for a in archs)
    if _version(machine.python) != _version(python):
        return (f"this is Python {machine.python}; the bundle's wheels are for Python "
                f"{python} (set KILN_PYTHON to another interpreter)")
    glibc = manifest.get("glibc")
    if glibc and machine.glibc and _version(machine.glibc) < _version(glibc):
        return (f"this machine's glibc is {machine.glibc}; the bundle's wheels need glibc "
                f">= {glibc} (their manylinux tags)")
    if machine.torch is None:
        return f"no torch in Python {machine.python}; a CUDA build of torch >= 2.11 is needed"
    if machine.torch_cuda is None:
        return f"torch {machine.torch} is a CPU build; a CUDA build of torch >= 2.11 is needed"
    if _version(machine.torch) < MIN_TORCH:
        return f"torch {machine.torch} is older than 2.11, the oldest the bundle runs on"
    if not machine.gpus:
        return f"torch {machine.torch} (CUDA {machine.torch_cuda}) sees no CUDA GPU"
    arch = int(machine.capability.replace(".", ""))
    if arch not in archs:
        return (f"the GPU is {machine.device}, compute capability {machine.capability} "
                f"(sm_{arch}); the bundle was built for {built_for}: build one with "
                f"`python3 -m kiln gpu-bundle --arch {arch}`")
    return None


def check(bundle: Path, machine_json: Path) -> None:
    """Refuse a machine the bundle cannot run on; record what it is otherwise."""
    manifest = load_manifest(bundle)
    if not gpu_visible():
        raise KilnError("no CUDA GPU on this machine (no /dev/nvidia* device and none "
                        "listed by nvidia-smi); the bundle runs only where an NVIDIA GPU is")
    machine = Machine.read()
    reason = refusal(machine, manifest)
    if reason:
        raise KilnError(reason)
    with naming(machine_json):
        machine_json.write_text(json.dumps(asdict(machine), indent=1) + "\n")
    print(f"kiln gpu bundle: {machine.device} (sm_{machine.capability.replace('.', '')}), "
          f"torch {machine.torch}, triton {machine.triton}, fork {manifest['fork_version']}",
          file=sys.stderr)


def damaged_files(bundle: Path, manifest: dict) -> list[str]:
    """Files whose size or sha256 differs from the manifest's (a broken copy)."""
    damaged = []
    for rel, expected in manifest["files"].items():
        path = bundle / rel
        if (not path.is_file() or path.stat().st_size != expected["size"]
                or hashlib.sha256(path.read_bytes()).hexdigest() != expected["sha256"]):
            damaged.append(rel)
    return damaged


def install(bundle: Path, site: Path) -> None:
    """The pinned wheels, the wheel's Python tree, the compiled files and the stand-ins, in SITE."""
    manifest = load_manifest(bundle)
    damaged = damaged_files(bundle, manifest)
    if damaged:
        raise KilnError(f"{len(damaged)} file(s) of the bundle differ from its manifest "
                        f"(copied incompletely?): {', '.join(damaged[:10])}")
    site.mkdir(parents=True, exist_ok=True)
    wheels = sorted(str(p) for p in (bundle / WHEELS).glob("*.whl"))
    # The same tags the wheels were downloaded for, so pip installs exactly these files.
    tags = ["--python-version", manifest["python_version"], "--implementation", "cp",
            "--only-binary=:all:",
            *(a for p in manifest["platforms"] for a in ("--platform", p))]
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet",
         "--disable-pip-version-check", "--target", str(site), *tags, *wheels],
        capture_output=True, text=True, env={**os.environ, "PIP_ROOT_USER_ACTION": "ignore"},
    )
    if result.returncode != 0:
        raise KilnError(f"pip could not install the bundle's wheels:\n{result.stderr[-3000:]}")
    with tarfile.open(bundle / PYTHON_TREE) as tree, naming(site):
        tree.extractall(site, filter="data")
    for packed in sorted((bundle / COMPILED).rglob("*.xz")):
        target = site / packed.relative_to(bundle / COMPILED).with_suffix("")
        target.parent.mkdir(parents=True, exist_ok=True)
        with naming(target):
            target.write_bytes(lzma.decompress(packed.read_bytes()))
        target.chmod(0o755)
    for standin in sorted(p for p in (bundle / STANDINS).rglob("*") if p.is_file()):
        target = site / standin.relative_to(bundle / STANDINS)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(standin, target)
    # `vllm serve` as an installed wheel gives it (pip wrote the other wheels' scripts).
    launcher = site / "bin" / "vllm"
    launcher.parent.mkdir(exist_ok=True)
    with naming(launcher):
        launcher.write_text(VLLM_LAUNCHER)
    launcher.chmod(0o755)


def junit_counts(junit: Path) -> dict[str, int] | None:
    """passed, failed, skipped and errors over every test suite of a JUnit XML report."""
    try:
        root = ElementTree.parse(junit).getroot()
    except (OSError, ElementTree.ParseError):
        return None
    suites = list(root.iter("testsuite"))
    total = {k: sum(int(s.get(k, 0)) for s in suites)
             for k in ("tests", "failures", "errors", "skipped")}
    return {
        "passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
        "failed": total["failures"],
        "skipped": total["skipped"],
        "errors": total["errors"],
    }


def summary(bundle: Path, machine_json: Path, results: Path, status: int, start: float) -> dict:
    """Write RESULTS/summary.json: the machine, the fork, the counts and the exit status."""
    manifest = load_manifest(bundle)
    machine = json.loads(machine_json.read_text())
    data = {
        "device": machine["device"],
        "capability": machine["capability"],
        "python": machine["python"],
        "torch": machine["torch"],
        "triton": machine["triton"],
        "fork_version": manifest["fork_version"],
        "archs": manifest["archs"],
        "counts": junit_counts(results / "junit.xml"),
        "wall_seconds": round(time.time() - start, 1),
        "exit_status": status,
    }
    with naming(results / "summary.json"):
        (results / "summary.json").write_text(json.dumps(data, indent=1) + "\n")
    files = sorted(str(p.relative_to(results)) for p in results.rglob("*") if p.is_file())
    if len(files) > MAX_RESULT_FILES:
        print(f"kiln gpu bundle: warning: {len(files)} files in {results}, more than the "
              f"{MAX_RESULT_FILES} the device tool hands back: {', '.join(files)}", file=sys.stderr)
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m kiln.testing.gpurun", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    step = sub.add_parser("check")
    step.add_argument("bundle", type=Path)
    step.add_argument("machine_json", type=Path)
    step = sub.add_parser("install")
    step.add_argument("bundle", type=Path)
    step.add_argument("site", type=Path)
    step = sub.add_parser("summary")
    step.add_argument("bundle", type=Path)
    step.add_argument("machine_json", type=Path)
    step.add_argument("results", type=Path)
    step.add_argument("status", type=int)
    step.add_argument("start", type=float)
    args = parser.parse_args(argv)
    try:
        if args.step == "check":
            check(args.bundle, args.machine_json)
        elif args.step == "install":
            install(args.bundle, args.site)
        else:
            summary(args.bundle, args.machine_json, args.results, args.status, args.start)
    except KilnError as e:
        what = "refused" if args.step == "check" else "error"
        print(f"kiln gpu bundle: {what}: {e}", file=sys.stderr)
        return REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main())
