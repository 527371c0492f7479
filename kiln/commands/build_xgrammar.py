"""Build the fork's xgrammar wheels (xgrammar-0.2.8+kiln.N) into dist/, one per Python.

Fetches the xgrammar sdist pinned in requirements/xgrammar.lock, applies the series
in patches/xgrammar/ (GNU patch, fuzz 0) and builds it with CMake and ninja under
each supported CPython (3.11, 3.12, 3.13; --python picks some), found on PATH or
under pyenv; auditwheel then tags each wheel manylinux_2_X for the glibc it needs.
Each build is cached under $KILN_CACHE (default ~/.cache/kiln), keyed by the hashes
of the sdist, the patches, the build pins and that Python's version, so a rebuild of
the same inputs is a copy. A Python that is not found stops the command before
anything is built, naming it. Install beside the fork wheel with
requirements/xgrammar-constraints.txt and --find-links, as the README shows: pip
takes the wheel whose tags match its Python.
"""

from __future__ import annotations

import argparse
import sys

from kiln.build.xgrammar import PYTHONS, XgrammarBuild, build_xgrammar, find_pythons, parse_pythons
from kiln.cmdoptions import add_dist_option, add_python_option

NAME = "build-xgrammar"
HELP = "build the fork's xgrammar wheels (0.2.8 + patches/xgrammar/) into dist/"


def report(builds: list[XgrammarBuild]) -> None:
    for build in builds:
        source = "reused the cached build" if build.cached else "built"
        print(f"{source} {build.path} (Python {build.python}, {len(build.topics)} patch(es)) "
              f"in {build.seconds:.0f} s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dist_option(parser)
    add_python_option(parser)


def run(args: argparse.Namespace) -> int:
    pythons = find_pythons(parse_pythons(args.python or PYTHONS))
    report(build_xgrammar(args.out, pythons, log=lambda m: print(m, file=sys.stderr, flush=True)))
    return 0
