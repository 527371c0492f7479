"""The stand-ins for upstream's standalone CPU runner ops (topic cpu-fallback-ops).

Each op is called through torch.ops._C, as upstream's vllm/_cpu_ops.py calls it,
on small batches whose expected results are worked out by hand in the comments
(or, for the Gumbel noise, by a MurmurHash3 written here from the algorithm and
checked against published hash values).
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

from vllm.fork.cpu_fallback_ops import register_missing_ops
from vllm.fork.cpu_sampling_ops import DRAFT_NOISE_SALT, murmur3_hash32

register_missing_ops()
C = torch.ops._C
INF = float("inf")


def i32(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def i64(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_gather_block_table_copies_each_rows_used_blocks_and_zeroes_padding():
    block_table = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]],
                               dtype=torch.int32)
    output = torch.full((4, 4), -1, dtype=torch.int32)
    C.gather_block_table_cpu(block_table, output, i64(2, 0), i32(2, 3, 1), 3)
    assert output.tolist() == [
        [30, -1, -1, -1],  # request 2 uses 1 block; the rest of the row is kept
        [10, 11, -1, -1],  # request 0 uses 2
        [0, 0, 0, 0],      # padding row up to num_reqs_padded=3
        [-1, -1, -1, -1],  # past the padding: untouched
    ]


@pytest.mark.parametrize("enabled", [True, False])
def test_compute_slot_mapping_pads_skipped_rows_and_the_tail(enabled):
    block_table = torch.tensor([[5, 7, 9], [2, 3, 4]], dtype=torch.int32)
    slots = torch.full((8,), 99, dtype=torch.int64)
    # Batch rows: request 1 (positions 3, 4), request 0 (5, 6, 7), none (-1).
    C.compute_slot_mapping_cpu(block_table, slots, i64(1, 0, -1), i32(0, 2, 5, 6),
                               i64(3, 4, 5, 6, 7, 0), 4, enabled, -1)
    # Block size 4: position 3 is block 0 (id 2) offset 3 -> 2*4+3 = 11; position 4
    # is block 1 (id 3) -> 12; positions 5-7 are block 1 of request 0 (id 7) -> 29-31.
    mapped = [11, 12, 29, 30, 31] if enabled else [-1] * 5
    assert slots.tolist() == mapped + [-1, -1, -1]


def test_prepare_prefill_inputs_copies_prompt_chunks_and_looks_ahead():
    all_token_ids = torch.tensor([[100 + j for j in range(8)], [200 + j for j in range(8)],
                                  [300 + j for j in range(8)]], dtype=torch.int32)
    input_ids = torch.full((6,), -1, dtype=torch.int32)
    next_prefill = torch.full((2, 3), -1, dtype=torch.int32)
    # Request 0: prompt 6, 2 computed, a chunk of 3. Request 1: prompt 3, all
    # computed (decoding, skipped). Request 2: prompt 5, 4 computed, 1 token.
    C.prepare_prefill_inputs_cpu(input_ids, next_prefill, i64(0, 1, 2), i32(0, 3, 4, 5),
                                 all_token_ids, i32(6, 3, 5), i32(2, 3, 4))
    assert input_ids.tolist() == [102, 103, 104, -1, 304, -1]
    # Lookahead starts after the chunk: request 0 at position 5 (105, then past
    # its prompt: 0); request 2 at 5, already past its prompt of 5.
    assert next_prefill.tolist() == [[105, -1, 0], [0, -1, 0]]


def test_prompt_logprobs_token_ids_are_the_next_token_of_each_position():
    all_token_ids = torch.tensor([[10 + j for j in range(8)], [20 + j for j in range(8)]],
                                 dtype=torch.int32)
    # Batch row 0 is request 1 from position 0 (3 tokens), row 1 request 0 from 4 (2).
    out = C.get_prompt_logprobs_token_ids_cpu(5, i32(0, 3, 5), i64(1, 0), i32(4, 0),
                                              all_token_ids)
    assert out.dtype == torch.int64
    assert out.tolist() == [21, 22, 23, 15, 16]


def test_prepare_pos_seq_lens_counts_from_the_computed_tokens():
    pos = torch.full((6,), -1, dtype=torch.int64)
    seq_lens = torch.full((4,), -1, dtype=torch.int32)
    # Row 0: request 1 (3 computed, 2 scheduled); row 1: request 0 (7 computed, 3).
    C.prepare_pos_seq_lens_cpu(i64(1, 0), i32(0, 2, 5), i32(7, 3), pos, seq_lens)
    assert pos.tolist() == [3, 4, 7, 8, 9, -1]
    assert seq_lens.tolist() == [5, 10, 0, 0]


def test_mrope_positions_take_the_prompts_then_continue_with_the_delta():
    dims, width = 3, 6
    # Prompt position of request r, dimension d, token j: 1000 r + 100 d + j.
    prefill_positions = torch.tensor(
        [[1000 * r + 100 * d + j for j in range(width)] for r in range(2) for d in range(dims)],
        dtype=torch.int32)
    positions = torch.full((dims, 6), -1, dtype=torch.int64)
    # Request 0: prompt 4, 2 computed, 3 scheduled (2 prompt tokens, then 1
    # generated at 2 + 2 + delta 5 = 9). Request 1: prompt 3, all computed,
    # 2 scheduled: 3 - 2 = 1 and 2.
    C.prepare_mrope_positions_cpu(positions, prefill_positions, i32(5, -2), i64(0, 1),
                                  i32(0, 3, 5), i32(4, 3), i32(2, 3))
    assert positions.tolist() == [
        [2, 3, 9, 1, 2, -1],
        [102, 103, 9, 1, 2, -1],
        [202, 203, 9, 1, 2, -1],
    ]


def test_combine_places_the_last_sampled_token_and_drafts_of_decoding_requests():
    input_ids = torch.arange(1000, 1009, dtype=torch.int32)
    last_sampled = i64(70, 71, 72).view(3, 1)  # the runner keeps [max_num_reqs, 1]
    drafts = torch.tensor([[80, 81], [90, 91], [95, 96]], dtype=torch.int64)
    # Row 0: request 2 mid-prompt (seq 6 <= prompt 10), 4 tokens, 1 logit.
    # Row 1: request 0 decoding (seq 9 > prompt 5), 3 tokens, 3 logits (1 + 2 drafts).
    # Row 2: request 1, seq 5 > prompt 4 but its first logit (position 3) is
    # the prompt's, so only its 1 draft goes in.
    indices = C.combine_sampled_and_draft_tokens_cpu(
        input_ids, i64(2, 0, 1), last_sampled, i32(0, 4, 7, 9), i32(6, 9, 5),
        i32(5, 4, 10), drafts, i32(0, 1, 4, 6), 6, 1)
    assert indices.tolist() == [3, 4, 5, 6, 7, 8]  # each row's last tokens
    assert input_ids.tolist() == [1000, 1001, 1002, 1003, 70, 80, 81, 1007, 90]


def _post_update_state():
    return dict(num_computed=i32(10, 0, 4), last=torch.zeros(3, 1, dtype=torch.int64),
                bins=torch.zeros(3, 6, dtype=torch.int32),
                all_ids=torch.zeros(3, 8, dtype=torch.int32), total=i32(6, 0, 2))


def test_post_update_appends_counts_and_advances_each_request():
    s = _post_update_state()
    sampled = torch.tensor([[5, 1, 5], [4, 4, 4], [3, 0, 0]], dtype=torch.int64)
    # Row 0: request 2, 3 sampled (1 draft rejected) of 4 scheduled. Row 1: no
    # request (-1), skipped. Row 2: request 0, 1 sampled of 1 scheduled.
    C.post_update_cpu(i64(2, -1, 0), s["num_computed"], s["last"], s["bins"], sampled,
                      i32(3, 2, 1), i32(1, 0, 0), i32(0, 4, 5, 6), s["all_ids"], s["total"])
    assert s["all_ids"].tolist() == [[0, 0, 0, 0, 0, 0, 3, 0], [0] * 8,
                                     [0, 0, 5, 1, 5, 0, 0, 0]]
    assert s["total"].tolist() == [7, 0, 5]
    assert s["last"].flatten().tolist() == [3, 0, 5]
    assert s["bins"].tolist() == [[0, 0, 0, 1, 0, 0], [0] * 6, [0, 1, 0, 0, 0, 2]]
    assert s["num_computed"].tolist() == [11, 0, 4 + 4 - 1]


def test_post_update_without_query_lengths_only_takes_back_rejected_drafts():
    s = _post_update_state()
    sampled = torch.tensor([[2, 3]], dtype=torch.int64)
    C.post_update_cpu(i64(2), s["num_computed"], s["last"], None, sampled, i32(2), i32(1),
                      None, s["all_ids"], s["total"])
    assert s["all_ids"][2].tolist() == [0, 0, 2, 3, 0, 0, 0, 0]
    assert s["num_computed"].tolist() == [10, 0, 3]


# --- Gumbel sampling ----------------------------------------------------------

def murmur3_x86_32(data: bytes, seed: int) -> int:
    """MurmurHash3_x86_32, written from the algorithm's description."""
    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF

    c1, c2, h = 0xCC9E2D51, 0x1B873593, seed
    body = len(data) - len(data) % 4
    for (k,) in struct.iter_unpack("<I", data[:body]):
        h ^= rotl(k * c1 & 0xFFFFFFFF, 15) * c2 & 0xFFFFFFFF
        h = (rotl(h, 13) * 5 + 0xE6546B64) & 0xFFFFFFFF
    if len(data) % 4:
        tail = int.from_bytes(data[body:], "little")
        h ^= rotl(tail * c1 & 0xFFFFFFFF, 15) * c2 & 0xFFFFFFFF
    h ^= len(data)
    for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        h = (h ^ (h >> shift)) * mul & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_the_reference_hash_gives_the_published_values():
    assert murmur3_x86_32(b"", 0) == 0
    assert murmur3_x86_32(b"", 1) == 0x514E28B7
    assert murmur3_x86_32(b"test", 0) == 0xBA6BD213
    assert murmur3_x86_32(b"The quick brown fox jumps over the lazy dog", 0) == 0x2E4FF723
    assert murmur3_x86_32(bytes(range(16)), 0x9E3779B9) == 0x52438DE6


