"""Make (or reuse) the cached test virtualenv for a built wheel, with the wheel installed.

The base venv holds CPU torch 2.13.0, the wheel's own requirements (less
torchvision, torchaudio and torchcodec, which fail beside CPU torch) and
requirements/test.txt; the printed venv adds this build's wheel on top of it. With
--xgrammar, the fork's xgrammar wheel shadows the stock xgrammar that the requirements
brought, as the README's install line replaces it. Prints the venv's folder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kiln.errors import KilnError
from kiln.lock import UpstreamLock
from kiln.testenv import fork_venv, test_venv, upstream_version

NAME = "test-env"
HELP = "the cached test virtualenv, with the given wheel installed"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wheel", type=Path, required=True, help="the fork wheel to install")
    parser.add_argument("--xgrammar", type=Path, metavar="WHEEL",
                        help="the fork's xgrammar wheel (from `kiln build`) to install over stock")
    parser.add_argument("--version", help="upstream pin the wheel must be built on; its torch "
                        "pin chooses the venv's torch (default: the lock's default)")


def run(args: argparse.Namespace) -> int:
    for wheel in (args.wheel, args.xgrammar):
        if wheel is not None and not wheel.is_file():
            raise KilnError(f"{wheel}: no such wheel; build one with `python -m kiln build`")
    pin = UpstreamLock.load().release(args.version).version
    built_on = upstream_version(args.wheel)
    if built_on != pin:
        raise KilnError(f"{args.wheel.name} is built on vLLM {built_on}, not on the pin {pin}; "
                        f"build one with `python -m kiln build --version {pin}` or pass "
                        f"--version {built_on}")
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731  stdout carries only the path
    base = test_venv(args.wheel, log=log)
    wheels = [args.wheel] + ([args.xgrammar] if args.xgrammar is not None else [])
    print(fork_venv(base, wheels, log=log))
    return 0
