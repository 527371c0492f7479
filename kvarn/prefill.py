"""Triton causal attention of prefill chunks over a contiguous fp16 context.

Row b's queries are the last ``q_len[b]`` of its ``seq_lens[b]`` positions; its keys and
values (context and chunk alike, as ``dequant.materialize_rows`` laid them out) are
rows ``kv_start[b] .. kv_start[b] + seq_lens[b] - 1`` of ``k``/``v`` [N, H, D]. One
program per (query tile, row, query head) runs an online softmax over key tiles up to
its last query's position, so memory is O(tokens), never O(tokens x context).
Reference: ``prefill_attention_reference`` below.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, qsl_ptr, seq_ptr, kvs_ptr, qk_scale,
                    HQ: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    m = tl.program_id(0)
    b = tl.program_id(1)
    hq = tl.program_id(2)
    h = hq // (HQ // H)
    q0 = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q0
    if m * BLOCK_M < q_len:
        length = tl.load(seq_ptr + b)
        kv0 = tl.load(kvs_ptr + b).to(tl.int64)
        rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        pos = length - q_len + rows  # each query's own position
        dd = tl.arange(0, D)
        q = tl.load(q_ptr + ((q0 + rows).to(tl.int64) * HQ + hq)[:, None] * D + dd[None, :],
                    mask=row_ok[:, None], other=0.0)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        end = tl.minimum(length, length - q_len + (m + 1) * BLOCK_M)
        for n0 in range(0, end, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            col_ok = cols < end
            kv = ((kv0 + cols) * H + h)[:, None] * D + dd[None, :]
            k = tl.load(k_ptr + kv, mask=col_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            s = tl.where(col_ok[None, :] & (cols[None, :] <= pos[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding rows
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv, mask=col_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(o_ptr + ((q0 + rows).to(tl.int64) * HQ + hq)[:, None] * D + dd[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      kv_start: torch.Tensor, max_query_len: int, sm_scale: float,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] (rows' queries back to back, query_start_loc [P + 1] relative to q)
    over k, v [N, H, D]; returns [T, Hq, D] in q's dtype (or writes ``out``)."""
    t, hq, d = q.shape
    h = k.shape[1]
    if hq % h or k.shape[2] != d or v.shape != k.shape:
        raise ValueError(f"q [T, k*H, D] and k = v [N, H, D] expected, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    out = torch.empty_like(q) if out is None else out
    rows = seq_lens.shape[0]
    if rows == 0 or max_query_len == 0:
        return out
    block_m = 64 if max_query_len > 32 else 16
    grid = (triton.cdiv(max_query_len, block_m), rows, hq)
    _prefill_kernel[grid](q.contiguous(), k, v, out, query_start_loc, seq_lens, kv_start,
                          sm_scale * LOG2E, HQ=hq, H=h, D=d, BLOCK_M=block_m,
                          BLOCK_N=64 if d <= 128 else 32, num_warps=4 if d <= 128 else 8)
    return out


def prefill_attention_reference(q, k, v, query_start_loc, seq_lens, kv_start, sm_scale):
    out = torch.empty(q.shape, dtype=torch.float32)
    hq, h = q.shape[1], k.shape[1]
    for b in range(seq_lens.shape[0]):
        s, e = int(query_start_loc[b]), int(query_start_loc[b + 1])
        length, start = int(seq_lens[b]), int(kv_start[b])
        kk = k[start:start + length].float().repeat_interleave(hq // h, 1)
        vv = v[start:start + length].float().repeat_interleave(hq // h, 1)
        scores = torch.einsum("qhd,lhd->hql", q[s:e].float(), kk) * sm_scale
        pos = length - (e - s) + torch.arange(e - s)
        scores = scores.masked_fill(torch.arange(length)[None, None, :] > pos[None, :, None],
                                    float("-inf"))
        out[s:e] = torch.einsum("hql,lhd->qhd", scores.softmax(-1), vv)
    return out
