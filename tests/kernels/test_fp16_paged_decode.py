"""bench/_fp16_paged_decode.py, the fp16 baseline of the KVarN decode benchmark, computes
attention (torch SDPA over the same keys and values) at every head dim the benchmark
runs, D = 512 included, where it reads each block in token slices."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from _fp16_paged_decode import fp16_paged_decode  # noqa: E402
from kvarn_cases import DEVICE  # noqa: E402


@pytest.mark.parametrize("head_dim", [128, 512], ids=lambda d: f"D{d}")
def test_fp16_baseline_matches_sdpa(head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    heads, gqa, g, lens = 2, 4, 128, [300, 129]
    nblk = -(-max(lens) // g)
    cache = torch.randn(len(lens) * nblk, 2, heads, g, head_dim, generator=gen).half().to(DEVICE)
    table = torch.randperm(len(lens) * nblk, generator=gen).to(torch.int32).view(len(lens), nblk)
    q = torch.randn(len(lens), heads * gqa, head_dim, generator=gen).half().to(DEVICE)
    got = fp16_paged_decode(q, cache, table.to(DEVICE), torch.tensor(lens, dtype=torch.int32,
                                                                      device=DEVICE), 2)
    for b, L in enumerate(lens):
        k = cache[table[b].long(), 0].permute(1, 0, 2, 3).reshape(heads, -1, head_dim)[:, :L]
        v = cache[table[b].long(), 1].permute(1, 0, 2, 3).reshape(heads, -1, head_dim)[:, :L]
        want = torch.nn.functional.scaled_dot_product_attention(
            q[b].view(heads, gqa, head_dim).float(), k.float(), v.float(), enable_gqa=True)
        assert (got[b].float().view(heads, gqa, head_dim) - want).abs().max() < 2e-3
