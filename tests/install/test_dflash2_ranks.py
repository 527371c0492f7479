"""The drafter's forward under tensor and data parallelism (VLLM_TARGET_DEVICE=cpu).

KilnDFlash2Speculator skips the drafter's forward on a step whose count is 0 or
whose requests all drafted from a chain one step earlier, but only on a single-rank
run: under TP or DP each rank reads its own chain flag (and, under DP, its own
scheduler's count), and a forward one rank skips hangs its peers' collectives.
dflash2_child.py (ranks mode: drive_ranks) runs propose() over the same steps for
one rank and for two ranks with different chain states; what it records is on
which steps the fork let the forward run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.install.dflash2_child import RANK_STEPS
from tests.install.test_dflash2_config import CHILD, models  # noqa: F401  (fixture)

ALL_STEPS = list(range(len(RANK_STEPS)))


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory) -> dict:  # noqa: F811
    target, drafter = models
    out = tmp_path_factory.mktemp("ranks") / "out.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "VLLM_TARGET_DEVICE": "cpu",
           "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, str(CHILD), str(target), str(drafter), str(out),
                          "ranks"], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


def test_a_single_rank_skips_the_forward_on_count_0_and_on_chained_steps(runs):
    (single,) = runs["single"]
    assert single["single_rank"]
    skipped = [step for step, (count, chained) in enumerate(RANK_STEPS)
               if count == 0 or chained[0]]
    assert skipped, "the steps exercise no skip"
    assert single["forwards"] == [s for s in ALL_STEPS if s not in skipped]


@pytest.mark.parametrize("run", ["tp2", "dp2"])
def test_every_rank_runs_the_forward_on_every_step(runs, run):
    ranks = runs[run]
    assert [r["single_rank"] for r in ranks] == [False, False]
    # The ranks' chain states differ on some steps, and neither skips anywhere.
    assert any(a != b for _, (a, b) in RANK_STEPS)
    assert [r["forwards"] for r in ranks] == [ALL_STEPS, ALL_STEPS]
    # Same scheduler count, same verify block: every rank fills the same count.
    assert ranks[0]["verify_len"] == ranks[1]["verify_len"] == runs["single"][0]["verify_len"]

