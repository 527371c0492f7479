"""Apply the series to the pristine sdist tree at fuzz 0, into a new folder.

Offsets are reported and accepted; a hunk that needs fuzz or fails stops the
apply, naming topic, file and hunk. The folder appears only when every topic
applied.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kiln.cmdoptions import add_version_option
from kiln.series.patching import apply_series_into
from kiln.series.pinned import PinnedSeries

NAME = "apply"
HELP = "pristine upstream + the series, into a new folder"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--into", type=Path, required=True, help="folder to create")
    add_version_option(parser, "upstream version (default: the lock's default)")


def run(args: argparse.Namespace) -> int:
    pin = PinnedSeries.load(args.version)

    def progress(topic, offsets):
        print(f"applied {topic.name}")
        for offset in offsets:
            print(f"  {offset}")

    apply_series_into(pin.pristine.root, pin.series, args.into, on_topic=progress)
    print(f"{len(pin.series.topics)} topic(s) applied to vLLM {pin.version} in {args.into}")
    return 0
