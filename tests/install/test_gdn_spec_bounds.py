"""Topic gdn-spec-bounds (the series' vllm-pr50021-gdn-spec-bounds): the Gated DeltaNet spec-decode kernels bound the
accepted-token count they index state with. A count of 0 (a request that emitted no
token in a step: upstream vllm #56419 saw it when structured output rejected every
draft) made the index -1, so the kernels read the state before the request's own row:
another request's state, or memory before the tensor (a wild read whose result is then
written back). Run on upstream's kernels under TRITON_INTERPRET on the CPU
(gdn_bounds_child.py): the request with a count of 0 now starts from its own first
slot, exactly as with a count of 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = Path(__file__).with_name("gdn_bounds_child.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gdn-bounds") / "out.json"
    # No VLLM_TARGET_DEVICE: on the CPU platform upstream swaps its C++ conv update in
    # for the Triton kernel under test.
    env = {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}
    env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, str(CHILD), str(out)], capture_output=True,
                         text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("kernel", ["conv", "deltanet"])
def test_a_request_with_no_accepted_token_reads_only_its_own_state(runs, kernel):
    zero, one = runs[kernel]["zero"], runs[kernel]["one"]
    assert zero["out"] == one["out"]
    assert zero["state"] == one["state"]
