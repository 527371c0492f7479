"""Triton kernels that finish a step's plan on the device, from exact lengths.

The host (``sidepool``) plans with lengths that may overstate a row; these kernels read
the device's own ``positions``, ``seq_lens`` and ``query_start_loc`` and write fixed-size
tables that the layer kernels (stage, restore, flush) read, so a CUDA graph captured
once replays with each step's data and the host never waits for the device.
References: ``stage_slots_reference`` and ``flush_targets_reference`` below.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _stage_slots_kernel(pos_ptr, qsl_ptr, st_ptr, st_stride, tail_ptr, hit_ptr, out_ptr,
                        G: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    start = tl.load(qsl_ptr + b)
    end = tl.load(qsl_ptr + b + 1)
    tail_start = tl.load(tail_ptr + b)
    hit_end = tl.load(hit_ptr + b)
    for t0 in range(start, end, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        ok = t < end
        pos = tl.load(pos_ptr + t, mask=ok, other=0).to(tl.int32)
        logical = pos // G
        col = tl.where(logical == 0, 0, 1 + logical - tail_start)
        side = tl.load(st_ptr + b * st_stride + col, mask=ok, other=0).to(tl.int64)
        slot = tl.where(pos < hit_end, -1, side * G + pos % G)
        tl.store(out_ptr + t, slot, mask=ok)


def stage_slots(positions: torch.Tensor, query_start_loc: torch.Tensor, num_rows: int,
                side_table: torch.Tensor, tail_start: torch.Tensor, hit_end: torch.Tensor,
                group: int, out: torch.Tensor) -> torch.Tensor:
    """Side slot (side block * G + row) of every new token, -1 where nothing is staged:
    padding, and positions held by prefix-hit records. out: int64, at least as long as
    the step's tokens; every entry is written."""
    out.fill_(-1)
    if num_rows:
        _stage_slots_kernel[(num_rows,)](
            positions, query_start_loc, side_table, side_table.stride(0), tail_start,
            hit_end, out, G=group, BLOCK=256)
    return out


@triton.jit
def _flush_targets_kernel(row_ptr, logical_ptr, seq_ptr, qsl_ptr, hit_ptr, bt_ptr, bt_stride,
                          out_ptr, G: tl.constexpr):
    n = tl.program_id(0)
    b = tl.load(row_ptr + n)
    i = tl.load(logical_ptr + n)
    length = tl.load(seq_ptr + b)
    committed = length - (tl.load(qsl_ptr + b + 1) - tl.load(qsl_ptr + b))
    written_from = tl.maximum(committed, tl.load(hit_ptr + b))
    end = (i + 1) * G
    take = (end <= length) & (end > written_from)
    dst = tl.load(bt_ptr + b.to(tl.int64) * bt_stride + i).to(tl.int64)
    tl.store(out_ptr + n, tl.where(take, dst, -1))


def flush_targets(rows: torch.Tensor, logical: torch.Tensor, num: int, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, hit_end: torch.Tensor,
                  block_table: torch.Tensor, group: int, out: torch.Tensor) -> torch.Tensor:
    """For flush candidates (row, logical block), the cache block to write, or -1 when
    the block is not full after this step or got no new row in it. Entries past
    ``num`` become -1."""
    out.fill_(-1)
    if num:
        _flush_targets_kernel[(num,)](
            rows, logical, seq_lens, query_start_loc, hit_end, block_table,
            block_table.stride(0), out, G=group)
    return out


def stage_slots_reference(positions, query_start_loc, num_rows, side_table, tail_start,
                          hit_end, group, length):
    out = torch.full((length,), -1, dtype=torch.int64)
    for b in range(num_rows):
        for t in range(int(query_start_loc[b]), int(query_start_loc[b + 1])):
            p = int(positions[t])
            if p < int(hit_end[b]):
                continue
            i = p // group
            col = 0 if i == 0 else 1 + i - int(tail_start[b])
            out[t] = int(side_table[b, col]) * group + p % group
    return out


def flush_targets_reference(rows, logical, num, seq_lens, query_start_loc, hit_end,
                            block_table, group, length):
    out = torch.full((length,), -1, dtype=torch.int64)
    for n in range(num):
        b, i = int(rows[n]), int(logical[n])
        L = int(seq_lens[b])
        committed = L - int(query_start_loc[b + 1] - query_start_loc[b])
        end = (i + 1) * group
        if end <= L and end > max(committed, int(hit_end[b])):
            out[n] = int(block_table[b, i])
    return out
