"""Sizing of the spec-decode scratch pool: pure integer functions, no torch, no vLLM.

The Triton attention backend's split-softmax ("3D") path and the fork's split verify
kernel write per-segment partials into a scratch of ``rows x H_q x segments x D_pad``
float32 partial outputs plus two ``rows x H_q x segments`` float32 statistics, one row
per query token. A batch takes a split path only when it has at most
``seq_threshold_3d`` requests, each with at most ``split_query_len`` query tokens, so
that many rows (never more requests than ``max_num_seqs``) hold every such batch.
"""
from __future__ import annotations

from collections.abc import Sequence

# mirrors: vllm.v1.attention.backends.triton_attn.NUM_PAR_SOFTMAX_SEGMENTS
SEGMENTS = 16  # the pool's split count: upstream's NUM_PAR_SOFTMAX_SEGMENTS
FLOAT32_BYTES = 4


def next_power_of_2(n: int) -> int:
    if n < 1:
        raise ValueError(f"expected a positive integer, got {n}")
    return 1 << (n - 1).bit_length()


# mirrors: vllm.v1.attention.backends.triton_attn.TritonAttentionMetadataBuilder.__init__ (seq_threshold_3D)
def seq_threshold_3d(num_kv_heads: int, min_grid: int,
                     capture_sizes: Sequence[int] | None) -> int:
    """The most requests a split batch has: the launch grid of the non-split kernel
    (requests x KV heads) reaches ``min_grid`` programs beyond it. With full CUDA
    graphs, the capture size nearest to that, so each captured graph takes one path
    (upstream's rule, TritonAttentionMetadataBuilder.__init__)."""
    if num_kv_heads < 1 or min_grid < 1:
        raise ValueError(f"num_kv_heads {num_kv_heads} and min_grid {min_grid} must be positive")
    threshold = min_grid // num_kv_heads
    if capture_sizes:
        threshold = min(capture_sizes, key=lambda size: abs(size - threshold))
    return threshold


# mirrors: vllm.v1.attention.backends.triton_attn.TritonAttentionMetadataBuilder.__init__ (max_query_len_3d)
def split_query_len(num_speculative_tokens: int, parallel_drafting: bool,
                    upstream_max: int, fork_max: int) -> int:
    """Query tokens per request a split batch can have: one without speculation; with
    it, the verify length 1 + k (1 + 2k for parallel drafting, whose drafter runs the
    longer queries), capped by what the split kernels take: ``upstream_max`` for
    upstream's 3D kernel (1 on 0.32.0, 8 on 0.33.0), ``fork_max`` for the fork's verify
    kernel where it serves (16; 0 where it does not)."""
    if num_speculative_tokens < 0:
        raise ValueError(f"num_speculative_tokens {num_speculative_tokens} is negative")
    if upstream_max < 1 or fork_max < 0:
        raise ValueError(f"upstream_max {upstream_max} must be >= 1, fork_max {fork_max} >= 0")
    query_len = 1 + num_speculative_tokens * (2 if parallel_drafting else 1)
    return min(query_len, max(upstream_max, fork_max))


def pool_rows(threshold: int, max_num_seqs: int, query_len: int) -> int:
    """Rows (query tokens) that hold every split batch."""
    if min(threshold, max_num_seqs, query_len) < 1:
        raise ValueError(f"threshold {threshold}, max_num_seqs {max_num_seqs} and query_len "
                         f"{query_len} must be positive")
    return min(threshold, max_num_seqs) * query_len


def pool_bytes(rows: int, num_heads_q: int, head_size: int, segments: int = SEGMENTS) -> int:
    """Bytes of one pool: partials plus row max and row sum, float32."""
    per_row_head_segment = next_power_of_2(head_size) + 2
    return rows * num_heads_q * segments * per_row_head_segment * FLOAT32_BYTES


def is_split_batch(num_reqs: int, max_query_len: int, threshold: int, query_len: int) -> bool:
    """Whether a batch is one the pool is sized for: few enough requests, short enough
    queries. Its tokens then fit the pool's rows (at most ``max_num_seqs`` requests)."""
    return num_reqs <= threshold and max_query_len <= query_len


# mirrors: vllm.v1.attention.backends.triton_attn.TritonAttentionMetadataBuilder.__init__ (max_seqs_64_segments)
def segment_shortfall(num_reqs: int, num_kv_heads: int, num_compute_units: int,
                      segments: int = SEGMENTS) -> int:
    """Requests of a split batch that would have needed more segments: its grid
    (requests x KV heads x segments) leaves compute units idle (upstream gives such
    batches 64 segments on SM120). 0 when the grid fills the device."""
    if num_reqs * num_kv_heads * segments < num_compute_units:
        return num_reqs
    return 0
