"""Speculative verify batches of upstream's TRITON_ATTN backend through the fork's
split-KV multi-query kernel (``vllm.specattn``).

The topic ``spec-decode-attn`` calls ``serves`` in TritonAttentionImpl.forward once the
cache views are made, and ``forward`` in place of upstream's unified_attention where it
says yes: a causal decoder batch whose requests have at most 16 query tokens and at
least one has two or more (a verify), over a bf16/fp16, fp8, int8/fp8 per-token-head or
int4 per-token-head cache, with none of the features the kernel lacks (sliding window,
ALiBi, soft cap, sinks, multimodal prefix ranges, R-SWA, fused output quantization).
Upstream's 0.32.0 kernel runs such batches on its 2D path (one program per few query
tokens, each reading the whole context); 0.33.0's 3D path splits them up to 8 tokens,
not INT4. The fork's kernel reads each KV tile once per request and KV head for all
query tokens and heads, and splits the context into the scratch pool's 16 segments
when the batch is small enough to take a split path (``spec_scratch``).

``VLLM_TRITON_SPEC_VERIFY_ATTN``: ``1`` on, ``0`` off, unset: on where the benchmark
(bench/specattn_verify.py) measured it faster, which ``MEASURED_FASTER`` lists.

KVarN caches never reach this backend: the KVARN backend (``kvarn_backend``) serves its
own verify rows through ``vllm.kvarn.decode.attend``, the same split-KV design over its
records.
"""
from __future__ import annotations

import importlib.util

import torch
from vllm.logger import init_logger

from vllm import envs

logger = init_logger(__name__)

# vllm.specattn.MAX_QUERY_LEN. vllm.specattn imports Triton itself, so it is imported
# only where Triton is installed: upstream imports this backend on every platform.
MAX_QUERY_LEN = 16

# (compute capability) -> the --kv-cache-dtype values the fork's kernel was measured
# faster for on verify batches: H200, bench/specattn_verify.py (RELEASE-NOTES.md, issue
# 11): against 0.33.0's 3D path bf16 (auto) 1.51x and fp16 1.43x at head 128 (bf16 1.28x
# at 256), fp8 2.01x (medians); int4 faster than its only upstream path (2D) in 23 of 24
# shapes. int8/fp8 per-token-head: 4 shapes only since their rows load as words.
MEASURED_FASTER: dict[tuple[int, int], frozenset[str]] = {
    (9, 0): frozenset({"auto", "bfloat16", "float16", "fp8", "fp8_e4m3",
                       "int4_per_token_head"}),
}
MAX_HEAD_SIZE = 256  # the kernel's fp32 accumulator per row block

_enabled: dict[str, bool] = {}


def enabled(kv_cache_dtype: str) -> bool:
    """Whether verify batches over this cache dtype go to the fork's kernel."""
    on = _enabled.get(kv_cache_dtype)
    if on is None:
        setting = envs.VLLM_TRITON_SPEC_VERIFY_ATTN
        if importlib.util.find_spec("triton") is None or kv_cache_dtype not in _cache_modes():
            on = False
        elif setting is not None:
            on = setting
        else:
            from vllm.platforms import current_platform

            cap = current_platform.get_device_capability()
            measured = MEASURED_FASTER.get((cap.major, cap.minor), frozenset()) if cap else ()
            on = kv_cache_dtype in measured
        _enabled[kv_cache_dtype] = on
        logger.info_once("Speculative verify attention for --kv-cache-dtype %s: %s",
                         kv_cache_dtype, "the fork's split-KV kernel" if on else "upstream's")
    return on


def _cache_modes() -> dict:
    from vllm.specattn import CACHE_DTYPES

    return CACHE_DTYPES


def upstream_split_query_len(kv_cache_dtype: str) -> int:
    """Query tokens per request upstream's own split (3D) path takes: up to its
    MAX_3D_QUERY_LEN, but 1 for int4 (its launcher runs multi-query batches in 2D)."""
    from vllm.v1.attention.ops import triton_unified_attention

    if kv_cache_dtype == "int4_per_token_head":
        return 1
    return triton_unified_attention.MAX_3D_QUERY_LEN


FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_per_token_head")


