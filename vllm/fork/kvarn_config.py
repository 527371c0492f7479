"""Config-time rules for the KVarN cache dtypes, reached from VllmConfig.__post_init__
(after the platform's own check) and from the Attention layer's constructor.

Everything a KVarN run cannot serve fails here, naming the input and what is allowed,
instead of in a worker after the model loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllm.fork.kvarn_dtypes import KVARN_CACHE_DTYPES, is_kvarn_dtype
from vllm.kvarn.preset import HEAD_DIMS, Preset
from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

ALLOWED_MODEL_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class SidePoolPlan:
    """The fp16 side pool of one attention layer: rotated rows not (yet) quantized.

    Each scheduled request holds a sink block (block 0, fp16 for the request's life)
    and its tail; the tails of one step together span at most one block per request
    more than the step's new tokens fill. So ``2 * seats + cdiv(tokens per step, G)``
    blocks always suffice, whatever mix of prefill and (speculative) decode is run.
    """

    seats: int
    num_blocks: int
    num_kv_heads: int
    group: int
    head_dim: int

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_blocks, 2, self.num_kv_heads, self.group, self.head_dim)

    @property
    def bytes_per_layer(self) -> int:
        return self.num_blocks * 2 * self.num_kv_heads * self.group * self.head_dim * 2


def side_pool_plan(vllm_config: VllmConfig, preset: Preset, num_kv_heads: int,
                   head_dim: int) -> SidePoolPlan:
    sched = vllm_config.scheduler_config
    seats = sched.max_num_seqs
    blocks = 2 * seats + cdiv(sched.max_num_batched_tokens, preset.group)
    return SidePoolPlan(seats, blocks, num_kv_heads, preset.group, head_dim)


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
