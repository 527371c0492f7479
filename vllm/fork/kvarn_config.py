"""Config-time rules for the KVarN cache dtypes, reached from VllmConfig.__post_init__
(after the platform's own check) and from the Attention layer's constructor.

Everything a KVarN run cannot serve fails here, naming the input and what is allowed,
instead of in a worker after the model loaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from vllm.kvarn.preset import HEAD_DIMS, Preset
from vllm.kvarn.sidepool import required_side_blocks
from vllm.logger import init_logger

from vllm.fork.kvarn_dtypes import KVARN_CACHE_DTYPES, is_kvarn_dtype

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

ALLOWED_MODEL_DTYPES = (torch.float16, torch.bfloat16)


SIDE_BLOCKS_ENV = "KVARN_SIDE_BLOCKS"
# Speculative methods whose drafts need no attention layers of their own (Model Runner V2
# runs both through one n-gram speculator). A drafter's layers would share the target's
# KVarN bookkeeping, which only the runner's real steps drive, and DFlash drafters write
# their context K/V outside those steps.
SPEC_METHODS = ("ngram", "ngram_gpu")


@dataclass(frozen=True)
class SidePoolPlan:
    """The fp16 side pool of one attention layer: rotated rows not (yet) quantized,
    sized by ``kvarn.sidepool.required_side_blocks`` for the configured seats, tokens
    per step and speculative tokens (see there for why that always suffices)."""

    seats: int
    num_blocks: int
    required: int
    num_kv_heads: int
    group: int
    head_dim: int
    spec_tokens: int
    slack: int

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_blocks, 2, self.num_kv_heads, self.group, self.head_dim)

    @property
    def bytes_per_layer(self) -> int:
        return self.num_blocks * 2 * self.num_kv_heads * self.group * self.head_dim * 2


def side_pool_plan(vllm_config: VllmConfig, preset: Preset, num_kv_heads: int,
                   head_dim: int) -> SidePoolPlan:
    """The side pool for this config; KVARN_SIDE_BLOCKS may raise it, and a value
    below what the seats need is refused here, at start-up, never mid-step."""
    sched = vllm_config.scheduler_config
    spec = vllm_config.speculative_config
    k = (spec.num_speculative_tokens or 0) if spec is not None else 0
    # Asynchronous scheduling plans a step before the last one's drafts are judged, so
    # host lengths may count k rejected drafts.
    slack = k if k and sched.async_scheduling else 0
    required = required_side_blocks(sched.max_num_seqs, sched.max_num_batched_tokens,
                                    preset.group, k, slack)
    blocks = required
    if override := os.environ.get(SIDE_BLOCKS_ENV):
        try:
            blocks = int(override)
        except ValueError:
            raise ValueError(f"{SIDE_BLOCKS_ENV}={override!r} is not an integer") from None
        if blocks < required:
            raise ValueError(
                f"{SIDE_BLOCKS_ENV}={blocks}: the KVarN side pool cannot hold the "
                f"configured seats; {preset.name} needs at least {required} side blocks "
                f"per layer for --max-num-seqs {sched.max_num_seqs}, "
                f"--max-num-batched-tokens {sched.max_num_batched_tokens} and {k} "
                f"speculative tokens (3 + ceil({k + slack}/{preset.group}) per seat + "
                f"ceil(tokens per step/{preset.group})); raise it, lower --max-num-seqs, "
                f"or unset {SIDE_BLOCKS_ENV}")
    return SidePoolPlan(sched.max_num_seqs, blocks, required, num_kv_heads, preset.group,
                        head_dim, k, slack)


def kvarn_layer_cache_dtype(cache_dtype: str, sliding_window: int | None) -> str:
    """Sliding-window layers (hybrid models, drafters) keep the model dtype: KVarN
    quantizes full-attention layers only."""
    if sliding_window is not None and is_kvarn_dtype(cache_dtype):
        return "auto"
    return cache_dtype


def apply_kvarn_config(vllm_config: VllmConfig) -> None:
    """Check a KVarN run's model and block size and pin the block size to G.

    Raises ValueError naming the bad input and what is allowed.
    """
    cache_config = vllm_config.cache_config
    name = cache_config.cache_dtype
    if not is_kvarn_dtype(name):
        return
    preset = Preset.parse(name)
    g = preset.group
    if cache_config.user_specified_block_size and cache_config.block_size != g:
        raise ValueError(
            f"--block-size {cache_config.block_size} does not fit --kv-cache-dtype "
            f"{name}: its tiles are {g} tokens, so the block size must be {g} "
            "(or leave --block-size unset)")
    model_config = vllm_config.model_config
    if model_config is not None:
        _check_model(name, model_config)
    _check_engine(name, vllm_config)
    if cache_config.block_size != g:
        logger.info("KVarN %s: setting the KV cache block size to its tile length %d.",
                    name, g)
        cache_config.block_size = g


def _check_model(name: str, model_config) -> None:
    head_dim = model_config.get_head_size()
    if head_dim not in HEAD_DIMS:
        raise ValueError(
            f"--kv-cache-dtype {name}: head dim {head_dim} of model "
            f"{model_config.model} is not supported; allowed head dims: "
            f"{', '.join(map(str, HEAD_DIMS))}")
    if model_config.dtype not in ALLOWED_MODEL_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype {name}: model dtype {model_config.dtype} is not "
            "supported; allowed: float16, bfloat16 (pass --dtype bfloat16 or float16)")
    if model_config.use_mla:
        raise ValueError(
            f"--kv-cache-dtype {name}: model {model_config.model} uses MLA, which KVarN "
            f"does not quantize; KVarN presets ({', '.join(KVARN_CACHE_DTYPES)}) "
            "need standard multi-head or grouped-query attention")


def _check_engine(name: str, vllm_config: VllmConfig) -> None:
    spec = vllm_config.speculative_config
    if spec is not None and spec.method not in SPEC_METHODS:
        raise ValueError(
            f"--kv-cache-dtype {name} with speculative method {spec.method!r} is not "
            f"supported yet: KVarN serves draft-free speculation only "
            f"({', '.join(SPEC_METHODS)}); use --kv-cache-dtype auto or fp8 with a "
            "draft model")
    if vllm_config.parallel_config.use_ubatching:
        raise ValueError(
            f"--kv-cache-dtype {name} does not run with micro-batching (--enable-dbo or "
            "--ubatch-size > 1): the side pool is one per layer, not one per micro-batch")
    side_pool_plan(vllm_config, Preset.parse(name), 1, HEAD_DIMS[0])
