"""Build the fork's xgrammar wheel (xgrammar-0.2.8+kiln.N) into dist/.

Fetches the xgrammar sdist pinned in requirements/xgrammar.lock, applies the series
in patches/xgrammar/ (GNU patch, fuzz 0) and builds it with CMake and ninja. The
build is cached under $KILN_CACHE (default ~/.cache/kiln), keyed by the hashes of
the sdist, the patches and the build pins, so a rebuild of the same inputs is a copy.
Install it beside the fork wheel with requirements/xgrammar-constraints.txt.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kiln.paths import REPO_ROOT
from kiln.xgrammar import build_xgrammar

NAME = "build-xgrammar"
HELP = "build the fork's xgrammar wheel (0.2.8 + patches/xgrammar/) into dist/"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "dist",
                        help="output folder (default: dist/)")


def run(args: argparse.Namespace) -> int:
    build = build_xgrammar(args.out, log=lambda m: print(m, file=sys.stderr, flush=True))
    source = "reused the cached build" if build.cached else "built"
    print(f"{source} {build.path} ({build.version}, {len(build.topics)} patch(es)) "
          f"in {build.seconds:.0f} s")
    return 0
