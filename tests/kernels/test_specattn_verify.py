"""The fork's verify attention kernel (specattn/verify.py) against the torch fp32
reference over every cache dtype of upstream's TRITON_ATTN backend.

CPU: ``TRITON_INTERPRET=1``, tiny shapes. With CUDA, the GPU-only cases add head_size
256, long contexts and a CUDA-graph capture and replay.
"""
from __future__ import annotations

import pytest
import torch
from specattn_cases import DEVICE, DTYPES, ON_GPU, make_batch, relative_errors, scratch

from specattn import MAX_QUERY_LEN, Mode, PagedCache, verify_attention
from specattn import reference as ref
from specattn.verify import row_blocks

gpu_only = pytest.mark.skipif(not ON_GPU, reason="GPU-only shape (needs CUDA, no interpreter)")
QUERY_LENS = [1, 2, 5, 8, 16]
# bf16 outputs carry 2**-9 rounding; a wrong mask, scale or page is off by > 10%.
BOUND = {"fp16": 4e-3}
DEFAULT_BOUND = 1.2e-2


def contexts_around_pages(q: int, page: int = 16) -> list[int]:
    return [max(c, q) for c in (page - 1, page, page + 1, 2 * page + q)]


def run(batch, num_splits: int, **kw) -> tuple[list[float], torch.Tensor]:
    t, hq, d = batch.q.shape
    out = torch.full_like(batch.q if batch.q.dtype != torch.float8_e4m3fn else
                          batch.q.to(torch.bfloat16), float("nan"))
    scr = scratch(t, hq, max(num_splits, 1), d) if num_splits > 1 else None
    q_scale = kw.pop("q_scale", None)
    verify_attention(batch.q, batch.cache, batch.block_table, batch.seq_lens,
                     batch.query_start_loc, batch.max_query_len, d ** -0.5, out,
                     num_splits=num_splits, scratch=scr, q_scale=q_scale, **kw)
    want = ref.verify_attention(batch.q, batch.cache, batch.block_table, batch.seq_lens,
                                batch.query_start_loc, d ** -0.5, q_scale=q_scale)
    return relative_errors(out, want, batch.query_start_loc), out


