"""The GPU bundle puts a FlashInfer stand-in (flashinfer.norm alone) on the path. vLLM
0.34.0's has_flashinfer() then says True wherever nvcc and ninja are found, as on the
lent GPU machines, and every FlashInfer path runs: on 2026-12-07 every scenario of an
H100 run died in the kernel warm-up's autotuner (no flashinfer.autotuner). The bundle's
run script (kiln/testing/gpubundle_run.sh) points CUDA_HOME at a folder without nvcc;
here, with the stand-in importable and an nvcc and a ninja on PATH, upstream's
has_flashinfer() is False under that setting and True without it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from kiln.testing.gpubundle import RUN_SCRIPT, STANDIN_ROOT

CHILD = """
import json
from vllm.utils.flashinfer import has_flashinfer
from flashinfer.norm import gemma_rmsnorm
print(json.dumps({"has_flashinfer": has_flashinfer(), "norm": gemma_rmsnorm.__module__}))
"""


def _run_script_cuda_home(prefix: Path) -> str:
    found = re.findall(r'^export CUDA_HOME="\$prefix/([^"]+)"$', RUN_SCRIPT.read_text(), re.M)
    assert len(found) == 1, "the run script sets CUDA_HOME once, under its prefix"
    return str(prefix / found[0])


def _has_flashinfer(tmp_path: Path, cuda_home: str | None) -> dict:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    link = site / "flashinfer"
    if not link.exists():
        link.symlink_to(STANDIN_ROOT / "flashinfer")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("nvcc", "ninja"):
        exe = bin_dir / tool
        exe.write_text("#!/bin/sh\nexit 0\n")
        exe.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env.update(PYTHONPATH=os.pathsep.join([str(site), env.get("PYTHONPATH", "")]),
               PATH=os.pathsep.join([str(bin_dir), env["PATH"]]), VLLM_TARGET_DEVICE="cpu")
    if cuda_home is not None:
        env["CUDA_HOME"] = cuda_home
    run = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_run_scripts_cuda_home_keeps_flashinfer_off_beside_the_standin(tmp_path):
    got = _has_flashinfer(tmp_path, _run_script_cuda_home(tmp_path / "prefix"))
    assert got == {"has_flashinfer": False, "norm": "flashinfer.norm"}


def test_without_it_the_standin_turns_every_flashinfer_path_on(tmp_path):
    assert _has_flashinfer(tmp_path, None)["has_flashinfer"] is True
