"""The fork's token mask agrees with accept_token on bounded strings (mask_probe_worker).

For random schemas with bounded string properties, in JSON and qwen_xml style, through a
cached and an uncached compiler, every token of a small vocabulary of boundary-crossing
and odd-UTF-8 tokens is checked at each step of random walks. A token the mask allows but
accept_token refuses would be sampled and then fail; kiln.2 had such tokens where a
token ran from before a bounded body into it past its maxLength or ended it below its
minLength. The reverse, a mask refusing a token accept_token takes, occurs on stock
0.2.8 as well, for one kind of token only: a key with its colon and the opening quote of
its value ('"s": "') in a JSON object without free whitespace (KEY_VALUE_START); it
costs the model that tokenization, not correctness.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.xgrammar.conftest import HERE

KEY_VALUE_START = re.compile(r'^"[stu]": "$')


def probe(envs, which: str, seed: int, schemas: int) -> dict:
    result = subprocess.run(
        [str(envs.python), str(HERE / "mask_probe_worker.py")],
        input=json.dumps({"seed": seed, "schemas": schemas, "steps": 40}),
        capture_output=True, text=True, env=envs.environ(which), timeout=900,
    )
    assert result.returncode == 0, f"{which} probe failed:\n{result.stderr[-4000:]}"
    return json.loads(result.stdout)


@pytest.mark.parametrize("seed", [1, 2])
def test_fork_mask_never_allows_what_accept_refuses(envs, seed):
    report = probe(envs, "fork", seed, schemas=40)
    assert report["walks"] == 40 and report["checked"] > 40_000
    allowed_refused = [m for m in report["mismatches"] if m["mask_allows"]]
    assert not allowed_refused, allowed_refused[:10]
    other = [m for m in report["mismatches"]
             if m["style"] != "json" or not KEY_VALUE_START.match(m["token"])]
    assert not other, other[:10]


def test_stock_refuses_key_value_starts_too(envs):
    """The one kind of refusal the fork test allows is stock's own."""
    report = probe(envs, "stock", 1, schemas=40)
    refused = [m for m in report["mismatches"] if not m["mask_allows"]]
    assert refused and all(KEY_VALUE_START.match(m["token"]) for m in refused), refused[:10]
