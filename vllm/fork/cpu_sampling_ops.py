"""Pure-torch bodies for the sampling ops of upstream's standalone CPU runner.

``gumbel_sample`` draws the same noise as upstream's kernels (the compiled CPU
one and the Triton one of the GPU runner): Gumbel noise from a MurmurHash3
(x86_32) of the request seed, the token's position and the token id, so a
seeded request samples the same tokens here as there. ``apply_logit_bias``
applies the allowed-token list, the logit bias and min-tokens stop masking.
``cpu_fallback_ops`` registers both with upstream's schemas.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
# Draft proposals and their verification draw from disjoint noise streams.
DRAFT_NOISE_SALT = 1 << 30
# The second hash of a 64-bit uniform is keyed by this domain.
_HIGH_WORD_DOMAIN = 0x9E3779B9


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for x in [0, 2**32), never overflowing int64."""
    high, low = constant >> 16, constant & 0xFFFF
    return (x * low + ((x * high) & 0xFFFF) * 65536) & _MASK32


def _rotl32(x: torch.Tensor, shift: int) -> torch.Tensor:
    return ((x << shift) & _MASK32) | (x >> (32 - shift))


def _mix(h: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
    """One MurmurHash3 body round: fold a 32-bit word into the state."""
    k = _mul32(_rotl32(_mul32(word, 0xCC9E2D51), 15), 0x1B873593)
    return (_rotl32(h ^ k, 13) * 5 + 0xE6546B64) & _MASK32


def _finalize(h: torch.Tensor) -> torch.Tensor:
    h = _mul32(h ^ (h >> 16), 0x85EBCA6B)
    h = _mul32(h ^ (h >> 13), 0xC2B2AE35)
    return h ^ (h >> 16)


def murmur3_hash32(
    seed: int, position: int, token_ids: torch.Tensor, domain: int = 0
) -> torch.Tensor:
    """MurmurHash3 of the words (seed low, seed high, position, token id), as int64."""
    state = torch.tensor(domain, dtype=torch.int64)
    for word in (seed & _MASK32, (seed >> 32) & _MASK32, position & _MASK32):
        state = _mix(state, torch.tensor(word, dtype=torch.int64))
    # 16: the key length in bytes, as the hash's finalization takes it.
    return _finalize(_mix(state, token_ids) ^ 16)


def gumbel_noise(seed: int, position: int, vocab_size: int, use_fp64: bool) -> torch.Tensor:
    """-log(-log(u)) per token id, u uniform in (0, 1) from the hash."""
    tokens = torch.arange(vocab_size, dtype=torch.int64)
    low = murmur3_hash32(seed, position, tokens)
    if use_fp64:
        high = murmur3_hash32(seed, position, tokens, _HIGH_WORD_DOMAIN)
        bits53 = (high << 21) | (low >> 11)
        uniform = (bits53.double() + 0.5) * 2.0**-53
        uniform = torch.where(uniform == 1.0, uniform - 2.0**-53, uniform)
        return -torch.log(-torch.log(uniform))
    # Both 16-bit halves convert to float32 exactly; the sum rounds once.
    uniform = (low >> 16).float() * 2.0**-16 + ((low & 0xFFFF).float() + 0.5) * 2.0**-32
    # log(1 - u): the winning tail (u near 0) keeps float32's resolution there.
    return -torch.log(-torch.log1p(-uniform))


def _argmax_skipping_nan(scores: torch.Tensor) -> torch.Tensor:
    # The kernels compare with '>', so a NaN never wins and ties go to the first token.
    return torch.where(scores.isnan(), float("-inf"), scores).argmax(dim=-1)


# mirrors: csrc/cpu/sampling_kernels.cpp::gumbel_sample_cpu
def gumbel_sample(
    logits: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    apply_temperature: bool,
    is_drafting: bool,
    use_fp64: bool,
) -> torch.Tensor:
    """One token per logits row: Gumbel-max sampling, or argmax at temperature 0.

    Row t belongs to request-state row ``expanded_idx_mapping[t]`` (negative:
    none, so greedy) and samples at ``positions[t]``.
    """
    out = torch.empty(logits.size(0), dtype=torch.int64)
    # Row by row: callers may pass one row expanded (stride 0) to many samples.
    for row, req in enumerate(expanded_idx_mapping.tolist()):
        scores = logits[row].float()
        temp = float(temperature[req]) if req >= 0 else 0.0
        if temp != 0.0:
            if apply_temperature:
                scores = scores / temp
            position = int(positions[row]) + (DRAFT_NOISE_SALT if is_drafting else 0)
            noise = gumbel_noise(int(seeds[req]), position, scores.numel(), use_fp64)
            scores = (scores.double() if use_fp64 else scores) + noise
        out[row] = _argmax_skipping_nan(scores)
    return out


# mirrors: csrc/cpu/sampling_kernels.cpp::apply_logit_bias_cpu
def apply_logit_bias(
    logits: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    positions: torch.Tensor,
    num_allowed_token_ids: torch.Tensor,
    allowed_token_ids: torch.Tensor,
    num_logit_bias: torch.Tensor,
    logit_bias_token_ids: torch.Tensor,
    logit_bias: torch.Tensor,
    min_lens: torch.Tensor,
    num_stop_token_ids: torch.Tensor,
    restore_when_all_masked: torch.Tensor,
    stop_token_ids: torch.Tensor,
    check_all_masked_rows: bool,
) -> None:
    """Edit float32 logits rows in place, per their request's settings, in order:

    only the allowed token ids keep their logits (when the request lists any);
    the bias is added to its token ids; and before the request's min length
    its stop token ids are masked, unless ``check_all_masked_rows`` and the
    request's restore flag are set and that mask would leave nothing finite,
    in which case the stop tokens keep their finite logits.
    """
    minus_inf = float("-inf")
    for row_index, req in enumerate(expanded_idx_mapping.tolist()):
        row = logits[row_index]
        allowed = int(num_allowed_token_ids[req])
        if allowed > 0:
            keep = allowed_token_ids[req, :allowed].to(torch.int64)
            kept = row[keep]
            row.fill_(minus_inf)
            row[keep] = kept
        biased = int(num_logit_bias[req])
        if biased > 0:
            ids = logit_bias_token_ids[req, :biased].to(torch.int64)
            row.index_add_(0, ids, logit_bias[req, :biased].to(row.dtype))
        stops = int(num_stop_token_ids[req])
        if stops == 0 or int(positions[row_index]) + 1 >= int(min_lens[req]):
            continue
        stop_ids = stop_token_ids[req, :stops].to(torch.int64)
        before = row[stop_ids]
        row[stop_ids] = minus_inf
        restore = check_all_masked_rows and int(restore_when_all_masked[req]) != 0
        if restore and bool((row == minus_inf).all()):
            finite = before.isfinite()
            row[stop_ids[finite]] = before[finite]
