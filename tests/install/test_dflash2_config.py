"""DFlash2 at start-up in the installed fork (VLLM_TARGET_DEVICE=cpu, HF offline).

A copying target and a random DFlash2 drafter for it (kiln tiny-model --copy and
--dflash2-drafter); upstream's EngineArgs(...).create_engine_config() builds each case
in one child process (dflash2_child.py, which explains its environment). Bad DFlash2
settings fail there, naming the allowed values; KVarN refuses methods whose drafter
has attention layers of its own; vLLM's DFlash2 model class builds from the drafter's
config and loads every tensor of its checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.errors import KilnError
from kiln.testing import tinymodel

CHILD = Path(__file__).with_name("dflash2_child.py")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("dflash2")
    target = tinymodel.build(root / "copy64", spec=tinymodel.preset("d64", copy_period=100))
    drafter = tinymodel.build_dflash2_drafter(target, root / "drafter")
    return target, drafter


@pytest.fixture(scope="module")
def child(models, tmp_path_factory) -> dict:
    target, drafter = models
    out = tmp_path_factory.mktemp("child") / "out.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "VLLM_TARGET_DEVICE": "cpu",
           "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, str(CHILD), str(target), str(drafter), str(out)],
                         capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


def _error(child: dict, case: str) -> str:
    assert "error" in child[case], f"{case} was accepted: {child[case]}"
    return child[case]["error"]


# -- the drafter checkpoint --------------------------------------------------------


def test_drafter_config_names_the_dflash2_keys_and_takes_sizes_from_the_target(models):
    target, drafter = models
    config = json.loads((drafter / "config.json").read_text())
    target_config = json.loads((target / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert config["dflash_config"] == {
        "block_size": 16, "conv_group_size": 16, "conv_kernel_size": 3,
        "mask_token_id": target_config["pad_token_id"], "target_layer_ids": [0, 1],
        "selector_rank": 8, "selector_top_k": 4}
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size"):
        assert config[key] == target_config[key], key


def test_drafter_has_no_embedding_or_lm_head_and_rebuilds_identically(models, tmp_path):
    from safetensors import safe_open

    target, drafter = models
    with safe_open(drafter / "model.safetensors", "pt") as f:
        names = list(f.keys())
    assert names and not [n for n in names if "embed" in n or "lm_head" in n]
    again = tinymodel.build_dflash2_drafter(target, tmp_path / "again")
    assert tinymodel.tree_digest(again) == tinymodel.tree_digest(drafter)


def test_drafter_refuses_a_group_size_that_does_not_divide_the_hidden_size(models, tmp_path):
    target, _ = models
    with pytest.raises(KilnError) as err:
        tinymodel.build_dflash2_drafter(target, tmp_path / "bad",
                                        tinymodel.DrafterSpec(conv_group_size=24))
    assert "--conv-group-size 24" in str(err.value) and "hidden size 128" in str(err.value)
    assert "16" in str(err.value).split("divisors")[1]
    assert not (tmp_path / "bad").exists()


def test_a_stale_drafter_folder_is_rebuilt_and_a_foreign_file_stops_it(models, tmp_path):
    target, drafter = models
    out = tmp_path / "drafter"
    shutil.copytree(drafter, out)
    stamp = out / tinymodel.DRAFTER_STAMP
    older = json.dumps({**json.loads(stamp.read_text()), "fingerprint": "an older one"})
    stamp.write_text(older)
    (out / "config.json").write_text("{}\n")
    assert tinymodel.build_dflash2_drafter(target, out) == out
    assert tinymodel.tree_digest(out) == tinymodel.tree_digest(drafter)
    stamp.write_text(older)
    (out / "README.md").write_text("mine\n")
    with pytest.raises(KilnError, match="holds README.md, which tiny-model did not write"):
        tinymodel.build_dflash2_drafter(target, out)
    assert (out / "README.md").read_text() == "mine\n" and stamp.read_text() == older
    assert [p.name for p in tmp_path.iterdir()] == ["drafter"]


def test_vllms_dflash2_model_class_builds_and_loads_every_checkpoint_tensor(child):
    model = child["model"]
    assert model["class"] == "vllm.model_executor.models.qwen3_dflash2.DFlash2Qwen3ForCausalLM"
    assert model["checked"] and model["mismatched"] == []
    # Every parameter comes from the checkpoint except what vLLM shares from the
    # target and the separate mask embedding this drafter does not ship.
    assert model["uncovered"] == ["lm_head.weight", "model.embed_tokens.weight",
                                  "model.mask_embedding"]
    # Built at the drafter's own width (draft_tokens 7) though the verify block is 15.
    assert model["conv_block_size"] == 8
    assert model["conv_groups"] == 128 // 16 and model["selector_top_k"] == 4


def test_the_speculator_runs_the_drafter_at_its_width_and_fills_the_verify_block(child):
    run = child["speculator"]
    assert (run["num_speculative_steps"], run["num_query_per_req"], run["verify_len"]) == (
        7, 8, 15)
    assert run["drafter_buffer"][1] == 7 and run["verify_buffer"][1] == 15
    for step in run["steps"]:
        copy, plain = step["drafts"]
        # The greedy copying request: its next 15 tokens, from the history chain.
        assert copy == step["copy_next"]
        # The sampled request without repeats: the drafter's 7, then its last token.
        assert plain == list(range(500, 507)) + [step["plain_last"]] * 8
    # Fully accepted steps keep the copy's lookup trusted for the whole block.
    assert [s["trust"][0] for s in run["steps"]] == [15, 15, 15, 15]


def test_upstreams_init_speculator_builds_the_forks_speculator(child):
    # 0.34.0's init_speculator takes the class from the speculator config; the topic
    # puts the fork's first for DFlash2 drafters.
    assert child["init_speculator"] == "vllm.fork.dflash2_speculator.KilnDFlash2Speculator"


def test_the_scratch_pool_sizes_dflash_queries_as_parallel_drafting(child):
    # DFlash drafts in parallel: its split batches carry 1 + 2k query tokens (7 at k=3,
    # under the 3D path's cap of 8). 0.34.0's deprecated SpeculativeConfig field reads
    # None, which sized them as 1 + k.
    scratch = child["defaults-k3"]["scratch"]
    assert scratch == {"drafts_in_parallel": True, "query_len": 7}


# -- start-up: what is accepted --------------------------------------------------


def test_defaults_resolve_and_keep_upstreams_token_count(child):
    run = child["defaults-k7"]
    assert run["method"] == "dflash" and run["num_speculative_tokens"] == 7
    assert run["v2_runner"] is True
    assert run["kiln_dflash2"] == {"draft_tokens": 7, "lookup": False, "lookup_max": 5,
                                   "lookup_min": 2, "lookup_window": 1024,
                                   "ngram_chains": True}


def test_lookup_verifies_a_block_longer_than_the_drafters(child):
    run = child["lookup-v15-k7"]
    assert run["num_speculative_tokens"] == 15
    assert run["kiln_dflash2"]["draft_tokens"] == 7 and run["kiln_dflash2"]["lookup"]
    # The drafter's width defaults to its block (16 - 1) when V exceeds it.
    assert child["lookup-v20"]["kiln_dflash2"]["draft_tokens"] == 15


# -- start-up: bad input, each refused naming what is allowed ----------------------


def test_a_verify_block_shorter_than_the_drafter_block_is_refused(child):
    message = _error(child, "verify-shorter-than-drafter")
    assert "num_speculative_tokens=5" in message and "shorter than the drafter block" in message
    assert "num_speculative_tokens >= 7" in message


def test_k_above_the_drafters_block_is_refused(child):
    message = _error(child, "k-above-block")
    assert "draft_tokens=16" in message and "block_size 16" in message
    assert "allowed: 1..15" in message
    message = _error(child, "v-above-block-without-lookup")
    assert "num_speculative_tokens=16" in message and "allowed: 1..15" in message
    assert "lookup=true" in message


def test_lookup_min_above_max_is_refused(child):
    message = _error(child, "lookup-min-above-max")
    assert "lookup_min=5" in message and "lookup_max=3" in message
    assert "lookup_min <= lookup_max" in message


def test_unknown_keys_and_foreign_methods_are_refused(child):
    message = _error(child, "unknown-key")
    assert "verify_block" in message and "draft_tokens, lookup, lookup_min" in message
    message = _error(child, "kiln-dflash2-on-ngram")
    assert "DFlash2 drafters only" in message and "'ngram'" in message


def test_lookup_with_probabilistic_draft_sampling_is_refused(child):
    message = _error(child, "lookup-probabilistic")
    assert "'probabilistic'" in message and "allowed: draft_sample_method 'greedy'" in message


def test_kvarn_refuses_drafter_methods_and_allows_the_draft_free_ones(child):
    message = _error(child, "kvarn-dflash")
    assert "speculative method 'dflash'" in message and "kvarn_k4v2_g128" in message
    assert "ngram, ngram_gpu" in message
    for case in ("kvarn-ngram", "kvarn-ngram_gpu"):
        assert "error" not in child[case], child[case]
