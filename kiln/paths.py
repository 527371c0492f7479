"""Where things live: the repository root and the cache outside it."""

from __future__ import annotations

import os
from pathlib import Path

from kiln.errors import KilnError

REPO_ROOT = Path(__file__).resolve().parent.parent


def cache_dir() -> Path:
    """Downloads, extracted trees and virtualenvs, kept outside the repository."""
    root = os.environ.get("KILN_CACHE") or Path.home() / ".cache" / "kiln"
    path = Path(root).expanduser()
    if path.exists() and not path.is_dir():
        raise KilnError(f"the cache {path} (KILN_CACHE, default ~/.cache/kiln) is not a folder; "
                        "point KILN_CACHE at a folder")
    path.mkdir(parents=True, exist_ok=True)
    return path
