"""Bind every Python call into the compiled attention ops to the pinned schemas.

Calls like ``torch.ops._vllm_fa2_C.varlen_fwd(...)`` (also through an alias such as
``ops = torch.ops._vllm_fa3_C``) must match fa2/schemas/<version>.txt by argument
count, keyword names and required arguments. Every file of upstream's vllm/ package
is read (calls move between files), and the fork's own vllm/fork/, kvarn/ and
specattn/ from this checkout. Without --tree, upstream is the pinned sdist with
patches/<version>/ applied, or pristine alone while that series does not exist yet
(a pin just added by pin-bump); with --tree, upstream is that unpacked tree.
Exits 1 naming file, line, op and the mismatch.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from kiln.abi.fa2 import FORK_SCAN, UPSTREAM_SCAN, Snapshot, check_calls
from kiln.cmdoptions import add_version_option
from kiln.paths import REPO_ROOT
from kiln.series.patching import apply_series_into
from kiln.series.series import Series
from kiln.upstream.lock import UpstreamLock
from kiln.upstream.pristine import PristineTree

NAME = "fa2-check"
HELP = "check that every call into the compiled attention ops binds to its pinned schema"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_version_option(parser, "upstream version (default: the lock's default)")
    parser.add_argument("--tree", type=Path,
                        help="an unpacked upstream source tree to check instead of pristine + series")


def run(args: argparse.Namespace) -> int:
    start = time.monotonic()
    lock = UpstreamLock.load()
    version = lock.release(args.version).version
    snapshot = Snapshot.load(version)
    fork = (REPO_ROOT, FORK_SCAN)
    if args.tree:
        report = check_calls([(args.tree, UPSTREAM_SCAN), fork], snapshot)
    else:
        pristine = PristineTree.pinned(version, lock).root  # the source is all it reads
        series = REPO_ROOT / "patches" / version
        if not (series / "series").is_file():
            print(f"no series in {series.relative_to(REPO_ROOT)}/ yet: checking pristine vLLM {version}")
            report = check_calls([(pristine, UPSTREAM_SCAN), fork], snapshot)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                tree = Path(tmp) / "applied"
                apply_series_into(pristine, Series.load(series), tree)
                report = check_calls([(tree, UPSTREAM_SCAN), fork], snapshot)
    for error in report.errors:
        print(f"FAIL {error}")
    ops = sorted({f"{c.namespace}.{c.op}" for c in report.checked})
    print(f"{len(report.checked)} call(s) of {len(ops)} op(s) in {report.files} file(s) checked "
          f"against {snapshot.count} schemas of vLLM {version}: {len(report.errors)} mismatch(es) "
          f"({time.monotonic() - start:.1f} s)")
    return 0 if report.ok else 1
