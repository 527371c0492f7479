"""Build the fork wheel and the fork's xgrammar wheel into dist/.

Writes dist/vllm-<upstream>+kiln.N-...whl (pristine upstream wheel + series +
overlay; see kiln/version.py for N; two builds of one commit are byte-identical;
a tree with uncommitted changes builds a version ending in .dirty) and
dist/xgrammar-0.2.8+kiln.N-...whl (the xgrammar sdist + patches/xgrammar/, built
with CMake and ninja, cached by the hash of its inputs). Install both with
requirements/xgrammar-constraints.txt, as the README shows.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kiln.paths import REPO_ROOT
from kiln.wheel import build_wheel
from kiln.xgrammar import build_xgrammar

NAME = "build"
HELP = "build the fork wheel into dist/"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "dist",
                        help="output folder (default: dist/)")
    parser.add_argument("--version", help="upstream pin to build on, with its series "
                        "patches/<version>/ (default: the lock's default)")
    parser.add_argument("--no-xgrammar", action="store_true",
                        help="build only the vllm wheel (the xgrammar build takes minutes cold)")


def run(args: argparse.Namespace) -> int:
    build = build_wheel(args.out, version=args.version)
    print(f"built {build.path} in {build.seconds:.0f} s "
          f"({len(build.topics)} topic(s), {len(build.patched)} patched file(s), "
          f"{len(build.added)} added file(s))")
    if args.no_xgrammar:
        print(f"install it with: pip install '{build.path}'")
        return 0
    xgrammar = build_xgrammar(args.out)
    print(f"built {xgrammar.path} in {xgrammar.seconds:.0f} s"
          f"{' (cached)' if xgrammar.cached else ''}")
    print("install both with: pip install -c requirements/xgrammar-constraints.txt "
          f"'{build.path}' '{xgrammar.path}'")
    return 0
