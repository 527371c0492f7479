"""Upstream's own CPU tests: every one that passes on pristine 0.32.0 passes on the fork."""

import sys
from pathlib import Path

from kiln.testing.peer import read_baseline, regressions, run_peer_suite


def test_upstream_tests_passing_on_pristine_pass_on_the_fork(pristine_tree):
    baseline = read_baseline(pristine_tree.version)
    assert len(baseline) > 1000, "the recorded baseline is suspiciously small"
    result = run_peer_suite(Path(sys.executable), pristine_tree)
    broken = regressions(baseline, result)
    assert broken == [], "\n".join(
        [f"{n}: {result.outcomes.get(n, 'not run')}" for n in broken[:50]] + [result.log[-4000:]])
