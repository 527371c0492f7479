"""Check what a clean rebase onto a new upstream can still break.

Reads the lines each topic adds and every overlay module (vllm/, kvarn/,
specattn/), and compares every upstream name, call, base class, attribute and
enum they reach between the two pristine trees (griffe, static: nothing is
imported). Both versions must be pinned in requirements/upstream.lock
(`kiln pin-bump --to V`).

Attribute reads are followed through annotated types (parameters, upstream
attributes and return values, the method a fork method overrides): a read of a
name the new pin removed is `removed-name`, or `silent-default` through
getattr(x, "name", default) or hasattr, which never fail; a name the new pin
deprecates (docstring, comment, @deprecated, a warning naming it) is
`deprecated`. A read on a value whose type cannot be told is matched by name
(`name-match`) when the old pin defines the name and the new one nowhere;
annotate the value, or accept the finding with a reason.

Fork code that re-derives an upstream formula or constant names it in a comment
on the line above its own definition:

    # mirrors: vllm.v1.worker.gpu.spec_decode.dflash.speculator.prepare_dflash_inputs

and each mirror whose upstream definition changed between the pins (its code;
docstrings and comments aside) or is gone is `mirror-drift`.

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

from kiln.build.wheel import OVERLAY_DIRS
from kiln.errors import naming
from kiln.paths import REPO_ROOT, cache_dir
from kiln.portcheck import port_check
from kiln.portcheck.accept import judge, load_acceptances
from kiln.series.pinned import PinnedSeries
from kiln.upstream.lock import UpstreamLock
from kiln.upstream.pristine import PristineTree

NAME = "port-check"
HELP = "find what moving the series to a new upstream breaks (names, signatures, overrides, enums, mirrors, drift)"
# What these checks cannot see, said after every run so nobody reads silence as safety.
BLIND_SPOT = ("not checked: behaviour behind an unchanged name and signature (a platform that now "
              "raises where it warned, a count that keeps its name but changes meaning) shows only as "
              "body-drift where a topic patches the code or as mirror-drift where a `# mirrors:` "
              "marker names it; anywhere else it needs a reading of the new upstream and a test that "
              "runs the path")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="old",
                        help="upstream version the series is cut against (default: the lock's default)")
    parser.add_argument("--to", dest="new", required=True, help="upstream version to port to")
    parser.add_argument("--patches", type=Path, help="series folder (default: patches/<--from>/)")
    parser.add_argument("--accept", type=Path,
                        help="TOML file of accepted findings (e.g. requirements/port-check-accept.toml)")
    parser.add_argument("--json", type=Path, help="write every finding as a JSON list to this file")


def run(args: argparse.Namespace) -> int:
    lock = UpstreamLock.load()
    for version in (args.old, args.new):  # both pinned before either is fetched
        lock.release(version)
    old = PinnedSeries.load(args.old, lock=lock, patches=args.patches)
    new = PristineTree.pinned(args.new, lock)
    overlays = [(REPO_ROOT / folder, target.replace("/", ".")) for folder, target in OVERLAY_DIRS]
    findings = port_check(old.pristine.root, old.version, new.root, args.new, old.series, overlays,
                          cache_dir() / "portcheck")
    acceptances = load_acceptances(args.accept, args.new) if args.accept else []
    verdict = judge(findings, acceptances)
    if args.json:
        with naming(args.json):
            args.json.write_text(json.dumps([f.to_json() for f in findings], indent=2) + "\n")
    print(f"port-check {old.version} -> {args.new}: {len(old.series.topics)} topic(s), "
          f"{len(findings)} finding(s), {len(verdict.accepted)} accepted, {len(verdict.open)} open")
    for finding in verdict.open:
        print(f"\n[{finding.kind}] {finding.topic}: {finding.where}\n  {finding.detail}")
    for finding, acceptance in verdict.accepted:
        print(f"\naccepted [{finding.kind}] {finding.topic}: {finding.where}\n  reason: {acceptance.reason}")
    for acceptance in verdict.stale:
        print(f"\nstale accept entry in {args.accept}: [{acceptance.kind}] {acceptance.topic}: "
              f"{acceptance.where} no longer occurs; remove it")
    print(f"\n{BLIND_SPOT}")
    return 1 if verdict.open else 0
