"""Print the table of carried topics from the patch headers, or refresh README.md's copy."""

from __future__ import annotations

import argparse

from kiln.paths import REPO_ROOT
from kiln.series import Series
from kiln.topics import topics_table, update_readme

NAME = "topics"
HELP = "the carried topics as a Markdown table"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--update-readme", action="store_true",
                        help="rewrite the generated table in README.md")


def run(args: argparse.Namespace) -> int:
    series = Series.load()
    if args.update_readme:
        readme = REPO_ROOT / "README.md"
        readme.write_text(update_readme(readme.read_text(), series))
        print(f"updated the topics table in {readme}")
    else:
        print(topics_table(series), end="")
    return 0
