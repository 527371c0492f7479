"""Download the pristine upstream wheel and sdist, checked against requirements/upstream.lock.

Files are cached outside the repository (~/.cache/kiln, or $KILN_CACHE) and
re-checked against their pinned sha256 on every use.
"""

from __future__ import annotations

import argparse

from kiln.cmdoptions import add_version_option
from kiln.upstream.fetch import fetch

NAME = "fetch"
HELP = "download and verify the pristine upstream wheel and sdist"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_version_option(parser, "upstream version (default: the lock's default)")


def run(args: argparse.Namespace) -> int:
    files = fetch(args.version)
    print(f"wheel: {files.wheel}\nsdist: {files.sdist}")
    return 0
