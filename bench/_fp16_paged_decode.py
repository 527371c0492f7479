"""Baseline for bench/kvarn_decode.py: a Triton fp16 paged decode attention.

Same structure as the KVarN kernel (one program per request, KV head and split serving
the whole GQA group, online softmax, and its log-sum-exp combine, ``kvarn.combine``) over
an fp16 cache [num_blocks, 2, H, G, D], so the comparison isolates the cost of the format.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvarn.combine import combine


@triton.jit
def _fp16_attn_kernel(q_ptr, kv_ptr, bt_ptr, seq_ptr, o_ptr, lse_ptr, bt_stride, qk_scale,
                      SPLITS, H: tl.constexpr, HQ: tl.constexpr, HPG: tl.constexpr,
                      G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    L = tl.load(seq_ptr + b)
    rows = tl.arange(0, BLOCK_M)
    head = h * HPG + rows
    row_ok = rows < HPG
    dd = tl.arange(0, D)
    tn = tl.arange(0, BLOCK_N)
    q_off = (b * HQ + head).to(tl.int64)
    q = tl.load(q_ptr + q_off[:, None] * D + dd[None, :], mask=row_ok[:, None], other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    nblk = tl.cdiv(L, G)
    per = tl.cdiv(nblk, SPLITS)
    lo = s * per
    hi = tl.minimum(lo + per, nblk)
    for i in range(lo, hi):
        blk = tl.load(bt_ptr + b * bt_stride + i).to(tl.int64)
        base = kv_ptr + blk * (2 * H * G * D) + h * (G * D)
        for j in tl.static_range(0, G, BLOCK_N):  # token slices of the block
            tt = j + tn
            k = tl.load(base + tt[None, :] * D + dd[:, None])
            sc = tl.dot(q, k) * qk_scale
            sc = tl.where((i * G + tt)[None, :] < L, sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(base + H * G * D + tt[:, None] * D + dd[None, :])
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
            m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    o_row = q_off * SPLITS + s
    tl.store(o_ptr + o_row[:, None] * D + dd[None, :], out, mask=row_ok[:, None])
    tl.store(lse_ptr + o_row, lse, mask=row_ok)


def fp16_paged_decode(q: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, splits: int, num_warps: int = 4,
                      num_stages: int = 2) -> torch.Tensor:
    """q [B, Hq, D] fp16, kv [blocks, 2, H, G, D] fp16 -> out [B, Hq, D] fp16. A block
    is read in slices of at most 16K channels x tokens (so K and V tiles fit in shared
    memory at D = 512, whose whole-block tiles took 282,624 B on the H200)."""
    bsz, hq, d = q.shape
    h, g = kv.shape[2], kv.shape[3]
    o = torch.empty(bsz * hq * splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(bsz * hq * splits, dtype=torch.float32, device=q.device)
    _fp16_attn_kernel[(bsz, h, splits)](
        q, kv, block_table, seq_lens, o, lse, block_table.stride(0),
        d ** -0.5 * 1.4426950408889634, splits, H=h, HQ=hq, HPG=hq // h, G=g, D=d,
        BLOCK_M=max(16, triton.next_power_of_2(hq // h)), BLOCK_N=min(g, 16384 // d),
        num_warps=num_warps,
        num_stages=num_stages)
    out = torch.empty(bsz, hq, d, dtype=torch.float16, device=q.device)
    combine(o, lse, splits, out.view(bsz * hq, d))
    return out
