"""Pure-torch bodies for the batch bookkeeping ops of upstream's standalone CPU runner.

Upstream's standalone (no-Triton) CPU model runner (``vllm/v1/worker/cpu/``)
prepares each step's inputs and folds the sampled tokens back into its request
state through compiled ``_C.*_cpu`` ops, built only into non-x86 CPU wheels.
These bodies compute the same results with plain torch, one request at a time
where that reads clearer; ``cpu_fallback_ops`` registers them with upstream's
schemas. Tensor dtypes follow the runner's buffers: request-state tables and
lengths are int32, ``idx_mapping`` (batch row -> request-state row), positions,
slots and sampled tokens int64.
"""

from __future__ import annotations

import torch


def _query_bounds(query_start_loc: torch.Tensor, num_reqs: int) -> list[int]:
    return query_start_loc[: num_reqs + 1].tolist()


def _token_rows(query_start_loc: torch.Tensor, num_reqs: int) -> torch.Tensor:
    """The batch row of each scheduled token, in token order."""
    counts = (query_start_loc[1 : num_reqs + 1] - query_start_loc[:num_reqs]).to(torch.int64)
    return torch.repeat_interleave(torch.arange(num_reqs), counts)


# mirrors: csrc/cpu/block_table.cpp::gather_block_table_cpu
def gather_block_table(
    block_table: torch.Tensor,
    output: torch.Tensor,
    idx_mapping: torch.Tensor,
    num_blocks: torch.Tensor,
    num_reqs_padded: int,
) -> None:
    """Copy each batch row's used block ids into ``output``; zero the padding rows."""
    num_reqs = idx_mapping.numel()
    width = min(output.size(1), block_table.size(1))
    rows = idx_mapping.to(torch.int64)
    source = block_table.index_select(0, rows)[:, :width]
    used = torch.arange(width) < num_blocks.index_select(0, rows).unsqueeze(1)
    # Entries past a request's block count keep what the output row held.
    target = output[:num_reqs, :width]
    target.copy_(torch.where(used, source.to(output.dtype), target))
    output[num_reqs:num_reqs_padded].zero_()


