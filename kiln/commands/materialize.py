"""Create the git view of the series for editing.

The first commit is the pristine sdist tree, tagged v<version>; then one
commit per topic, in series order, on branch fork/<version>, each with the
patch header as its message. Edit there (commit --amend, rebase -i), then
`python -m kiln export --from DIR [--version V]`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kiln.cmdoptions import add_version_option
from kiln.series.materialize import fork_branch, materialize
from kiln.series.pinned import PinnedSeries

NAME = "materialize"
HELP = "git repository: pristine tag + one commit per topic"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--into", type=Path, required=True, help="new folder for the repository")
    add_version_option(parser, "upstream version whose series to use (default: the lock's default)")


def run(args: argparse.Namespace) -> int:
    pin = PinnedSeries.load(args.version)
    print(f"materializing vLLM {pin.version} + {len(pin.series.topics)} topic(s) in {args.into}")
    materialize(pin.pristine.root, pin.version, pin.series, args.into)
    print(f"branch {fork_branch(pin.version)} ready in {args.into}")
    return 0
