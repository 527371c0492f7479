"""Make (or reuse) the cached test virtualenv for a built wheel, with the wheel installed.

The base venv holds the torch the wheel pins, the wheel's own requirements (less
torchvision, torchaudio and torchcodec, which fail beside CPU torch, and flashinfer,
whose GPU kernels no CPU tier runs) and
requirements/test.txt; the printed venv adds this build's wheel on top of it. With
--xgrammar, the fork's xgrammar wheel for the venv's Python (given one or several,
e.g. all of dist/xgrammar-*.whl) shadows the stock xgrammar that the requirements
brought, as the README's install line replaces it. Prints the venv's folder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kiln.build.xgrammar import wheel_for_python
from kiln.cmdoptions import add_version_option, pinned_version
from kiln.errors import KilnError
from kiln.testing.testenv import fork_venv, test_venv, upstream_version

NAME = "test-env"
HELP = "the cached test virtualenv, with the given wheel installed"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wheel", type=Path, required=True, help="the fork wheel to install")
    parser.add_argument("--xgrammar", type=Path, nargs="+", metavar="WHEEL",
                        help="the fork's xgrammar wheels (from `kiln build`); the one for the "
                        "venv's Python is installed over stock")
    add_version_option(parser, "upstream pin the wheel must be built on; its torch pin "
                       "chooses the venv's torch (default: the lock's default)")


def run(args: argparse.Namespace) -> int:
    pin = pinned_version(args.version)
    for wheel in (args.wheel, *(args.xgrammar or ())):
        if not wheel.is_file():
            raise KilnError(f"{wheel}: no such wheel; build one with `python -m kiln build`")
    built_on = upstream_version(args.wheel)
    if built_on != pin:
        raise KilnError(f"{args.wheel.name} is built on vLLM {built_on}, not on the pin {pin}; "
                        f"build one with `python -m kiln build --version {pin}` or pass "
                        f"--version {built_on}")
    # The venv is made from this interpreter, so its Python is this one's.
    wheels = [args.wheel]
    if args.xgrammar:
        wheels.append(wheel_for_python(args.xgrammar, "{}.{}".format(*sys.version_info[:2])))
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731  stdout carries only the path
    base = test_venv(args.wheel, log=log)
    print(fork_venv(base, wheels, log=log))
    return 0
