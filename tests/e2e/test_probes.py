"""The acceptance probes, run as a user runs them, against the CPU server.

The server has prefix caching on, so the second send of each residue-sweep
prompt and the repeats of the copy probe are cache hits: 0 broken means a hit
never changed a greedy answer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

PROBES = Path(__file__).resolve().parents[2] / "bench" / "probes"


def run_probe(server, name: str, *args: str) -> dict[str, Any]:
    cmd = [
        sys.executable, str(PROBES / name),
        "--base-url", server.url, "--api-key", server.api_key,
        "--model", server.served_name, *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert proc.returncode in (0, 1), proc.stderr
    result = json.loads(proc.stdout)
    print(json.dumps(result, sort_keys=True))  # kept in the CI log as the figure
    return result


def test_residue_sweep_has_no_broken_residue(server) -> None:
    result = run_probe(server, "residue_sweep.py")
    assert result["block_size"] > 0
    assert result["prompts"] == result["block_size"]
    assert result["broken"] == 0, result["broken_cases"]


def test_copy_probe_is_stable_across_cache_hits(server) -> None:
    result = run_probe(server, "copy_probe.py", "--max-tokens", "64", "--repeat", "3")
    assert result["broken"] == 0
    assert 0 < result["output_tokens"] <= 64
    assert len(result["output_sha256"]) == 64


def test_kv_pool_from_metrics_matches_log(server) -> None:
    from_metrics = run_probe(server, "kv_pool.py")
    from_log = run_probe(server, "kv_pool.py", "--log", str(server.log_path))
    assert from_metrics["tokens"] > 0
    assert from_metrics["tokens"] == from_log["tokens"]


def test_tokens_per_step_absent_without_spec_decode(server) -> None:
    assert run_probe(server, "tokens_per_step.py") == {
        "probe": "tokens_per_step",
        "present": False,
    }
