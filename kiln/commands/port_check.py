"""Check what a clean rebase onto a new upstream can still break.

Reads the lines each topic adds and the overlay modules (vllm/, kvarn/), and
compares every upstream name, call, base class and enum they reach between the
two pristine trees (griffe, static: nothing is imported). Both versions must be
pinned in requirements/upstream.lock (`kiln pin-bump --to V`).

Findings are keyed by kind, topic and where; an --accept file (TOML) records
known-benign ones with a reason:

    [[accept]]
    kind = "body-drift"
    topic = "prompt-progress"
    where = "vllm/v1/engine/output_processor.py::RequestState.make_request_output"
    to = "0.33.0"          # optional: only for this target version
    reason = "the pooling early-return moved up; the hook is after it either way"

Exit status: 0 when every finding is accepted, 1 while any remains open.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kiln.errors import naming
from kiln.lock import UpstreamLock
from kiln.paths import REPO_ROOT
from kiln.pinbump import sdist_tree
from kiln.portcheck import port_check
from kiln.portcheck.accept import judge, load_acceptances
from kiln.series import Series, series_dir
from kiln.wheel import OVERLAY_DIRS

NAME = "port-check"
HELP = "find what moving the series to a new upstream breaks (names, signatures, overrides, enums, drift)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="old", help="upstream version the series is cut against (default: the lock's default)")
    parser.add_argument("--to", dest="new", required=True, help="upstream version to port to")
    parser.add_argument("--patches", type=Path, help="series folder (default: patches/<--from>/)")
    parser.add_argument("--accept", type=Path, help="TOML file of accepted findings (e.g. requirements/port-check-accept.toml)")
    parser.add_argument("--json", type=Path, help="write every finding as a JSON list to this file")


def run(args: argparse.Namespace) -> int:
    lock = UpstreamLock.load()
    old_version = lock.release(args.old).version
    lock.release(args.new)  # both pinned before either is fetched
    old, new = sdist_tree(old_version, lock), sdist_tree(args.new, lock)
    series = Series.load(args.patches or series_dir(old_version))
    overlays = [(REPO_ROOT / folder, target.replace("/", ".")) for folder, target in OVERLAY_DIRS]
    findings = port_check(old, old_version, new, args.new, series, overlays)
    acceptances = load_acceptances(args.accept, args.new) if args.accept else []
    verdict = judge(findings, acceptances)
    if args.json:
        with naming(args.json):
            args.json.write_text(json.dumps([f.to_json() for f in findings], indent=2) + "\n")
    print(f"port-check {old_version} -> {args.new}: {len(series.topics)} topic(s), "
          f"{len(findings)} finding(s), {len(verdict.accepted)} accepted, {len(verdict.open)} open")
    for finding in verdict.open:
        print(f"\n[{finding.kind}] {finding.topic}: {finding.where}\n  {finding.detail}")
    for finding, acceptance in verdict.accepted:
        print(f"\naccepted [{finding.kind}] {finding.topic}: {finding.where}\n  reason: {acceptance.reason}")
    for acceptance in verdict.stale:
        print(f"\nstale accept entry in {args.accept}: [{acceptance.kind}] {acceptance.topic}: "
              f"{acceptance.where} no longer occurs; remove it")
    return 1 if verdict.open else 0
