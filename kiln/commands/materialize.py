"""Create the git view of the series for editing.

The first commit is the pristine sdist tree, tagged v<version>; then one
commit per topic, in series order, on branch fork/<version>, each with the
patch header as its message. Edit there (commit --amend, rebase -i), then
`python -m kiln export --from DIR [--version V]`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kiln.upstream.fetch import fetch
from kiln.upstream.lock import add_version_option, pinned_version
from kiln.series.materialize import fork_branch, materialize
from kiln.upstream.pristine import PristineTree
from kiln.series.series import Series, series_dir

NAME = "materialize"
HELP = "git repository: pristine tag + one commit per topic"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--into", type=Path, required=True, help="new folder for the repository")
    add_version_option(parser, "upstream version whose series to use (default: the lock's default)")


def run(args: argparse.Namespace) -> int:
    pristine = PristineTree.from_files(fetch(pinned_version(args.version)))
    series = Series.load(series_dir(pristine.version))
    print(f"materializing vLLM {pristine.version} + {len(series.topics)} topic(s) in {args.into}")
    materialize(pristine.root, pristine.version, series, args.into)
    print(f"branch {fork_branch(pristine.version)} ready in {args.into}")
    return 0
