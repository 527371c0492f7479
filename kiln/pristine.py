"""PristineTree: the upstream sdist unpacked once into the cache, never edited."""

from __future__ import annotations

import os
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kiln.fetch import PristineFiles
from kiln.paths import cache_dir


@dataclass(frozen=True)
class PristineTree:
    version: str
    root: Path

    @classmethod
    def from_files(cls, files: PristineFiles) -> PristineTree:
        pin = files.release.sdist
        target = cache_dir() / "trees" / f"vllm-{files.release.version}-{pin.sha256[:12]}"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                with tarfile.open(files.sdist) as tar:
                    tar.extractall(tmp, filter="data")
                (top,) = Path(tmp).iterdir()
                os.replace(top, target)
        return cls(version=files.release.version, root=target)

    def files(self) -> list[str]:
        """Every file path of the tree, relative and sorted."""
        return sorted(
            p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file()
        )
