"""Properties of the spec-decode scratch pool's sizing (vllm/fork/scratch_sizing.py),
a pure module loaded from the repository: no torch, no vLLM."""
from __future__ import annotations

import importlib.util

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kiln.paths import REPO_ROOT

_spec = importlib.util.spec_from_file_location(
    "scratch_sizing", REPO_ROOT / "vllm" / "fork" / "scratch_sizing.py")
sizing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sizing)

kv_heads = st.sampled_from([1, 2, 4, 8, 16, 32, 64])
capture = st.one_of(st.none(), st.lists(st.integers(1, 1024), min_size=1, max_size=40))
spec_tokens = st.integers(0, 31)
fork_max = st.sampled_from([0, 16])
upstream_max = st.sampled_from([1, 8])


@st.composite
def configs(draw):
    threshold = sizing.seq_threshold_3d(draw(kv_heads), 128, draw(capture))
    k, parallel = draw(spec_tokens), draw(st.booleans())
    query_len = sizing.split_query_len(k, parallel, draw(upstream_max), draw(fork_max))
    return threshold, draw(st.integers(1, 1024)), query_len, k, parallel


@given(configs(), st.data())
def test_every_split_batch_fits_the_rows(config, data):
    """Any batch of at most max_num_seqs requests that takes a split path (few enough
    requests, no request longer than the planned query length) fits the pool."""
    threshold, max_num_seqs, query_len, _, _ = config
    rows = sizing.pool_rows(threshold, max_num_seqs, query_len)
    n = data.draw(st.integers(1, max_num_seqs))
    lens = data.draw(st.lists(st.integers(1, 2 * query_len), min_size=n, max_size=n))
    if sizing.is_split_batch(n, max(lens), threshold, query_len):
        assert sum(lens) <= rows


@given(configs())
def test_the_rows_are_tight(config):
    """The largest split batch fills the pool exactly: no row is never used."""
    threshold, max_num_seqs, query_len, _, _ = config
    n = min(threshold, max_num_seqs)
    assert sizing.is_split_batch(n, query_len, threshold, query_len)
    assert n * query_len == sizing.pool_rows(threshold, max_num_seqs, query_len)


@given(spec_tokens, st.booleans(), upstream_max, fork_max)
def test_split_query_len_is_the_verify_length_within_what_the_kernels_take(k, parallel, up, fork):
    q = sizing.split_query_len(k, parallel, up, fork)
    verify = 1 + k * (2 if parallel else 1)
    assert q == min(verify, max(up, fork))
    assert 1 <= q <= 16
    if k == 0:
        assert q == 1
    # more drafted tokens never shrink the pool
    assert sizing.split_query_len(k + 1, parallel, up, fork) >= q


@given(kv_heads, capture)
def test_threshold_is_upstreams_grid_rule(heads, sizes):
    t = sizing.seq_threshold_3d(heads, 128, sizes)
    if sizes is None:
        assert t == 128 // heads
    else:
        assert t in sizes
        assert all(abs(t - 128 // heads) <= abs(s - 128 // heads) for s in sizes)


@given(st.integers(1, 4096), st.integers(1, 128), st.integers(32, 512),
       st.sampled_from([16, 64]))
def test_pool_bytes_count_partials_and_both_statistics(rows, heads, head_size, segments):
    pad = sizing.next_power_of_2(head_size)
    assert head_size <= pad < 2 * head_size
    partials = rows * heads * segments * pad * 4
    stats = 2 * rows * heads * segments * 4
    assert sizing.pool_bytes(rows, heads, head_size, segments) == partials + stats


@given(st.integers(1, 512), kv_heads, st.integers(0, 512))
def test_segment_shortfall_counts_requests_of_underfilled_grids(num_reqs, heads, units):
    shortfall = sizing.segment_shortfall(num_reqs, heads, units)
    if num_reqs * heads * sizing.SEGMENTS < units:
        assert shortfall == num_reqs
    else:
        assert shortfall == 0


def test_shortfall_matches_upstreams_sm120_64_segment_rule():
    """Upstream (0.32.0) gives a batch 64 segments on SM120 when num_reqs <=
    (units - 1) // (16 * num_kv_heads): exactly the batches counted here."""
    for units in (84, 132, 188):
        for heads in (1, 2, 4, 8):
            limit = (units - 1) // (16 * heads)
            for n in range(1, 40):
                assert (sizing.segment_shortfall(n, heads, units) > 0) == (n <= limit)


def test_bad_values_are_refused_naming_them():
    with pytest.raises(ValueError, match="num_speculative_tokens -1 is negative"):
        sizing.split_query_len(-1, False, 1, 16)
    with pytest.raises(ValueError, match="must be positive"):
        sizing.pool_rows(0, 8, 1)
    with pytest.raises(ValueError, match="num_kv_heads 0"):
        sizing.seq_threshold_3d(0, 128, None)