@pytest.mark.parametrize("query_len", QUERY_LENS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_dtype_and_query_len_split(dtype, query_len):
    """Split-K on (3 splits: some contexts have fewer tiles than splits), requests with
    q_len, q_len - 1 and 1 query tokens, contexts on both sides of a page boundary."""
    ctx = contexts_around_pages(query_len)
    qlens = [query_len, max(1, query_len - 1), 1, query_len]
    batch = make_batch(dtype, ctx, qlens, seed=query_len)
    errs, out = run(batch, num_splits=3)
    assert max(errs) < BOUND.get(dtype, DEFAULT_BOUND), errs
    assert not out.isnan().any()


@pytest.mark.parametrize("query_len", [2, 16])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_dtype_without_split(dtype, query_len):
    batch = make_batch(dtype, contexts_around_pages(query_len), [query_len] * 4,
                       seed=100 + query_len)
    errs, _ = run(batch, num_splits=1)
    assert max(errs) < BOUND.get(dtype, DEFAULT_BOUND), errs


@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("dtype", ["bf16", "int4_pth"])
def test_gqa_and_head_sizes(dtype, gqa, head_size):
    batch = make_batch(dtype, [20, 47], [8, 5], kv_heads=2, gqa=gqa, head_size=head_size,
                       seed=gqa * head_size)
    errs, _ = run(batch, num_splits=2)
    assert max(errs) < DEFAULT_BOUND, errs


@pytest.mark.parametrize("head_size", [32, 60, 80, 128])
@pytest.mark.parametrize("dtype", ["int8_pth", "fp8_pth"])
def test_8bit_rows_as_words_and_bytes(dtype, head_size):
    """8-bit rows are read as int32 words from head 64 padded up (60: one padded word
    column; 80: 20 of 32), byte by byte below it (32), split and not."""
    batch = make_batch(dtype, [20, 47], [8, 5], kv_heads=2, gqa=4, head_size=head_size,
                       seed=head_size)
    for splits in (1, 3):
        errs, _ = run(batch, num_splits=splits)
        assert max(errs) < DEFAULT_BOUND, (splits, errs)


@pytest.mark.parametrize("dtype", ["bf16", "int8_pth", "int4_pth"])
def test_row_blocks_cover_every_token(dtype):
    """16 tokens x GQA 4 = 64 rows in row blocks of 16: four programs per KV head."""
    assert row_blocks(16, 4, 64, max_rows=16) == (4, 16, 4)
    batch = make_batch(dtype, [40, 16], [16, 9], seed=7)
    errs, _ = run(batch, num_splits=2, max_rows=16)
    assert max(errs) < DEFAULT_BOUND, errs


@pytest.mark.parametrize("page", [32, 48])
def test_pages_larger_than_and_not_a_multiple_of_the_tile(page):
    batch = make_batch("int8_pth", [page + 3, 3 * page - 1], [5, 8], page=page, seed=page)
    errs, _ = run(batch, num_splits=3, tile=32)
    assert max(errs) < DEFAULT_BOUND, errs


def test_fp8_query_with_its_scale():
    """fp8 caches on CUDA get an fp8 query (upstream's query quantization) and q_scale."""
    batch = make_batch("fp8", [33, 18], [8, 3], seed=3)
    q_scale = torch.tensor([0.05], device=DEVICE)
    batch.q = (batch.q.float() / q_scale).to(torch.float8_e4m3fn)
    errs, out = run(batch, num_splits=2, q_scale=q_scale)
    assert out.dtype == torch.bfloat16
    assert max(errs) < DEFAULT_BOUND, errs


def test_padding_requests_and_untouched_rows():
    """A padding request (no query tokens, seq_len 0) writes nothing and breaks nothing."""
    batch = make_batch("bf16", [30, 1, 25], [4, 0, 3], seed=11)
    batch.seq_lens[1] = 0
    errs, out = run(batch, num_splits=4)
    assert len(errs) == 2 and max(errs) < DEFAULT_BOUND, errs
    assert out.shape[0] == 7 and not out.isnan().any()


def test_every_query_token_sees_exactly_its_prefix():
    """Row i of a verify equals a one-token decode at seq_len - (q_len - 1 - i)."""
    batch = make_batch("int8_pth", [37], [6], seed=5)
    _, full = run(batch, num_splits=2)
    for i in (0, 3, 5):
        one = make_batch("int8_pth", [37], [6], seed=5)
        one.q = batch.q[i:i + 1]
        one.seq_lens = batch.seq_lens - (5 - i)
        one.query_start_loc = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
        one.max_query_len = 1
        _, single = run(one, num_splits=2)
        torch.testing.assert_close(full[i].float(), single[0].float(), atol=2e-2, rtol=2e-2)


def test_int4_reads_the_rotated_format_with_its_zero_points():
    """The kernel's output is attention over the original rows (rotation undone), and a
    zero point left out would move it: the writer's zero points are not all equal."""
    batch = make_batch("int4_pth", [40], [4], seed=9)
    assert len(set((batch.cache.k_scale.view(torch.int32) & 0xF).flatten().tolist())) > 3
    errs, _ = run(batch, num_splits=1)
    assert max(errs) < DEFAULT_BOUND
    bits = batch.cache.k_scale.view(torch.int32)
    batch.cache.k_scale.copy_((bits & ~0xF).view(torch.float32))  # zero points dropped
    t, hq, d = batch.q.shape
    out = torch.empty_like(batch.q)
    verify_attention(batch.q, batch.cache, batch.block_table, batch.seq_lens,
                     batch.query_start_loc, 4, d ** -0.5, out)
    want = ref.verify_attention(batch.q, make_batch("int4_pth", [40], [4], seed=9).cache,
                                batch.block_table, batch.seq_lens, batch.query_start_loc,
                                d ** -0.5)
    assert relative_errors(out, want, batch.query_start_loc)[0] > 0.1


def test_bad_arguments_name_what_is_allowed():
    batch = make_batch("bf16", [20], [4])
    out = torch.empty_like(batch.q)
    args = (batch.q, batch.cache, batch.block_table, batch.seq_lens, batch.query_start_loc)
    with pytest.raises(ValueError, match=r"allowed 1\.\.16"):
        verify_attention(*args, MAX_QUERY_LEN + 1, 0.1, out)
    with pytest.raises(ValueError, match="needs the split-softmax scratch"):
        verify_attention(*args, 4, 0.1, out, num_splits=2)
    with pytest.raises(ValueError, match=r"scratch partials must be float32 \[>= 4, 8, >= 8"):
        verify_attention(*args, 4, 0.1, out, num_splits=8, scratch=scratch(4, 8, 4, 64))
    bad = PagedCache(Mode.PER_TOKEN_HEAD, batch.cache.key, batch.cache.value)
    with pytest.raises(ValueError, match="PER_TOKEN_HEAD key cache entries must be one of"):
        verify_attention(batch.q, bad, *args[2:], 4, 0.1, out)
    with pytest.raises(ValueError, match="an fp8 query .* goes with an FP8 cache only"):
        verify_attention(batch.q, batch.cache, *args[2:], 4, 0.1, out,
                         q_scale=torch.ones(1))


# --------------------------------------------------------------------------- GPU only


GPU_CASES = [(d, q) for d in DTYPES for q in (QUERY_LENS if d in ("bf16", "int4_pth") else [16])]


@gpu_only
@pytest.mark.parametrize(("dtype", "query_len"), GPU_CASES)
def test_gpu_head_size_256_long_contexts(dtype, query_len):
    batch = make_batch(dtype, [4096 + 7, 1000, 129], [query_len, query_len, 1], kv_heads=4,
                       gqa=8, head_size=256, seed=query_len)
    errs, _ = run(batch, num_splits=16)
    assert max(errs) < DEFAULT_BOUND, errs


@gpu_only
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_head_size_128_gqa_8_no_split(dtype):
    batch = make_batch(dtype, [32768, 3000], [16, 7], kv_heads=8, gqa=8, head_size=128,
                       seed=1)
    errs, _ = run(batch, num_splits=1)
    assert max(errs) < DEFAULT_BOUND, errs


@gpu_only
@pytest.mark.parametrize("dtype", ["bf16", "fp8", "int8_pth", "int4_pth"])
def test_gpu_cuda_graph_replay_reads_new_lengths(dtype):
    """Capture once, then change seq_lens in place: the replay matches eager at the new
    lengths (nothing about the lengths was baked into the launch)."""
    batch = make_batch(dtype, [3000, 2000, 700], [8, 8, 8], kv_heads=4, gqa=4,
                       head_size=128, seed=2)
    t, hq, d = batch.q.shape
    out = torch.empty_like(batch.q)
    scr = scratch(t, hq, 16, d)
    call = lambda: verify_attention(batch.q, batch.cache, batch.block_table, batch.seq_lens,
                                    batch.query_start_loc, 8, d ** -0.5, out, num_splits=16,
                                    scratch=scr)
    call()  # compile (and build the INT4 rotation) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for new in ([2990, 1500, 650], [3000, 2000, 700]):
        batch.seq_lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        call()
        torch.testing.assert_close(replayed, out, atol=0, rtol=0)
        want = ref.verify_attention(batch.q, batch.cache, batch.block_table, batch.seq_lens,
                                    batch.query_start_loc, d ** -0.5)
        assert max(relative_errors(replayed, want, batch.query_start_loc)) < DEFAULT_BOUND
