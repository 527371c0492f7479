"""Bind every Python call into the compiled attention ops to the pinned schemas.

Calls like ``torch.ops._vllm_fa2_C.varlen_fwd(...)`` (also through an alias such as
``ops = torch.ops._vllm_fa3_C``) must match fa2/schemas/<version>.txt by argument
count, keyword names and required arguments. Without --tree, the tree is pristine
upstream + the series (pristine alone for a version other than the default pin), and the fork's vllm/fork/ and kvarn/ from this repository.
Exits 1 naming file, line, op and the mismatch.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from kiln.fa2 import FORK_SCAN, UPSTREAM_SCAN, Snapshot, check_calls
from kiln.fetch import fetch
from kiln.lock import add_version_option, pinned_version
from kiln.patching import apply_series_into
from kiln.paths import REPO_ROOT
from kiln.pristine import PristineTree
from kiln.series import Series, series_dir

NAME = "fa2-check"
HELP = "check that every call into the compiled attention ops binds to its pinned schema"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_version_option(parser, "upstream version (default: the lock's default)")
    parser.add_argument("--tree", type=Path,
                        help="an unpacked source tree to check instead of pristine + series")


def run(args: argparse.Namespace) -> int:
    start = time.monotonic()
    version = pinned_version(args.version)
    snapshot = Snapshot.load(version)
    scan = (*UPSTREAM_SCAN, *FORK_SCAN)
    if args.tree:
        report = check_calls([(args.tree, scan)], snapshot)
    else:
        pristine = PristineTree.from_files(fetch(version))
        with tempfile.TemporaryDirectory() as tmp:
            tree = Path(tmp) / "applied"
            apply_series_into(pristine.root, Series.load(series_dir(version)), tree)
            report = check_calls([(tree, UPSTREAM_SCAN), (REPO_ROOT, FORK_SCAN)], snapshot)
    for error in report.errors:
        print(f"FAIL {error}")
    ops = sorted({f"{c.namespace}.{c.op}" for c in report.checked})
    print(f"{len(report.checked)} call(s) of {len(ops)} op(s) in {report.files} file(s) checked "
          f"against {snapshot.count} schemas of vLLM {version}: {len(report.errors)} mismatch(es) "
          f"({time.monotonic() - start:.1f} s)")
    return 0 if report.ok else 1
