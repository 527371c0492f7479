"""Configure and build the fork's csrc/ with CMake + ninja (see CMakeLists.txt)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from kiln.errors import KilnError


def build_csrc(root: Path, build_dir: Path, log=print) -> dict[str, Path]:
    """Wheel path -> built library; empty when CMakeLists.txt decided to skip."""
    if not any((root / "csrc").glob("*.cu")):
        log("csrc: skipped: the fork has no CUDA sources")
        return {}
    cmake = shutil.which("cmake")
    if cmake is None:
        raise KilnError("csrc/ has CUDA sources but cmake is not installed (pip install cmake ninja)")
    install = build_dir / "install"
    steps = [
        [cmake, "-S", str(root), "-B", str(build_dir), "-G", "Ninja",
         f"-DPython_EXECUTABLE={sys.executable}", f"-DCMAKE_INSTALL_PREFIX={install}"],
        [cmake, "--build", str(build_dir)],
        [cmake, "--install", str(build_dir)],
    ]
    for step in steps:
        result = subprocess.run(step, capture_output=True, text=True)
        for line in result.stdout.splitlines():
            if "kiln:" in line:
                log("csrc: " + line.split("kiln:", 1)[1].strip())
        if result.returncode != 0:
            raise KilnError(f"building csrc/ failed at {' '.join(step[:3])}:\n{result.stderr[-3000:]}")
    return {p.relative_to(install).as_posix(): p for p in sorted(install.rglob("*.so"))}
