"""Print the table of carried topics from the patch headers, or refresh README.md's copy."""

from __future__ import annotations

import argparse

from kiln.cmdoptions import add_version_option
from kiln.errors import KilnError, naming
from kiln.paths import REPO_ROOT
from kiln.series.series import Series, series_dir
from kiln.series.topics import topics_table, update_readme
from kiln.upstream.lock import UpstreamLock

NAME = "topics"
HELP = "the carried topics as a Markdown table"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--update-readme", action="store_true",
                        help="rewrite the generated table in README.md (the default pin's)")
    add_version_option(parser, "upstream version whose series to use (default: the lock's default)")


def run(args: argparse.Namespace) -> int:
    lock = UpstreamLock.load()
    series = Series.load(series_dir(args.version, lock=lock))  # refuses a pin the lock lacks
    if args.update_readme:
        if args.version not in (None, lock.default):
            raise KilnError(f"--update-readme: README.md lists the default pin's topics "
                            f"({lock.default}), not {args.version}'s")
        readme = REPO_ROOT / "README.md"
        with naming(readme):
            readme.write_text(update_readme(readme.read_text(), series))
        print(f"updated the topics table in {readme}")
    else:
        print(topics_table(series), end="")
    return 0
