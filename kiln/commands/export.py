"""Write patches/<version>/ (patches and series) back from a materialized repository's branch.

One patch per commit since v<version> on fork/<version>. Exporting an
unchanged branch changes 0 bytes. A repository with uncommitted changes is
refused.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kiln.cmdoptions import add_version_option, pinned_version
from kiln.paths import REPO_ROOT
from kiln.series.materialize import export

NAME = "export"
HELP = "rewrite patches/<version>/ from a materialized branch"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="source", type=Path, required=True,
                        help="the materialized repository")
    add_version_option(parser, "whose branch (fork/<version>) to export into patches/<version>/ "
                       "(default: the lock's default; a rebase exports its --onto version)")


def run(args: argparse.Namespace) -> int:
    version = pinned_version(args.version)
    result = export(args.source, version, REPO_ROOT / "patches" / version)
    print(f"exported fork/{version} into patches/{version}/")
    for name in result.written:
        print(f"wrote {name}")
    for name in result.removed:
        print(f"removed {name}")
    print(f"{len(result.written)} file(s) written, {len(result.removed)} removed")
    return 0