def serves(impl, layer, attn_metadata, query: torch.Tensor, output_scale) -> bool:
    """Host-only checks (metadata ints, layer settings): no device reads."""
    from vllm.v1.attention.backend import AttentionType

    if not 2 <= attn_metadata.max_query_len <= MAX_QUERY_LEN:
        return False
    if not enabled(impl.kv_cache_dtype):
        return False
    from vllm.specattn import CACHE_DTYPES, Mode

    if query.dtype == torch.float8_e4m3fn:  # upstream quantized it for an fp8 cache
        query_ok = CACHE_DTYPES[impl.kv_cache_dtype] == Mode.FP8 and layer._q_scale.numel() == 1
    else:
        query_ok = query.dtype in (torch.bfloat16, torch.float16)
    return (query_ok
            and (impl.kv_cache_dtype not in FP8_CACHE_DTYPES
                 or impl.fp8_dtype == torch.float8_e4m3fn)
            and attn_metadata.causal is True
            and impl.attn_type == AttentionType.DECODER
            and impl.head_size <= MAX_HEAD_SIZE
            and impl.alibi_slopes is None
            and impl.sliding_window == (-1, -1)
            and not impl.logits_soft_cap
            and impl.sinks is None
            and output_scale is None
            and attn_metadata.mm_prefix_range_tensor is None
            and attn_metadata.rswa_prefix_lens is None)


# One max_query_len per power of two: the kernel's row layout (and so its compile key)
# follows next_pow2(max_query_len); split or not is the other half of the key.
PREWARM_QUERY_LENS = (2, 4, 8, MAX_QUERY_LEN)
_prewarmed: set[tuple] = set()


def _prewarm(impl, cache, query: torch.Tensor, attn_metadata, output: torch.Tensor,
             q_scale, scratch) -> None:
    """Compile every launch variant this layer's geometry can take, on the first verify
    batch (upstream's warm-up runs one before its JIT monitor arms), so a later batch of
    another length, a short prefill over a cached prefix say, compiles nothing. Dummy
    one-request launches over this cache: they read block 0 and write only their own
    buffers."""
    from vllm.specattn import verify_attention

    n = MAX_QUERY_LEN
    split_ok = scratch[1].shape[0] >= n
    key = (impl.kv_cache_dtype, query.dtype, impl.num_heads, impl.num_kv_heads,
           impl.head_size, tuple(cache.key.shape[1:]), split_ok)
    if key in _prewarmed or (query.is_cuda and torch.cuda.is_current_stream_capturing()):
        return  # under capture the launches would join the graph: the next eager call
    _prewarmed.add(key)
    q = query.new_zeros((n, impl.num_heads, impl.head_size))
    out = output.new_zeros((n, impl.num_heads, impl.head_size))
    table = torch.zeros_like(attn_metadata.block_table[:1])
    segments = attn_metadata.num_par_softmax_segments
    for q_len in PREWARM_QUERY_LENS:
        seq_lens = torch.tensor([q_len], dtype=torch.int32, device=query.device)
        qsl = torch.tensor([0, q_len], dtype=torch.int32, device=query.device)
        for splits in ((1, segments) if split_ok else (1,)):
            verify_attention(q[:q_len], cache, table, seq_lens, qsl, q_len, impl.scale,
                             out[:q_len], q_scale=q_scale, num_splits=splits,
                             scratch=scratch if splits > 1 else None)
    logger.info("Speculative verify attention: compiled the fork's kernel for query "
                "lengths up to %s (%s) on %s, %d query / %d KV heads, head size %d",
                ", ".join(map(str, PREWARM_QUERY_LENS)),
                "split and unsplit" if split_ok else "unsplit", impl.kv_cache_dtype,
                impl.num_heads, impl.num_kv_heads, impl.head_size)


def forward(impl, layer, query: torch.Tensor, key_cache: torch.Tensor,
            value_cache: torch.Tensor, attn_metadata, output: torch.Tensor) -> torch.Tensor:
    """The verify batch through the fork's kernel, written into output."""
    from vllm.specattn import CACHE_DTYPES, Mode, PagedCache, verify_attention

    mode = CACHE_DTYPES[impl.kv_cache_dtype]
    if mode == Mode.FP8:
        cache = PagedCache(mode, key_cache, value_cache, layer._k_scale, layer._v_scale)
    elif mode == Mode.PLAIN:
        cache = PagedCache(mode, key_cache, value_cache)
    else:
        cache = PagedCache(mode, key_cache, value_cache, impl._k_scale_cache,
                           impl._v_scale_cache)
    n = attn_metadata.num_actual_tokens
    num_seqs = attn_metadata.seq_lens.shape[0]
    scratch = (attn_metadata.softmax_segm_output, attn_metadata.softmax_segm_max,
               attn_metadata.softmax_segm_expsum)
    split = (num_seqs <= attn_metadata.seq_threshold_3D and scratch[1].shape[0] >= n)
    q = query[:n]
    q_scale = layer._q_scale if q.dtype == torch.float8_e4m3fn else None
    _prewarm(impl, cache, query, attn_metadata, output, q_scale, scratch)
    verify_attention(
        q, cache, attn_metadata.block_table, attn_metadata.seq_lens,
        attn_metadata.query_start_loc, attn_metadata.max_query_len, impl.scale, output[:n],
        q_scale=q_scale,
        num_splits=attn_metadata.num_par_softmax_segments if split else 1,
        scratch=scratch if split else None)
    return output
