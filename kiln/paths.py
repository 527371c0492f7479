"""Where things live: the repository root and the cache outside it."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def cache_dir() -> Path:
    """Downloads, extracted trees and virtualenvs, kept outside the repository."""
    root = os.environ.get("KILN_CACHE") or Path.home() / ".cache" / "kiln"
    path = Path(root).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path