def _key(seed: int, position: int, token: int) -> bytes:
    # The noise hashes four 32-bit words: the seed's low and high halves, the position, the token.
    return struct.pack("<4I", seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF,
                       position & 0xFFFFFFFF, token)


@pytest.mark.parametrize("seed,position", [(7, 3), (-5, 2**31 + 9), (2**40 + 1, 0)])
def test_the_noise_hash_is_murmur3_of_seed_position_and_token(seed, position):
    tokens = torch.arange(40, dtype=torch.int64)
    for domain in (0, 0x9E3779B9):
        expected = [murmur3_x86_32(_key(seed, position, t), domain) for t in range(40)]
        assert murmur3_hash32(seed, position, tokens, domain).tolist() == expected


def expected_gumbel_token(logits: list[float], seed: int, position: int, temperature: float,
                          use_fp64: bool) -> int:
    """Gumbel-max over the tokens, noise from the hash's uniform u: -log(-log(...))."""
    best, best_token = -INF, 0
    for token, logit in enumerate(logits):
        low = murmur3_x86_32(_key(seed, position, token), 0)
        if use_fp64:
            high = murmur3_x86_32(_key(seed, position, token), 0x9E3779B9)
            u = (((high << 32 | low) >> 11) + 0.5) / 2**53
            noise = -math.log(-math.log(u))
        else:
            u = (low + 0.5) / 2**32
            noise = -math.log(-math.log1p(-u))
        if logit / temperature + noise > best:
            best, best_token = logit / temperature + noise, token
    return best_token


