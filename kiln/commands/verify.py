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

from kiln.abi.fa2 import Snapshot
from kiln.cmdoptions import add_version_option
from kiln.errors import KilnError
from kiln.series.series import carried_versions, series_dir
from kiln.series.verify import verify
from kiln.upstream.fetch import fetch
from kiln.upstream.lock import UpstreamLock
from kiln.upstream.pristine import PristineTree

NAME = "verify"
HELP = "prove the series applies and round-trips exactly"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--branch-repo", type=Path,
                        help="compare against this materialized repository's branch")
    add_version_option(parser, "pin to verify, repeatable (default: the lock's default); 'all' "
                       "verifies every pin with a series under patches/", repeat=True)


def run(args: argparse.Namespace) -> int:
    versions = args.versions or [None]
    lock = UpstreamLock.load()
    # Every named pin is checked before the first is fetched.
    versions = (carried_versions(lock=lock) if "all" in versions
                else [lock.release(v).version for v in versions])
    if args.branch_repo and len(versions) > 1:
        raise KilnError("--branch-repo compares one pin's branch; give one --version with it")
    ok = True
    for version in versions:
        files = fetch(version, lock=lock)  # verify reads the wheel too: its file list
        with zipfile.ZipFile(files.wheel) as wheel:
            wheel_files = wheel.namelist()
        print(f"vLLM {version}: patches/{version}/")
        report = verify(PristineTree.from_files(files), series_dir(version, lock=lock),
                        branch_repo=args.branch_repo, wheel_files=wheel_files,
                        fa2=Snapshot.load(version))
        for name, passed, detail in report.checks:
            print(f"{'ok  ' if passed else 'FAIL'} {name}")
            if detail and (not passed or "offset" in detail or "checked" in detail):
                print("     " + detail.replace("\n", "\n     "))
        ok = ok and report.ok
    return 0 if ok else 1
