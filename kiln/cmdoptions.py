"""Options more than one command declares, each defined once here (as pip's cmdoptions):
a command adds them by name, so a flag reads and behaves the same wherever it appears."""

from __future__ import annotations

import argparse
from pathlib import Path

from kiln.build.xgrammar import PYTHONS
from kiln.paths import REPO_ROOT
from kiln.upstream.lock import UpstreamLock


def add_version_option(parser: argparse.ArgumentParser, help: str, *, repeat: bool = False) -> None:
    """``--version V``: an upstream pin, the one option every command that takes a pin
    declares (``repeat``: a list in ``args.versions``). Check it with the lock
    (``pinned_version``, ``UpstreamLock.release``) before any work, so a pin the lock
    lacks is refused before anything is fetched."""
    if repeat:
        parser.add_argument("--version", action="append", dest="versions", metavar="VERSION", help=help)
    else:
        parser.add_argument("--version", metavar="VERSION", help=help)


def pinned_version(version: str | None) -> str:
    """``version`` (None: the lock's default) when the lock pins it; otherwise one error
    line that names the pinned versions."""
    return UpstreamLock.load().release(version).version


def add_dist_option(parser: argparse.ArgumentParser) -> None:
    """``--out DIR``: where the built wheels go (default: dist/)."""
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "dist",
                        help="output folder (default: dist/)")


def add_python_option(parser: argparse.ArgumentParser) -> None:
    """``--python X.Y``: the Pythons to build xgrammar wheels for (``args.python``, a list
    of what was given, comma-separated or repeated; None: all)."""
    parser.add_argument("--python", action="append", metavar="X.Y",
                        help="build the xgrammar wheel only for these Pythons, repeatable or "
                        f"comma-separated: {', '.join(PYTHONS)} (default: all)")
