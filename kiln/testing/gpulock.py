"""requirements/gpu-bundle.lock: the wheels the GPU bundle carries, by sha256.

They are the packages a CUDA machine with torch preinstalled lacks, for its Python
(3.12) and platform, which need not be this machine's: pip downloads them by
explicit tags, and the bundle's installer installs them by the same tags.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError
from kiln.paths import REPO_ROOT
from kiln.tomlfile import read_toml
from kiln.upstream.fetch import fetch_pinned, pip_download
from kiln.upstream.lock import PinnedFile

LOCK_PATH = REPO_ROOT / "requirements" / "gpu-bundle.lock"


@dataclass(frozen=True)
class GpuWheel:
    project: str
    pin: PinnedFile

    @property
    def version(self) -> str:
        # A wheel's file name is {distribution}-{version}(-{build})?-{python}-{abi}-{platform}.
        return self.pin.name.split("-")[1]


@dataclass(frozen=True)
class GpuBundleLock:
    python_version: str
    platforms: tuple[str, ...]
    wheels: tuple[GpuWheel, ...]

    @classmethod
    def load(cls, path: Path = LOCK_PATH) -> GpuBundleLock:
        data = read_toml(path, "missing; it pins the wheels the GPU bundle carries")
        try:
            wheels = tuple(GpuWheel(project, PinnedFile.from_table(entry, "wheel"))
                           for project, entry in sorted(data["wheels"].items()))
            return cls(str(data["python_version"]), tuple(data["platforms"]), wheels)
        except KeyError as e:
            raise KilnError(
                f"{path}: lacks {e.args[0]}; it needs python_version, platforms and "
                "[wheels.NAME] tables of wheel and wheel_sha256"
            ) from None

    def fetch(self, log=print) -> list[Path]:
        """Every pinned wheel, verified, from the cache or downloaded into it."""
        return [
            fetch_pinned(w.pin, lambda dest, w=w: pip_download(
                w.pin, f"{w.project}=={w.version}", dest,
                python_version=self.python_version, platforms=self.platforms), log,
                f"{LOCK_PATH} ({w.project})")
            for w in self.wheels
        ]
