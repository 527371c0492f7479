"""Build the fork wheel and the fork's xgrammar wheels into dist/.

Writes dist/vllm-<upstream>+kiln.N-...whl (pristine upstream wheel + series +
overlay; see kiln/build/version.py for N; two builds of one commit are
byte-identical; a tree with uncommitted changes builds a version ending in .dirty) and
dist/xgrammar-0.2.8+kiln.N-cp3XY-cp3XY-manylinux_2_X_x86_64.whl for each supported
Python (the xgrammar sdist + patches/xgrammar/, built with CMake and ninja, cached
by the hash of its inputs; see `build-xgrammar`). Every Python is looked for before
anything is built. Install with requirements/xgrammar-constraints.txt and
--find-links, as the README shows: pip takes the xgrammar wheel for its Python.
"""

from __future__ import annotations

import argparse
import sys

from kiln.build.wheel import build_wheel
from kiln.build.xgrammar import PYTHONS, build_xgrammar, find_pythons, parse_pythons
from kiln.cmdoptions import add_dist_option, add_python_option, add_version_option
from kiln.commands.build_xgrammar import report
from kiln.errors import KilnError
from kiln.upstream.lock import UpstreamLock

NAME = "build"
HELP = "build the fork wheel into dist/"
CONSTRAINTS = "requirements/xgrammar-constraints.txt"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dist_option(parser)
    add_version_option(parser, "upstream pin to build on, with its series patches/<version>/ "
                       "(default: the lock's default)")
    parser.add_argument("--no-xgrammar", action="store_true",
                        help="build only the vllm wheel (the xgrammar builds take minutes cold)")
    add_python_option(parser)


def run(args: argparse.Namespace) -> int:
    if args.no_xgrammar and args.python:
        raise KilnError("--python picks the xgrammar builds; it has no use with --no-xgrammar")
    lock = UpstreamLock.load()
    version = lock.release(args.version).version
    pythons = None if args.no_xgrammar else find_pythons(parse_pythons(args.python or PYTHONS))
    build = build_wheel(args.out, version=version, lock=lock)
    print(f"built {build.path} in {build.seconds:.0f} s "
          f"({len(build.topics)} topic(s), {len(build.patched)} patched file(s), "
          f"{len(build.added)} added file(s))")
    if pythons is None:
        print(f"install it with: pip install '{build.path}'")
        return 0
    report(build_xgrammar(args.out, pythons, log=lambda m: print(m, file=sys.stderr, flush=True)))
    print(f"install both with: pip install -c {CONSTRAINTS} --find-links '{args.out}' "
          f"'{build.path}' xgrammar")
    return 0
