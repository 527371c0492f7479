"""Run upstream's own CPU tests (from the pristine sdist) against an installed vllm.

With --record-baseline, the interpreter must hold pristine upstream: the tests
that pass are written to tests/upstream/baseline-<version>.txt. Without it, the
run fails on every baseline test that does not pass against the installed fork.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kiln.cmdoptions import add_version_option
from kiln.errors import KilnError
from kiln.testing.peer import SELECTION, read_baseline, regressions, run_peer_suite, write_baseline
from kiln.upstream.lock import UpstreamLock
from kiln.upstream.pristine import PristineTree

NAME = "peer-suite"
HELP = "upstream's CPU tests against an installed vllm, compared with the baseline"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--python", type=Path, required=True,
                        help="interpreter of the virtualenv that holds the vllm to test")
    add_version_option(parser, "upstream pin whose tests and baseline to use (default: the "
                       "lock's default)")
    parser.add_argument("--record-baseline", action="store_true",
                        help="record what passes (run against pristine upstream)")


def run(args: argparse.Namespace) -> int:
    lock = UpstreamLock.load()
    version = lock.release(args.version).version
    if not args.python.exists():
        raise KilnError(f"{args.python}: no such interpreter")
    pristine = PristineTree.pinned(version, lock)  # the tests are in the sdist
    started = time.monotonic()
    result = run_peer_suite(args.python, pristine)
    minutes = (time.monotonic() - started) / 60
    counts = {o: sum(1 for v in result.outcomes.values() if v == o) for o in ("passed", "failed", "skipped")}
    if not result.outcomes:
        raise KilnError("the peer suite recorded no test at all:\n" + result.log[-3000:])
    if args.record_baseline:
        path = write_baseline(pristine.version, result.passed(),
                              f"upstream {pristine.version} tests passing on pristine upstream "
                              f"({', '.join(SELECTION)}): {counts['passed']} of {len(result.outcomes)}")
        print(f"recorded {counts['passed']} passing tests in {path} ({minutes:.1f} min)")
        return 0
    broken = regressions(read_baseline(pristine.version), result)
    for node in broken:
        print(f"REGRESSION {node}: {result.outcomes.get(node, 'not run')}")
    print(f"peer suite ({minutes:.1f} min): {counts['passed']} passed, {len(broken)} failed "
          f"against the baseline")
    return 1 if broken else 0
