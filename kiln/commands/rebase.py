"""Rebase the series onto a new upstream version with git, recording every stop.

    python -m kiln rebase --onto 0.33.0 --repo ../work/rebase-0.33

fetches and verifies the pristine 0.33.0 sdist (it must be pinned: `kiln pin-bump`;
the wheel is fetched by `kiln build`, since a rebase reads only source),
materializes the series at the lock's default into --repo when that folder
does not exist yet, imports 0.33.0 there as tag v0.33.0 and rebases
fork/<old> onto it as fork/0.33.0 (rerere on). At a conflict it stops and
reports the topic, files, conflicting hunks and whether upstream already holds
the change ("retire?"). Resolve, then `kiln rebase --continue --repo DIR`, or
retire the topic with `--skip`. The report (report.json, report.md and the
`git range-diff` of old vs new branch) is in DIR/.git/kiln-rebase/.
Then `kiln export --from DIR --version 0.33.0` writes the re-cut series into
patches/0.33.0/.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kiln.errors import KilnError
from kiln.series.materialize import materialize
from kiln.series.pinned import PinnedSeries
from kiln.series.rebase import RebaseReport, resume, start, state_dir
from kiln.upstream.lock import UpstreamLock
from kiln.upstream.pristine import PristineTree

NAME = "rebase"
HELP = "rebase the series onto a new upstream version; record every stop"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--onto", metavar="VERSION", help="upstream version to rebase onto")
    action.add_argument("--continue", dest="resume", action="store_true", help="continue after resolving a stop")
    action.add_argument("--skip", action="store_true", help="retire the stopped topic and continue")
    parser.add_argument("--repo", type=Path, required=True, help="materialized repository (created if missing)")
    parser.add_argument("--patches", type=Path,
                        help="series to materialize when --repo does not exist "
                             "(default: patches/<--from>/)")
    parser.add_argument("--from", dest="old", help="version the series is cut against (default: the lock's default)")


def run(args: argparse.Namespace) -> int:
    if args.onto:
        lock = UpstreamLock.load()
        old = args.old or lock.default
        if args.onto == old:
            raise KilnError(f"--onto {args.onto} is the version the series is already on; name a newer one")
        new_tree = PristineTree.pinned(args.onto, lock).root
        if not args.repo.exists():
            print(f"materializing the series at {old} in {args.repo}")
            pin = PinnedSeries.load(old, lock=lock, patches=args.patches)
            materialize(pin.pristine.root, pin.version, pin.series, args.repo)
        report = start(args.repo, old, args.onto, new_tree)
    else:
        report = resume(args.repo, skip=args.skip)
    return _print(args.repo, report)


def _print(repo: Path, report: RebaseReport) -> int:
    for topic in report.topics:
        print(f"  {report.outcome(topic):8} {topic}")
    if report.state == "stopped":
        stop = report.stops[-1]
        print(f"\nstopped at {stop.topic}: {len(stop.hunks)} conflicting hunk(s) in {', '.join(stop.files)}")
        for path in stop.deleted_upstream:
            print(f"  {path}: deleted or moved upstream")
        if stop.retire:
            print(f"  retire? {stop.retire}")
        print(f"resolve in {repo}, then `python -m kiln rebase --continue --repo {repo}` (or --skip)")
    else:
        print(f"\nfork/{report.new} is ready in {repo}; write it to patches/{report.new}/ with "
              f"`python -m kiln export --from {repo} --version {report.new}`")
    print(f"report: {state_dir(repo)}/report.md (+ report.json, range-diff.txt)")
    return 1 if report.state == "stopped" else 0
