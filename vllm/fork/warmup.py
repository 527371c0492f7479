"""Warm a one-request prefill at boot, beside upstream's Model Runner V2 warm-up.

Upstream's ``warmup_kernels`` prefills every warm-up request in one batch, so each
attention launch of its prefill step has several sequences; a single request's prefill
(the first request a server sees) is a batch of one, and Triton keys an int argument
equal to 1 apart from any other value. On TRITON_ATTN that left the 2D
``kernel_unified_attention`` variant for ``num_seqs == 1`` to be compiled by the first
request, whenever no warm-up step reached it by chance (a verify longer than the 3D
path takes, k >= 8, did): upstream's JIT monitor reported it at k = 3 and k = 7 on the
H200. Topic warmup-one-request-prefill calls ``warm_one_request_prefill`` at the end of
``warmup_kernels``, inside its window (adaptive verification off, before capture and the
JIT monitor): one request prefilled, sampled and finished through the worker's own
``execute_model``/``sample_tokens``, as upstream's warm-up requests are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from vllm.logger import init_logger

logger = init_logger(__name__)

REQUEST_ID = "_kiln_warmup_one_prefill_"
# Longer than any query upstream's split (3D) attention path takes (8 tokens in 0.33).
# mirrors: vllm.v1.attention.ops.triton_unified_attention.MAX_3D_QUERY_LEN
MIN_PROMPT_TOKENS = 17


def prompt_tokens(decode_query_len: int, max_num_batched_tokens: int,
                  max_model_len: int) -> int:
    """The warm-up prompt's length: a prefill (longer than a decode or verify query
    and than the split path's limit) that one step can schedule whole."""
    want = max(MIN_PROMPT_TOKENS, decode_query_len + 1)
    return max(1, min(want, max_num_batched_tokens, max_model_len - decode_query_len))


def warmup_blocks(model_runner: Any) -> int:
    """The KV blocks warm-up may address. 0.34.0's extensible KV cache (on by default on
    CUDA) backs only part of the pool during warm-up, so kv_cache_config.num_blocks
    overstates it there; upstream's num_committable_kv_blocks says how many."""
    try:
        from vllm.v1.worker.extensible_kv_cache import num_committable_kv_blocks
    except ImportError:  # 0.33.0: the whole pool is allocated before warm-up
        return model_runner.kv_cache_config.num_blocks
    return num_committable_kv_blocks(model_runner)


def commit_blocks(model_runner: Any, num_blocks: int) -> None:
    """Back the first ``num_blocks`` blocks of an extensible KV cache, as upstream's
    warm-up does before it addresses them (a no-op for a cache allocated whole)."""
    try:
        from vllm.v1.worker.extensible_kv_cache import ensure_kv_cache_blocks
    except ImportError:  # 0.33.0
        return
    ensure_kv_cache_blocks(model_runner, num_blocks)


# mirrors: vllm.v1.worker.gpu.warmup.run_mixed_prefill_decode_warmup (block ids from 1, checked against the
# cache's blocks, counted by _warmup_block_counter)
@torch.inference_mode()
def warm_one_request_prefill(model_runner: Any,
                             execute_model: Callable[[Any], Any],
                             sample_tokens: Callable[[Any], Any]) -> int | None:
    """Prefill, sample and finish one request; return its prompt length (None when the
    runner serves no such step: pooling or encoder models)."""
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
    from vllm.v1.request import Request
    from vllm.v1.worker.gpu.warmup import _warmup_block_counter

    from vllm import SamplingParams

    if (model_runner.is_pooling_model or model_runner.is_encoder_decoder
            or model_runner.vllm_config.is_mm_encoder_only):
        return None
    n = prompt_tokens(model_runner.decode_query_len,
                      model_runner.scheduler_config.max_num_batched_tokens,
                      model_runner.max_model_len)
    block_count = _warmup_block_counter(model_runner)
    next_block = 1  # block 0 is the null block
    block_ids = []
    for group in model_runner.kv_cache_config.kv_cache_groups:
        count = block_count(n, group.kv_cache_spec)
        block_ids.append(list(range(next_block, next_block + count)))
        next_block += count
    available = warmup_blocks(model_runner)
    if next_block > available:
        logger.warning("kiln: skipped the one-request prefill warm-up: it needs %d KV "
                       "blocks, warm-up may address %d", next_block, available)
        return None
    commit_blocks(model_runner, next_block)

    prompt = list(range(n))
    request = Request(REQUEST_ID, prompt, SamplingParams(temperature=0.0), None,
                      mm_features=[])
    prefill = SchedulerOutput.make_empty()
    prefill.num_spec_tokens_to_schedule = model_runner.num_speculative_steps
    prefill.scheduled_new_reqs = [NewRequestData.from_request(
        request, block_ids=tuple(block_ids), prefill_token_ids=prompt)]
    prefill.num_scheduled_tokens = {REQUEST_ID: n}
    prefill.total_num_scheduled_tokens = n
    finish = SchedulerOutput.make_empty()
    finish.finished_req_ids = {REQUEST_ID}

    model_runner.kv_connector.set_disabled(True)
    try:
        execute_model(prefill)
        sample_tokens(None)
        execute_model(finish)
    finally:
        model_runner.kv_connector.set_disabled(False)
    logger.info("kiln: warmed a one-request prefill of %d tokens at boot", n)
    return n