def test_gumbel_sample_is_greedy_at_temperature_zero_and_for_rows_without_a_request():
    logits = torch.tensor([[0.1, 2.0, -1.0, 2.0], [float("nan"), 1.0, 0.5, 0.0],
                           [3.0, 0.0, 0.0, 4.0]])
    # Rows 0 and 1 belong to request 0 (temperature 0); row 2 to no request.
    out = C.gumbel_sample_cpu(logits, i64(0, 0, -1), torch.tensor([0.0, 1.0]), i64(1, 2),
                              i64(0, 0, 0), True, False, False)
    assert out.tolist() == [1, 1, 3]  # ties go to the first token; NaN never wins


@pytest.mark.parametrize("use_fp64", [False, True])
@pytest.mark.parametrize("is_drafting", [False, True])
def test_gumbel_sample_draws_upstreams_noise(use_fp64, is_drafting):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=generator)
    seeds, temperature = i64(11, -3, 2**33 + 5), torch.tensor([0.7, 1.0, 2.5])
    rows, positions = i64(0, 1, 2, 0, 1, 2), i64(0, 1, 2, 3, 4, 2**31 + 1)
    out = C.gumbel_sample_cpu(logits, rows, temperature, seeds, positions, True, is_drafting,
                              use_fp64)
    salt = DRAFT_NOISE_SALT if is_drafting else 0
    expected = [expected_gumbel_token(logits[t].tolist(), int(seeds[r]), int(positions[t]) + salt,
                                      float(temperature[r]), use_fp64)
                for t, r in enumerate(rows.tolist())]
    assert out.tolist() == expected
    # The draws are not the argmax: noise moved at least one row.
    assert out.tolist() != logits.argmax(dim=1).tolist()


