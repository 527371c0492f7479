"""Build the fork wheel: pristine upstream wheel + series + overlay, reproducibly.

Writes dist/vllm-<upstream>+kiln.N-...whl (see kiln/version.py for N). Two
builds of one commit are byte-identical. A tree with uncommitted changes
builds a wheel whose version ends in .dirty.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kiln.paths import REPO_ROOT
from kiln.wheel import build_wheel

NAME = "build"
HELP = "build the fork wheel into dist/"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "dist",
                        help="output folder (default: dist/)")


def run(args: argparse.Namespace) -> int:
    build = build_wheel(args.out)
    print(f"built {build.path} in {build.seconds:.0f} s "
          f"({len(build.topics)} topic(s), {len(build.patched)} patched file(s), "
          f"{len(build.added)} added file(s))")
    print(f"install it with: pip install '{build.path}'")
    return 0
