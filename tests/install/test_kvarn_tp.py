"""KVarN per rank under tensor parallelism, on CPU: a world of 2 on gloo.

kvarn_tp_child.py runs once per rank (it explains what each rank builds). The layers
are vLLM's Qwen3Attention, so the KV head split is upstream's own; what is checked is
that every per-rank quantity of the KVarN backend follows the rank's head count:
the side pool and prefill scratch the profiling run reserves, the page size, and the
KV pool tokens upstream's planner gives each rank for a fixed memory budget.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm.kvarn import Preset
from vllm.kvarn.sidepool import cdiv, required_side_blocks

from tests.install import kvarn_tp_child as child_config  # its constants, not its run
from tests.install.test_kvarn_config import _tiny_qwen3

CHILD = Path(child_config.__file__)

TP = child_config.TP
PRESET = Preset.parse(child_config.PRESET)
HEAD_DIM = 128
NUM_HEADS = 8
# 4 KV heads split 2 per rank; 1 KV head is replicated on both ranks.
KV_HEADS = (4, 1)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("kvarn-tp")
    models = [_tiny_qwen3(root / f"kv{h}", num_heads=NUM_HEADS, num_kv_heads=h)
              for h in KV_HEADS]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "VLLM_TARGET_DEVICE": "cpu",
           "HF_HUB_OFFLINE": "1"}
    init = root / "rendezvous"
    procs = [subprocess.Popen([sys.executable, str(CHILD), str(rank), str(init),
                               str(root / f"rank{rank}.json"), *models],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env=env) for rank in range(TP)]
    try:
        errors = [p.communicate(timeout=300)[1] for p in procs]
    finally:
        for p in procs:  # a rank left waiting on a collective its peer never joins
            if p.poll() is None:
                p.kill()
    for rank, (p, err) in enumerate(zip(procs, errors)):
        assert p.returncode == 0, f"rank {rank}:\n{err[-4000:]}"
    results = [json.loads((root / f"rank{rank}.json").read_text()) for rank in range(TP)]
    return [{**r, "models": {h: r["models"][m] for h, m in zip(KV_HEADS, models)}}
            for r in results]


def _per_rank_heads(total: int) -> int:
    return max(1, total // TP)


def test_both_ranks_joined_one_tp_group_and_built_kvarn_layers(ranks):
    assert [r["tp_rank"] for r in ranks] == list(range(TP))
    for r in ranks:
        for total in KV_HEADS:
            layers = r["models"][total]["layers"]
            assert len(layers) == 2 and {layer["backend"] for layer in layers} == {"KVARN"}


@pytest.mark.parametrize("total", KV_HEADS)
def test_the_impl_the_side_pool_and_the_page_follow_the_ranks_heads(ranks, total):
    h = _per_rank_heads(total)
    side_blocks = required_side_blocks(child_config.MAX_NUM_SEQS,
                                       child_config.MAX_NUM_BATCHED_TOKENS, PRESET.group)
    for r in ranks:
        for layer in r["models"][total]["layers"]:
            assert layer["module_kv_heads"] == layer["impl_kv_heads"] == h
            # Upstream's QKV projection holds this rank's q, k and v heads.
            assert layer["qkv_rows"] == (NUM_HEADS // TP + 2 * h) * HEAD_DIM
            assert layer["side_shape"] == [side_blocks, 2, h, PRESET.group, HEAD_DIM]
            assert layer["side_dtype"] == "torch.float16"
            assert layer["block_size"] == PRESET.group
            assert layer["page_size_bytes"] == h * PRESET.tile_bytes(HEAD_DIM)


@pytest.mark.parametrize("total", KV_HEADS)
def test_the_prefill_scratch_is_reserved_for_the_ranks_heads_exactly(ranks, total):
    for r in ranks:
        for layer in r["models"][total]["layers"]:
            assert layer["scratch_blocks"] == cdiv(512, PRESET.group)  # max_model_len 512
            assert layer["scratch_fits"], "the profile reserved less than a pack needs"
            assert not layer["scratch_fits_one_more_block"], "the scratch is oversized"
            # Sized for every KV head of the model, a rank would reserve TP times more.
            assert layer["scratch_fits_all_heads"] == (_per_rank_heads(total) == total)


@pytest.mark.parametrize("total", KV_HEADS)
def test_kv_pool_tokens_per_rank(ranks, total):
    page = _per_rank_heads(total) * PRESET.tile_bytes(HEAD_DIM)
    blocks = child_config.KV_MEMORY // (2 * page)  # two layers per rank
    for r in ranks:
        assert r["models"][total]["pool_blocks"] == [blocks] * TP
    # A split model holds TP times the tokens per rank of one rank holding every head.
    tp1_blocks = child_config.KV_MEMORY // (2 * total * PRESET.tile_bytes(HEAD_DIM))
    if total >= TP:
        assert blocks * PRESET.group >= TP * tp1_blocks * PRESET.group
