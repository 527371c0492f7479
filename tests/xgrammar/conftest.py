"""Two xgrammar builds side by side: stock 0.2.8 from the registry and the fork's.

The session fixture builds (or reuses, from $KILN_CACHE) the fork wheel and fetches the
stock wheel, each unpacked into its own folder that goes first on PYTHONPATH of a child
interpreter; see kiln/build/xgrammar.py. Cold, this builds xgrammar (minutes on 2 cores);
warm, it only checks hashes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.build.xgrammar import XgrammarEnvs, xgrammar_envs

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def envs() -> XgrammarEnvs:
    return xgrammar_envs(log=lambda m: print(m, file=sys.stderr, flush=True))


def decisions(envs: XgrammarEnvs, which: str, cases: list[dict], timeout: float = 900) -> list:
    """Accept/reject decisions of one build for each case's documents (see decide_worker)."""
    result = subprocess.run(
        [str(envs.python), str(HERE / "decide_worker.py")],
        input=json.dumps({"cases": cases}), capture_output=True, text=True,
        env=envs.environ(which), timeout=timeout,
    )
    assert result.returncode == 0, f"{which} worker failed:\n{result.stderr[-4000:]}"
    return json.loads(result.stdout)["results"]