# mirrors: csrc/cpu/block_table.cpp::compute_slot_mapping_cpu
def compute_slot_mapping(
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    mapping_enabled: bool,
    pad_slot_id: int,
) -> None:
    """Slot (block id * block size + offset) of each token; pad past the batch."""
    num_reqs = idx_mapping.numel()
    first, num_tokens = int(query_start_loc[0]), int(query_start_loc[num_reqs])
    slot_mapping[num_tokens:] = pad_slot_id
    req = idx_mapping.to(torch.int64)[_token_rows(query_start_loc, num_reqs)]
    pos = positions[first:num_tokens].to(torch.int64)
    # A negative request row marks a batch row to skip: its tokens get the pad slot.
    mapped = (req >= 0) & mapping_enabled
    block_index = torch.where(mapped, pos // block_size, 0)
    blocks = block_table[req.clamp_min(0), block_index].to(torch.int64)
    slots = blocks * block_size + pos % block_size
    slot_mapping[first:num_tokens] = torch.where(mapped, slots, pad_slot_id).to(
        slot_mapping.dtype
    )


# mirrors: csrc/cpu/input_batch.cpp::prepare_prefill_inputs_cpu
def prepare_prefill_inputs(
    input_ids: torch.Tensor,
    next_prefill_tokens: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    all_token_ids: torch.Tensor,
    prefill_len: torch.Tensor,
    num_computed_tokens: torch.Tensor,
) -> None:
    """Prompt tokens of each prefilling request's chunk into ``input_ids``.

    ``next_prefill_tokens[k, req]`` gets the prompt token k places after the
    chunk, or 0 past the prompt's end.
    """
    num_reqs = idx_mapping.numel()
    bounds = _query_bounds(query_start_loc, num_reqs)
    lookahead = next_prefill_tokens.size(0)
    for batch, req in enumerate(idx_mapping.tolist()):
        computed, prompt_len = int(num_computed_tokens[req]), int(prefill_len[req])
        if computed >= prompt_len:
            continue  # decoding: its input token comes from the sampler
        start, end = bounds[batch], bounds[batch + 1]
        tokens = all_token_ids[req]
        input_ids[start:end] = tokens[computed : computed + end - start]
        ahead = computed + end - start + torch.arange(lookahead)
        in_prompt = ahead < prompt_len
        next_prefill_tokens[:, req] = torch.where(
            in_prompt, tokens[ahead.clamp_max(tokens.numel() - 1)], 0
        ).to(next_prefill_tokens.dtype)


# mirrors: csrc/cpu/input_batch.cpp::get_prompt_logprobs_token_ids_cpu
def get_prompt_logprobs_token_ids(
    num_tokens: int,
    query_start_loc: torch.Tensor,
    idx_mapping: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    all_token_ids: torch.Tensor,
) -> torch.Tensor:
    """For each scheduled token, the token that follows it in its request."""
    out = torch.zeros(num_tokens, dtype=torch.int64)
    bounds = _query_bounds(query_start_loc, idx_mapping.numel())
    for batch, req in enumerate(idx_mapping.tolist()):
        start, end = bounds[batch], bounds[batch + 1]
        first = int(num_computed_tokens[req]) + 1
        out[start:end] = all_token_ids[req, first : first + end - start]
    return out


# mirrors: csrc/cpu/input_batch.cpp::prepare_pos_seq_lens_cpu
def prepare_pos_seq_lens(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    pos: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Positions of the scheduled tokens and each request's length after the step."""
    num_reqs = idx_mapping.numel()
    bounds = _query_bounds(query_start_loc, num_reqs)
    seq_lens[num_reqs:] = 0
    for batch, req in enumerate(idx_mapping.tolist()):
        start, end = bounds[batch], bounds[batch + 1]
        computed = int(num_computed_tokens[req])
        seq_lens[batch] = computed + end - start
        pos[start:end] = torch.arange(computed, computed + end - start)


# mirrors: csrc/cpu/input_batch.cpp::prepare_mrope_positions_cpu
def prepare_mrope_positions(
    positions: torch.Tensor,
    prefill_positions: torch.Tensor,
    prefill_delta: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    prefill_lens: torch.Tensor,
    num_computed_tokens: torch.Tensor,
) -> None:
    """Multi-dimensional RoPE positions ``[dims, tokens]`` of the scheduled tokens.

    Prompt tokens take their precomputed per-dimension positions (request r's
    are rows r * dims ... of ``prefill_positions``); generated tokens continue
    from their sequence index shifted by the request's ``prefill_delta``.
    """
    dims = positions.size(0)
    bounds = _query_bounds(query_start_loc, idx_mapping.numel())
    for batch, req in enumerate(idx_mapping.tolist()):
        start, end = bounds[batch], bounds[batch + 1]
        computed = int(num_computed_tokens[req])
        from_prompt = min(end - start, max(int(prefill_lens[req]) - computed, 0))
        split = start + from_prompt
        prompt_rows = prefill_positions[req * dims : (req + 1) * dims]
        positions[:, start:split] = prompt_rows[:, computed : computed + from_prompt]
        generated = torch.arange(computed + from_prompt, computed + end - start)
        positions[:, split:end] = generated + int(prefill_delta[req])


# mirrors: csrc/cpu/input_batch.cpp::combine_sampled_and_draft_tokens_cpu
def combine_sampled_and_draft_tokens(
    input_ids: torch.Tensor,
    idx_mapping: torch.Tensor,
    last_sampled_tokens: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    prefill_len: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_logits: torch.Tensor,
    num_logits: int,
    num_new_sampled_tokens: int,
) -> torch.Tensor:
    """Put each decoding request's last sampled token and drafts into ``input_ids``.

    A request with n logits this step takes them from its last n scheduled
    tokens; returns those token indices, request after request.
    """
    logits_indices = torch.zeros(num_logits, dtype=torch.int64)
    num_reqs = idx_mapping.numel()
    query_ends = query_start_loc[1 : num_reqs + 1].tolist()
    logit_bounds = cu_num_logits[: num_reqs + 1].tolist()
    for batch, req in enumerate(idx_mapping.tolist()):
        lo, hi = logit_bounds[batch], logit_bounds[batch + 1]
        count, end = hi - lo, query_ends[batch]
        logits_indices[lo:hi] = torch.arange(end - count, end)
        seq_len, prompt_len = int(seq_lens[batch]), int(prefill_len[req])
        if seq_len <= prompt_len:
            continue  # still in its prompt: the tokens are the prompt's
        num_drafts = count - num_new_sampled_tokens
        # The first logit's token is a generated one, not the prompt's last.
        if num_new_sampled_tokens > 0 and seq_len - count >= prompt_len:
            input_ids[end - count] = last_sampled_tokens.flatten()[req]
        if num_drafts > 0:
            input_ids[end - num_drafts : end] = draft_tokens[req, :num_drafts]
    return logits_indices


# mirrors: csrc/cpu/input_batch.cpp::post_update_cpu
def post_update(
    idx_mapping: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    last_sampled_tokens: torch.Tensor,
    output_bin_counts: torch.Tensor | None,
    sampled_tokens: torch.Tensor,
    num_sampled: torch.Tensor,
    num_rejected: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    all_token_ids: torch.Tensor,
    total_len: torch.Tensor,
) -> None:
    """Fold a step's sampled tokens into the request state.

    Appends them to ``all_token_ids`` (growing ``total_len``), remembers the
    last, counts each in ``output_bin_counts``, and advances
    ``num_computed_tokens`` by the scheduled tokens less the rejected drafts.
    """
    num_reqs = idx_mapping.numel()
    bounds = None if query_start_loc is None else _query_bounds(query_start_loc, num_reqs)
    for batch, req in enumerate(idx_mapping.tolist()):
        if req < 0:
            continue  # a batch row with no request behind it
        count = int(num_sampled[batch])
        if count > 0:
            tokens = sampled_tokens[batch, :count]
            length = int(total_len[req])
            all_token_ids[req, length : length + count] = tokens.to(all_token_ids.dtype)
            total_len[req] = length + count
            last_sampled_tokens[req] = tokens[-1]
            if output_bin_counts is not None:
                output_bin_counts[req].index_add_(
                    0, tokens.to(torch.int64),
                    torch.ones(count, dtype=output_bin_counts.dtype),
                )
        query_len = 0 if bounds is None else bounds[batch + 1] - bounds[batch]
        num_computed_tokens[req] += query_len - int(num_rejected[batch])
