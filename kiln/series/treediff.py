"""Compare two directory trees file by file."""

from __future__ import annotations

import filecmp
from pathlib import Path

IGNORED = (".git",)


def _files(root: Path) -> set[str]:
    return {
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if (p.is_file() or p.is_symlink()) and p.relative_to(root).parts[0] not in IGNORED
    }


def differing_files(a: Path, b: Path) -> list[str]:
    """Paths present in only one tree or with different bytes, sorted."""
    fa, fb = _files(a), _files(b)
    differ = (fa ^ fb) | {p for p in fa & fb if not filecmp.cmp(a / p, b / p, shallow=False)}
    return sorted(differ)
