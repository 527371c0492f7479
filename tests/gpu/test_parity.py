"""TRITON_ATTN in every execution mode gives the same greedy tokens, and the same as
transformers on the same GPU."""
import pytest


@pytest.mark.scenarios("parity-d128-eager", "parity-d128-graphs", "parity-d128-compile")
def test_head_dim_128_modes_agree_with_each_other_and_transformers(scenario):
    eager = scenario("parity-d128-eager")
    assert scenario("parity-d128-graphs")["tokens"] == eager["tokens"]
    assert scenario("parity-d128-compile")["tokens"] == eager["tokens"]
    assert eager["tokens"] == eager["transformers"]


@pytest.mark.scenarios("parity-d64-eager", "parity-d64-graphs")
def test_head_dim_64_modes_agree_with_each_other_and_transformers(scenario):
    eager = scenario("parity-d64-eager")
    assert scenario("parity-d64-graphs")["tokens"] == eager["tokens"]
    assert eager["tokens"] == eager["transformers"]


@pytest.mark.scenarios("parity-copy128-eager")
def test_the_copy_model_copies_in_vllm_and_transformers(scenario):
    run = scenario("parity-copy128-eager")
    assert run["tokens"] == run["expected"]
    assert run["transformers"] == run["expected"]
