"""Check the series against the real pristine tree.

The series and patches/ agree both ways; every header is complete; topics
touch only vllm/; overlay paths are not upstream paths; the series applies at
fuzz 0; materialize then export changes 0 bytes; pristine + series equals the
branch tree (a fresh materialization, or --branch-repo) with 0 differing files;
every call into the compiled attention ops binds to fa2/schemas/<version>.txt.
"""

from __future__ import annotations

import argparse
import zipfile
from pathlib import Path

from kiln.fa2 import Snapshot
from kiln.fetch import fetch
from kiln.paths import REPO_ROOT
from kiln.pristine import PristineTree
from kiln.verify import verify

NAME = "verify"
HELP = "prove the series applies and round-trips exactly"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--branch-repo", type=Path,
                        help="compare against this materialized repository's branch")


def run(args: argparse.Namespace) -> int:
    files = fetch()
    with zipfile.ZipFile(files.wheel) as wheel:
        wheel_files = wheel.namelist()
    report = verify(PristineTree.from_files(files), REPO_ROOT / "patches",
                    branch_repo=args.branch_repo, wheel_files=wheel_files,
                    fa2=Snapshot.load(files.release.version))
    for name, ok, detail in report.checks:
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
        if detail and (not ok or "offset" in detail or "checked" in detail):
            print("     " + detail.replace("\n", "\n     "))
    return 0 if report.ok else 1
