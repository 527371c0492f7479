"""Compile every variant of upstream's DFlash input kernel at boot.

``prepare_dflash_inputs`` launches its Triton kernel with
``BLOCK_SIZE = min(256, next_pow2(max_query_len + 1 + k))``, so the first request
whose longest query reaches a new power of two pays a JIT compile (up to 9
variants). Topic dflash2-prewarm calls ``prewarm_input_kernel`` once the drafter's
attention is set up (DFlashSpeculator.init_cudagraph_manager, eager or graphs): it
launches the kernel once per reachable variant on a one-request dummy batch built
from the same buffers a real step uses, so every compile key matches a real call.
The launches only write the speculator's own input buffers (overwritten by every
step) and the target's dummy-batch rows, as the runner's own dummy runs do.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.logger import init_logger

from vllm.fork.spec_lookup import dflash_prewarm_plan

logger = init_logger(__name__)


def max_query_len(speculator: Any) -> int:
    """The longest target query one request can bring to a step."""
    return min(speculator.max_num_tokens, speculator.max_model_len,
               speculator.target_input_buffers.max_num_tokens)


# mirrors: vllm.v1.worker.gpu.spec_decode.dflash.speculator.prepare_dflash_inputs (its BLOCK_SIZE)
@torch.inference_mode()
def prewarm_input_kernel(speculator: Any) -> list[int]:
    """Launch prepare_dflash_inputs once per variant; return the BLOCK_SIZEs."""
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import prepare_dflash_inputs

    device = speculator.device
    plan = dflash_prewarm_plan(max_query_len(speculator), speculator.num_query_per_req)
    # Same dtypes as the runner passes (its dummy runs use these too).
    num_sampled = torch.ones(1, dtype=torch.int32, device=device)
    num_rejected = torch.zeros(1, dtype=torch.int32, device=device)
    last_sampled = torch.zeros(speculator.max_num_reqs, 1, dtype=torch.int64, device=device)
    next_prefill = torch.zeros(1, speculator.max_num_reqs, dtype=torch.int32, device=device)
    for _, query in plan:
        batch = InputBatch.make_dummy(1, query, speculator.target_input_buffers)
        for i, gid in enumerate(speculator.draft_kv_cache_group_ids):
            prepare_dflash_inputs(
                speculator.input_buffers,
                speculator.block_tables.slot_mappings[gid],
                speculator.context_positions,
                speculator._context_slot_mappings[i],
                speculator.sample_indices,
                speculator.sample_pos,
                speculator.sample_idx_mapping,
                speculator.temperature,
                speculator.seeds,
                batch,
                num_sampled,
                num_rejected,
                last_sampled,
                next_prefill,
                speculator.temperature,
                speculator.seeds,
                speculator.block_tables.input_block_tables[gid],
                speculator.block_tables.block_sizes[gid],
                speculator.block_tables.cp_rank,
                speculator.dcp_size,
                speculator.block_tables.cp_interleave,
                speculator.parallel_drafting_token_id,
                speculator.num_query_per_req,
                speculator.num_speculative_steps,
                speculator.max_num_reqs,
                speculator.max_num_tokens,
                speculator.max_model_len,
                speculator.sample_from_anchor,
            )
    # Nothing a dummy launch wrote may be mistaken for a request's sample row.
    speculator.sample_idx_mapping.fill_(-1)
    sizes = [size for size, _ in plan]
    logger.info("%s: compiled the DFlash input kernel for BLOCK_SIZE %s at boot.",
                speculator._speculator_name, ", ".join(map(str, sizes)))
    return sizes
