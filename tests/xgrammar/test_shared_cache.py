"""One cached compiler keeps each bounded string's own token masks (shared_cache_worker).

vLLM compiles every request's grammar with one GrammarCompiler per tokenizer, whose cache
shares per-rule token masks between grammars, keyed by the hash of each rule's FSM, which
for a counted string body includes its bounds. kiln.3 seeded that hash with
HashCombine(0, minLength, maxLength), under which each pair below collides: the grammar
compiled second got the first one's masks, so after '{"s": ' the mask of minLength 1,
maxLength 64 allowed '""' and refused '"ab"', which accept_token decides the other way.
Each pair is compiled in order through one compiler, the larger bounds first in some.
qwen_xml values share the hash (with string_raw); their pairs keep minLength above 0 on
both sides, since a value that may be empty is another FSM (a nullable value rule).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.xgrammar.conftest import HERE

PAIRS = {
    "json": [((0, 1), (1, 64)), ((1, 129), (0, 64)), ((2, 2), (3, 65))],
    "qwen_xml": [((2, 2), (3, 65)), ((4, 261), (1, 65))],
}
GRAMMARS = [(style, lo, hi) for style, pairs in PAIRS.items()
            for pair in pairs for lo, hi in pair]


@pytest.fixture(scope="module")
def results(envs) -> dict:
    request = {"grammars": [{"style": s, "min": lo, "max": hi} for s, lo, hi in GRAMMARS]}
    result = subprocess.run(
        [str(envs.python), str(HERE / "shared_cache_worker.py")],
        input=json.dumps(request), capture_output=True, text=True,
        env=envs.environ("fork"), timeout=900,
    )
    assert result.returncode == 0, f"fork worker failed:\n{result.stderr[-4000:]}"
    return dict(zip(GRAMMARS, json.loads(result.stdout)["results"]))


@pytest.mark.parametrize("grammar", GRAMMARS, ids=lambda g: "{}-{}-{}".format(*g))
def test_one_compiler_keeps_each_bounds_own_mask(results, grammar):
    style, lo, hi = grammar
    got = results[grammar]
    assert not got["mismatches"], (f"{len(got['mismatches'])} tokens where the mask and "
                                   f"accept_token disagree: {got['mismatches'][:10]}")
    # accept_string reads every length by the bounds: the mask was compared with the truth.
    assert got["decisions"] == {n: lo <= int(n) <= hi for n in got["decisions"]}
