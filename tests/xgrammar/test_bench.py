"""bench/xgrammar_bounded.py runs end to end on both builds (its targets are its own).

Speed is checked by the benchmark, not here: this runs it at a few tokens so that it
cannot rot, and checks that every case was measured on every build. The workers
refuse a grammar that rejects the benchmark's own document, so a run that writes its
JSON has driven both builds through every schema.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kiln.paths import REPO_ROOT

BENCH = REPO_ROOT / "bench" / "xgrammar_bounded.py"
sys.path.insert(0, str(BENCH.parent))

from xgrammar_bounded import CASES  # noqa: E402


def test_the_benchmark_measures_every_case_on_both_builds(envs, tmp_path: Path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, str(BENCH), "--tokens", "4", "--rounds", "1", "--trials", "1",
         "--json", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    # 1 means a speed target was missed, which a 4-token run says nothing about.
    assert result.returncode in (0, 1), result.stderr[-4000:]
    report = json.loads(out.read_text())
    for build in ("stock", "fork"):
        assert set(report[build]) == set(CASES)
        for case in report[build].values():
            assert case["ms_per_token"] > 0 and case["compile_ms"] > 0
    # Per case: fork vs stock per token and to compile, and (but for the two unbounded
    # references) vs its unbounded case.
    assert len(report["targets"]) == len(CASES) * 3 - 2
