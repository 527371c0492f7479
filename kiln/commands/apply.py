"""Apply the series to the pristine sdist tree at fuzz 0, into a new folder.

Offsets are reported and accepted; a hunk that needs fuzz or fails stops the
apply, naming topic, file and hunk. The folder appears only when every topic
applied.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kiln.upstream.fetch import fetch
from kiln.upstream.lock import add_version_option, pinned_version
from kiln.series.patching import apply_series_into
from kiln.upstream.pristine import PristineTree
from kiln.series.series import Series, series_dir

NAME = "apply"
HELP = "pristine upstream + the series, into a new folder"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--into", type=Path, required=True, help="folder to create")
    add_version_option(parser, "upstream version (default: the lock's default)")


def run(args: argparse.Namespace) -> int:
    pristine = PristineTree.from_files(fetch(pinned_version(args.version)))
    series = Series.load(series_dir(pristine.version))

    def progress(topic, offsets):
        print(f"applied {topic.name}")
        for offset in offsets:
            print(f"  {offset}")

    apply_series_into(pristine.root, series, args.into, on_topic=progress)
    print(f"{len(series.topics)} topic(s) applied to vLLM {pristine.version} in {args.into}")
    return 0
