"""Builders of random paged KVarN caches shared by the kernel tests."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvarn import PagedKV, Preset
from kvarn import reference as ref

ON_GPU = torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET")
DEVICE = "cuda" if ON_GPU else "cpu"


@dataclass
class State:
    kv: PagedKV
    block_table: torch.Tensor
    side_table: torch.Tensor
    seq_lens: torch.Tensor
    num_flushed: torch.Tensor


def rotated_rows(n: int, heads: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """fp16 rows with per-channel spread, like rotated keys and values."""
    chan = torch.exp(0.5 * torch.randn(heads, d, generator=gen))
    return (torch.randn(n, heads, d, generator=gen) * chan).half()


def make_state(preset: Preset, d: int, heads: int, seq_lens: list[int], query_len: int,
               seed: int = 0, shuffle: bool = True, hold_back: bool = True,
               device: str = DEVICE) -> State:
    """Random cache: committed full blocks after the sink are flushed (when hold_back,
    some requests keep their last full committed block staged), the rest stays fp16."""
    gen = torch.Generator().manual_seed(seed)
    g = preset.group
    flushed, tails = [], []
    for b, L in enumerate(seq_lens):
        f = max(0, (L - query_len) // g - 1)
        if hold_back and f > 0 and b % 2:
            f -= 1
        flushed.append(f)
        tails.append(max(0, -(-L // g) - f - 1))
    n_rec, n_side = sum(flushed) + 3, sum(1 + t for t in tails) + 3
    rec_ids = torch.randperm(n_rec, generator=gen) if shuffle else torch.arange(n_rec)
    side_ids = torch.randperm(n_side, generator=gen) if shuffle else torch.arange(n_side)
    width = max(-(-L // g) for L in seq_lens) + 1
    block_table = torch.full((len(seq_lens), width), -7, dtype=torch.int32)
    side_table = torch.full((len(seq_lens), 1 + max(tails) + 1), -7, dtype=torch.int32)
    kv = PagedKV.allocate(preset, d, heads, n_rec, n_side, device=device)
    kv.side.copy_(rotated_rows(n_side * 2 * g, heads, d, gen)
                  .reshape(n_side, 2, g, heads, d).transpose(2, 3))
    ri = si = 0
    k_tiles, v_tiles, dst = [], [], []
    for b in range(len(seq_lens)):
        side_table[b, 0] = side_ids[si]
        si += 1
        for i in range(1, flushed[b] + 1):
            block_table[b, i] = rec_ids[ri]
            dst.append(int(rec_ids[ri]))
            ri += 1
            k_tiles.append(rotated_rows(g, heads, d, gen).transpose(0, 1))
            v_tiles.append(rotated_rows(g, heads, d, gen).transpose(0, 1))
        for j in range(tails[b]):
            side_table[b, 1 + j] = side_ids[si]
            si += 1
    if dst:
        k = torch.stack(k_tiles).to(device)  # [N, H, G, D]
        v = torch.stack(v_tiles).to(device)
        kv.cache[torch.tensor(dst, device=device)] = ref.encode_tiles(k, v, preset)
    return State(kv, block_table.to(device), side_table.to(device),
                 torch.tensor(seq_lens, dtype=torch.int32, device=device),
                 torch.tensor(flushed, dtype=torch.int32, device=device))


def check_close(out, want):
    """A kernel's output against the fp32 reference: finite, and within the spec's 5e-3
    (fp16 operands in the tensor-core dots)."""
    out, want = out.float().cpu(), want.float().cpu()
    assert torch.isfinite(out).all()
    cos = torch.nn.functional.cosine_similarity(out.flatten(), want.flatten(), 0)
    assert cos >= 0.9999, float(cos)
    assert (out - want).abs().max() <= 5e-3, float((out - want).abs().max())


def capture_graph(fn):
    """fn captured in a CUDA graph after one warm-up call on a side stream (so compiles
    and lazy allocations stay outside the capture): (graph, the output it writes)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, out