def test_gumbel_sample_without_temperature_scaling_adds_noise_to_the_raw_logits():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(1)) * 3
    out = C.gumbel_sample_cpu(logits, i64(0, 0), torch.tensor([4.0]), i64(9), i64(5, 6),
                              False, False, True)
    assert out.tolist() == [expected_gumbel_token(logits[t].tolist(), 9, 5 + t, 1.0, True)
                            for t in range(2)]


# --- logit bias ------------------------------------------------------------------

def _padded(rows: list[list], dtype) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=dtype)


def _apply_logit_bias(logits, positions, allowed, bias, min_lens, stops, restore, check):
    C.apply_logit_bias_cpu(
        logits, torch.arange(logits.size(0), dtype=torch.int64), i64(*positions),
        i32(*map(len, allowed)), _padded(allowed, torch.int32),
        i32(*map(len, bias)), _padded([[t for t, _ in b] for b in bias], torch.int32),
        _padded([[v for _, v in b] for b in bias], torch.float32),
        i32(*min_lens), i32(*map(len, stops)), i32(*restore), _padded(stops, torch.int32),
        check)


def test_logit_bias_allowed_tokens_bias_and_min_tokens_stop_masking():
    logits = torch.arange(6, dtype=torch.float32).repeat(3, 1)
    _apply_logit_bias(
        logits, positions=[0, 5, 1],
        # Row 0: only tokens 1 and 4, then +1.5 on 4. Row 1: +1 twice on token 0;
        # stops past the min length (position 5 + 1 >= 3). Row 2: stops 2 and 3
        # masked below its min length (1 + 1 < 10).
        allowed=[[1, 4], [], []], bias=[[(4, 1.5)], [(0, 1.0), (0, 1.0)], []],
        min_lens=[0, 3, 10], stops=[[], [2, 3], [2, 3]], restore=[0, 0, 0], check=False)
    assert logits.tolist() == [[-INF, 1, -INF, -INF, 5.5, -INF], [2, 1, 2, 3, 4, 5],
                               [0, 1, -INF, -INF, 4, 5]]


def test_a_row_the_stop_mask_would_empty_keeps_its_stop_tokens_when_asked():
    logits = torch.arange(6, dtype=torch.float32).repeat(3, 1)
    _apply_logit_bias(
        logits, positions=[0, 0, 0],
        # Rows 0 and 1 allow only their stop tokens; row 0 asks to restore them.
        # Row 2 also allows token 1, so its mask leaves something and stays.
        allowed=[[2, 3], [2, 3], [1, 2]], bias=[[], [], []], min_lens=[5, 5, 5],
        stops=[[2, 3], [2, 3], [2]], restore=[1, 0, 1], check=True)
    assert logits.tolist() == [[-INF, -INF, 2, 3, -INF, -INF], [-INF] * 6,
                               [-INF, 1, -INF, -INF, -INF, -INF]]
