"""The peer suite: upstream's own CPU tests, run against the installed fork.

Upstream's tests are copied out of the pristine sdist (so the installed package
is what is tested, not a source tree) and run with VLLM_TARGET_DEVICE=cpu and
the hub offline. The baseline lists the tests that pass against pristine
upstream; the fork must pass every one of them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import naming
from kiln.paths import REPO_ROOT
from kiln.upstream.pristine import PristineTree

SELECTION = (
    "tests/v1/core", "tests/v1/engine", "tests/config", "tests/utils_",
    "tests/test_envs.py", "tests/test_sampling_params.py", "tests/test_version.py",
    "tests/test_outputs.py",
)
PER_TEST_TIMEOUT = 300


def baseline_path(version: str) -> Path:
    return REPO_ROOT / "tests" / "upstream" / f"baseline-{version}.txt"


@dataclass(frozen=True)
class PeerResult:
    outcomes: dict[str, str]
    log: str

    def passed(self) -> set[str]:
        return {n for n, o in self.outcomes.items() if o == "passed"}


def run_peer_suite(python: Path, pristine: PristineTree, selection=SELECTION) -> PeerResult:
    """Run upstream's selected tests with ``python`` (a venv holding a vllm)."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        shutil.copytree(pristine.root / "tests", work / "tests")
        # Upstream's pytest markers live in its pyproject.toml.
        shutil.copy(pristine.root / "pyproject.toml", work / "pyproject.toml")
        shutil.copy(Path(__file__).with_name("peer_plugin.py"), work / "kiln_peer_plugin.py")
        results = work / "results.json"
        env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1",
                   KILN_PEER_RESULTS=str(results),
                   PYTHONPATH=os.pathsep.join([str(work), str(work / "tests" / "vllm_test_utils")]))
        proc = subprocess.run(
            [str(python), "-m", "pytest", *selection, "-q", "-p", "no:cacheprovider",
             "-p", "kiln_peer_plugin", "--continue-on-collection-errors",
             f"--timeout={PER_TEST_TIMEOUT}"],
            cwd=work, env=env, capture_output=True, text=True,
        )
        outcomes = json.loads(results.read_text()) if results.exists() else {}
        return PeerResult(outcomes=outcomes, log=proc.stdout[-20000:] + proc.stderr[-5000:])


def read_baseline(version: str) -> set[str]:
    path = baseline_path(version)
    return {line for line in path.read_text().splitlines() if line and not line.startswith("#")}


def write_baseline(version: str, passed: set[str], note: str) -> Path:
    path = baseline_path(version)
    path.parent.mkdir(parents=True, exist_ok=True)
    with naming(path):
        path.write_text(f"# {note}\n" + "".join(f"{n}\n" for n in sorted(passed)))
    return path


def regressions(baseline: set[str], result: PeerResult) -> list[str]:
    """Tests that pass on pristine upstream and do not pass on the fork."""
    return sorted(n for n in baseline if result.outcomes.get(n) != "passed")
