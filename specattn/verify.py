"""Triton split-KV multi-query attention for speculative verify over a paged KV cache.

Each request brings ``q_len`` (1..16) query tokens: the drafted tokens plus one, the
last ``q_len`` positions of its ``seq_len``, causal among themselves. One program per
(request, KV head, split) holds every query head of that KV head's GQA group and every
query token of the request as rows of one tile (row = token * G_PAD + head), so each
KV tile is read from memory once per split. The context is cut into ``num_splits``
contiguous ranges (split-K); each split writes unnormalized partials (sum of
exp2-weighted V, row max, row sum) into a scratch laid out as upstream's split-softmax
scratch ``[tokens, H_q, segments, D_pad]``, and a second kernel merges them by
log-sum-exp. With one split the first kernel writes the output itself.

Cache modes (``cache.py``): bf16/fp16, fp8 e4m3 with per-tensor scales, int8 or fp8
with per-(token, head) scales, and int4 per-(token, head) with zero points over
Hadamard-rotated rows, where q is rotated inside the kernel and the output rotated back
(no extra launches). Quantized K and V are read as exact fp16/bf16 integers or fp8
values and every scale is applied to the score or to P, never per element.

The launch depends on tensor shapes and Python ints only (no device-to-host reads), so
it can be captured in a CUDA graph and replayed with new lengths in the same buffers.
Reference: ``reference.verify_attention``.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .cache import Mode, PagedCache
from .rotation import block_order, kernel_rotation

MAX_QUERY_LEN = 16
LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, acc, INTERP: tl.constexpr):
    """a @ b + acc with fp32 accumulation. Triton's CPU interpreter multiplies bf16
    operands wrongly, so there the (already rounded) operands go in as fp32."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _cvt(x, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """x.to(DTYPE); the interpreter turns integers into bf16 bit patterns, not values."""
    if INTERP:
        return x.to(tl.float32).to(DTYPE)
    return x.to(DTYPE)


@triton.jit
def _byte(w, j: tl.constexpr, SIGNED: tl.constexpr, DTYPE: tl.constexpr,
          INTERP: tl.constexpr):
    """Byte j of each int32 word as DTYPE: an int8 code (SIGNED) or an fp8 e4m3 one."""
    if SIGNED:
        return _cvt((w << (24 - 8 * j)) >> 24, DTYPE, INTERP)  # >> sign-extends
    b = ((w >> (8 * j)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    return _cvt(b, DTYPE, INTERP)


@triton.jit
def _rows(rb, q_len, GQA: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row m of row block rb -> (query token, head in the group, valid)."""
    m = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = m // G_PAD
    g = m % G_PAD
    return qi, g, (qi < q_len) & (g < GQA)


@triton.jit
def _split_range(seq_len, split, TILE: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Tiles [lo, hi) of this split, and how many splits have any tile."""
    n_tiles = tl.cdiv(seq_len, TILE)
    per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, n_tiles)
    return lo, hi, tl.cdiv(n_tiles, tl.maximum(per_split, 1))


@triton.jit
def _unrotate_store(o_e, o_o, rot_ptr, row_ptrs, row_ok, inv_b, D: tl.constexpr,
                    DH_PAD: tl.constexpr, D_PAD: tl.constexpr):
    """Store x = (R^T x') / b given x' as its even (o_e) and odd (o_o) columns, at
    row_ptrs[m] + column. The fp32 R^T is read in column chunks of 16 KB per half, so
    its tiles fit in shared memory at head 256 (all of it would take 256 KB)."""
    CH: tl.constexpr = 4096 // DH_PAD  # columns per chunk (masked past D)
    j = tl.arange(0, DH_PAD)
    for c in tl.static_range(0, D_PAD, CH):
        d = c + tl.arange(0, CH)
        rmask = (j[:, None] < D // 2) & (d[None, :] < D)
        r_e = tl.load(rot_ptr + j[:, None] * D + d[None, :], mask=rmask, other=0.0)
        r_o = tl.load(rot_ptr + (D // 2) * D + j[:, None] * D + d[None, :], mask=rmask,
                      other=0.0)
        o = tl.dot(o_e, r_e, input_precision="ieee")
        o = tl.dot(o_o, r_o, o, input_precision="ieee") * inv_b
        tl.store(row_ptrs[:, None] + d[None, :], o.to(row_ptrs.dtype.element_ty),
                 mask=row_ok[:, None] & (d[None, :] < D))


@triton.jit
def _verify_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, qs_ptr, rot_ptr,
    out_ptr, so_ptr, sm_ptr, ss_ptr,
    bt_ptr, seq_lens_ptr, qsl_ptr,
    qk_scale, inv_b,
    s_qt, s_qh, s_ot, s_oh,
    s_kb, s_kt, s_kh, s_vb, s_vt, s_vh,
    s_ksb, s_kst, s_ksh, s_vsb, s_vst, s_vsh,
    s_bt,
    s_sot, s_soh, s_sos, s_smt, s_smh,
    GQA: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr, ROW_BLOCKS: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, DH_PAD: tl.constexpr,
    PAGE: tl.constexpr, TILE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    MODE: tl.constexpr, QK_DTYPE: tl.constexpr, PV_DTYPE: tl.constexpr,
    Q_SCALED: tl.constexpr, INTERP: tl.constexpr, WORDS: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1) // ROW_BLOCKS
    rb = tl.program_id(1) % ROW_BLOCKS
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if rb * BLOCK_M // G_PAD >= q_len:
        return  # no query token in this row block (or a padding request)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo, hi, _ = _split_range(seq_len, split, TILE, NUM_SPLITS)
    if lo >= hi:
        return  # the combine skips splits without tiles
    qi, g, row_ok = _rows(rb, q_len, GQA, G_PAD, BLOCK_M)
    head = kvh * GQA + g
    tok_row = (q_start + qi).to(tl.int64)
    q_pos = seq_len - q_len + qi  # absolute position of each row's query token

    scale = qk_scale
    if Q_SCALED:
        scale = scale * tl.load(qs_ptr)
    if MODE == 1:
        scale = scale * tl.load(ks_ptr)

    if MODE == 3:
        # q' = R q as its even / odd columns (the low / high nibble streams).
        d = tl.arange(0, D_PAD)
        j = tl.arange(0, DH_PAD)
        q = tl.load(q_ptr + tok_row[:, None] * s_qt + head[:, None] * s_qh + d[None, :],
                    mask=row_ok[:, None] & (d[None, :] < D), other=0.0).to(QK_DTYPE)
        rmask = (d[:, None] < D) & (j[None, :] < D // 2)
        rt_e = tl.load(rot_ptr + j[None, :] * D + d[:, None], mask=rmask, other=0.0)
        rt_o = tl.load(rot_ptr + (D // 2) * D + j[None, :] * D + d[:, None], mask=rmask,
                       other=0.0)
        zero_h = tl.zeros([BLOCK_M, DH_PAD], dtype=tl.float32)
        q_e = _dot(q, rt_e.to(QK_DTYPE), zero_h, INTERP).to(QK_DTYPE)
        q_o = _dot(q, rt_o.to(QK_DTYPE), zero_h, INTERP).to(QK_DTYPE)
        q_sum = tl.sum(q_e.to(tl.float32), 1) + tl.sum(q_o.to(tl.float32), 1)
        acc_e = tl.zeros([BLOCK_M, DH_PAD], dtype=tl.float32)
        acc_o = tl.zeros([BLOCK_M, DH_PAD], dtype=tl.float32)
        col = j
        col_ok = j < D // 2
    elif WORDS:
        # 8-bit rows read as int32 words: q and the output split by column mod 4 (byte j
        # of word c is column 4c + j), so the dots need no byte shuffle.
        col = tl.arange(0, D_PAD // 4)
        col_ok = col < D // 4
        q_row = q_ptr + tok_row[:, None] * s_qt + head[:, None] * s_qh + 4 * col[None, :]
        q_mask = row_ok[:, None] & col_ok[None, :]
        q0 = tl.load(q_row, mask=q_mask, other=0.0).to(QK_DTYPE)
        q1 = tl.load(q_row + 1, mask=q_mask, other=0.0).to(QK_DTYPE)
        q2 = tl.load(q_row + 2, mask=q_mask, other=0.0).to(QK_DTYPE)
        q3 = tl.load(q_row + 3, mask=q_mask, other=0.0).to(QK_DTYPE)
        acc0 = tl.zeros([BLOCK_M, D_PAD // 4], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_M, D_PAD // 4], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_M, D_PAD // 4], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_M, D_PAD // 4], dtype=tl.float32)
        k_words = k_ptr.to(tl.pointer_type(tl.int32))
        v_words = v_ptr.to(tl.pointer_type(tl.int32))
        signed: tl.constexpr = k_ptr.dtype.element_ty == tl.int8
    else:
        col = tl.arange(0, D_PAD)
        col_ok = col < D
        q = tl.load(q_ptr + tok_row[:, None] * s_qt + head[:, None] * s_qh + col[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(QK_DTYPE)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    zero_s = tl.zeros([BLOCK_M, TILE], dtype=tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * s_bt
    for t in range(lo, hi):
        tok = t * TILE + tl.arange(0, TILE)
        tok_ok = tok < seq_len
        blk = tl.load(bt_row + tok // PAGE, mask=tok_ok, other=0).to(tl.int64)
        slot = tok % PAGE
        if WORDS:  # byte offsets of the rows, in words (the launcher checked % 4)
            k_off = (blk[None, :] * s_kb + slot[None, :] * s_kt + kvh * s_kh) // 4 + col[:, None]
            k = tl.load(k_words + k_off, mask=col_ok[:, None] & tok_ok[None, :], other=0)
            v_off = (blk[:, None] * s_vb + slot[:, None] * s_vt + kvh * s_vh) // 4 + col[None, :]
            v = tl.load(v_words + v_off, mask=tok_ok[:, None] & col_ok[None, :], other=0)
        else:
            k_off = blk[None, :] * s_kb + slot[None, :] * s_kt + kvh * s_kh + col[:, None]
            k = tl.load(k_ptr + k_off, mask=col_ok[:, None] & tok_ok[None, :], other=0.0)
            v_off = blk[:, None] * s_vb + slot[:, None] * s_vt + kvh * s_vh + col[None, :]
            v = tl.load(v_ptr + v_off, mask=tok_ok[:, None] & col_ok[None, :], other=0.0)

        if MODE == 3:
            k_raw = tl.load(ks_ptr + blk * s_ksb + slot * s_kst + kvh * s_ksh, mask=tok_ok,
                            other=0.0).to(tl.int32, bitcast=True)
            k_zp = (k_raw & 0xF).to(tl.float32)
            k_sc = (k_raw & -16).to(tl.float32, bitcast=True)
            s = _dot(q_e, _cvt(k & 0xF, QK_DTYPE, INTERP), zero_s, INTERP)
            s = _dot(q_o, _cvt(k >> 4, QK_DTYPE, INTERP), s, INTERP)
            s = (s - q_sum[:, None] * k_zp[None, :]) * (scale * k_sc[None, :])
        elif MODE == 2:
            k_sc = tl.load(ks_ptr + blk * s_ksb + slot * s_kst + kvh * s_ksh, mask=tok_ok,
                           other=0.0)
            if WORDS:
                s = _dot(q0, _byte(k, 0, signed, QK_DTYPE, INTERP), zero_s, INTERP)
                s = _dot(q1, _byte(k, 1, signed, QK_DTYPE, INTERP), s, INTERP)
                s = _dot(q2, _byte(k, 2, signed, QK_DTYPE, INTERP), s, INTERP)
                s = _dot(q3, _byte(k, 3, signed, QK_DTYPE, INTERP), s, INTERP)
                s = s * (scale * k_sc[None, :])
            else:
                s = _dot(q, _cvt(k, QK_DTYPE, INTERP), zero_s, INTERP) * (scale * k_sc[None, :])
        else:
            s = _dot(q, _cvt(k, QK_DTYPE, INTERP), zero_s, INTERP) * scale

        visible = row_ok[:, None] & tok_ok[None, :] & (tok[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

        if MODE == 3:
            v_raw = tl.load(vs_ptr + blk * s_vsb + slot * s_vst + kvh * s_vsh, mask=tok_ok,
                            other=0.0).to(tl.int32, bitcast=True)
            v_zp = (v_raw & 0xF).to(tl.float32)
            p_v = (p * (v_raw & -16).to(tl.float32, bitcast=True)[None, :]).to(PV_DTYPE)
            corr = tl.sum(p_v.to(tl.float32) * v_zp[None, :], 1)[:, None]
            acc_e = _dot(p_v, _cvt(v & 0xF, PV_DTYPE, INTERP), acc_e * alpha[:, None], INTERP) - corr
            acc_o = _dot(p_v, _cvt(v >> 4, PV_DTYPE, INTERP), acc_o * alpha[:, None], INTERP) - corr
        elif WORDS:
            v_sc = tl.load(vs_ptr + blk * s_vsb + slot * s_vst + kvh * s_vsh, mask=tok_ok,
                           other=0.0)
            p_v = (p * v_sc[None, :]).to(PV_DTYPE)
            acc0 = _dot(p_v, _byte(v, 0, signed, PV_DTYPE, INTERP), acc0 * alpha[:, None], INTERP)
            acc1 = _dot(p_v, _byte(v, 1, signed, PV_DTYPE, INTERP), acc1 * alpha[:, None], INTERP)
            acc2 = _dot(p_v, _byte(v, 2, signed, PV_DTYPE, INTERP), acc2 * alpha[:, None], INTERP)
            acc3 = _dot(p_v, _byte(v, 3, signed, PV_DTYPE, INTERP), acc3 * alpha[:, None], INTERP)
        else:
            if MODE == 2:
                v_sc = tl.load(vs_ptr + blk * s_vsb + slot * s_vst + kvh * s_vsh, mask=tok_ok,
                               other=0.0)
                p = p * v_sc[None, :]
            acc = _dot(p.to(PV_DTYPE), _cvt(v, PV_DTYPE, INTERP), acc * alpha[:, None], INTERP)

    if MODE == 1:
        v_scale = tl.load(vs_ptr)
        acc = acc * v_scale
    if NUM_SPLITS == 1:
        inv_l = 1.0 / tl.where(l_i > 0, l_i, 1.0)
        d = tl.arange(0, D_PAD)
        out_ptrs = out_ptr + tok_row[:, None] * s_ot + head[:, None] * s_oh + d[None, :]
        mask = row_ok[:, None] & (d[None, :] < D)
        if MODE == 3:
            _unrotate_store(acc_e * inv_l[:, None], acc_o * inv_l[:, None], rot_ptr,
                            out_ptr + tok_row * s_ot + head * s_oh, row_ok, inv_b, D,
                            DH_PAD, D_PAD)
        elif WORDS:
            o_row = out_ptr + tok_row[:, None] * s_ot + head[:, None] * s_oh + 4 * col[None, :]
            o_mask = row_ok[:, None] & col_ok[None, :]
            o_ty = out_ptr.dtype.element_ty
            tl.store(o_row, (acc0 * inv_l[:, None]).to(o_ty), mask=o_mask)
            tl.store(o_row + 1, (acc1 * inv_l[:, None]).to(o_ty), mask=o_mask)
            tl.store(o_row + 2, (acc2 * inv_l[:, None]).to(o_ty), mask=o_mask)
            tl.store(o_row + 3, (acc3 * inv_l[:, None]).to(o_ty), mask=o_mask)
        else:
            tl.store(out_ptrs, (acc * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        base = tok_row[:, None] * s_sot + head[:, None] * s_soh + split * s_sos
        if MODE == 3:
            tl.store(so_ptr + base + 2 * col[None, :], acc_e, mask=row_ok[:, None] & col_ok[None, :])
            tl.store(so_ptr + base + 2 * col[None, :] + 1, acc_o,
                     mask=row_ok[:, None] & col_ok[None, :])
        elif WORDS:
            w_mask = row_ok[:, None] & col_ok[None, :]
            tl.store(so_ptr + base + 4 * col[None, :], acc0, mask=w_mask)
            tl.store(so_ptr + base + 4 * col[None, :] + 1, acc1, mask=w_mask)
            tl.store(so_ptr + base + 4 * col[None, :] + 2, acc2, mask=w_mask)
            tl.store(so_ptr + base + 4 * col[None, :] + 3, acc3, mask=w_mask)
        else:
            tl.store(so_ptr + base + col[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])
        stat = tok_row * s_smt + head * s_smh + split
        tl.store(sm_ptr + stat, m_i, mask=row_ok)
        tl.store(ss_ptr + stat, l_i, mask=row_ok)


@triton.jit
def _combine_kernel(
    out_ptr, so_ptr, sm_ptr, ss_ptr, rot_ptr, seq_lens_ptr, qsl_ptr, inv_b,
    s_ot, s_oh, s_sot, s_soh, s_sos, s_smt, s_smh,
    GQA: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr, ROW_BLOCKS: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, DH_PAD: tl.constexpr, TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, MODE: tl.constexpr,
):
    """Log-sum-exp merge of the splits' partials of one (request, KV head, row block)."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1) // ROW_BLOCKS
    rb = tl.program_id(1) % ROW_BLOCKS
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if rb * BLOCK_M // G_PAD >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    _, _, n_active = _split_range(seq_len, 0, TILE, NUM_SPLITS)
    qi, g, row_ok = _rows(rb, q_len, GQA, G_PAD, BLOCK_M)
    head = kvh * GQA + g
    tok_row = (q_start + qi).to(tl.int64)
    if MODE == 3:
        col = tl.arange(0, DH_PAD)
        col_ok = col < D // 2
        acc_e = tl.zeros([BLOCK_M, DH_PAD], dtype=tl.float32)
        acc_o = tl.zeros([BLOCK_M, DH_PAD], dtype=tl.float32)
    else:
        col = tl.arange(0, D_PAD)
        col_ok = col < D
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    mask = row_ok[:, None] & col_ok[None, :]
    m_all = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_all = tl.zeros([BLOCK_M], dtype=tl.float32)
    for split in range(0, n_active):
        stat = tok_row * s_smt + head * s_smh + split
        m_s = tl.load(sm_ptr + stat, mask=row_ok, other=float("-inf"))
        l_s = tl.load(ss_ptr + stat, mask=row_ok, other=0.0)
        m_new = tl.maximum(m_all, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp2(m_all - m_safe)
        b = tl.exp2(m_s - m_safe)
        base = tok_row[:, None] * s_sot + head[:, None] * s_soh + split * s_sos
        if MODE == 3:
            part_e = tl.load(so_ptr + base + 2 * col[None, :], mask=mask, other=0.0)
            part_o = tl.load(so_ptr + base + 2 * col[None, :] + 1, mask=mask, other=0.0)
            acc_e = acc_e * a[:, None] + part_e * b[:, None]
            acc_o = acc_o * a[:, None] + part_o * b[:, None]
        else:
            part = tl.load(so_ptr + base + col[None, :], mask=mask, other=0.0)
            acc = acc * a[:, None] + part * b[:, None]
        l_all = l_all * a + l_s * b
        m_all = m_new
    inv_l = 1.0 / tl.where(l_all > 0, l_all, 1.0)
    d = tl.arange(0, D_PAD)
    out_ptrs = out_ptr + tok_row[:, None] * s_ot + head[:, None] * s_oh + d[None, :]
    out_mask = row_ok[:, None] & (d[None, :] < D)
    if MODE == 3:
        _unrotate_store(acc_e * inv_l[:, None], acc_o * inv_l[:, None], rot_ptr,
                        out_ptr + tok_row * s_ot + head * s_oh, row_ok, inv_b, D, DH_PAD,
                        D_PAD)
    else:
        tl.store(out_ptrs, (acc * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def row_blocks(max_query_len: int, gqa: int, head_size: int, max_rows: int | None = None
               ) -> tuple[int, int, int]:
    """(G_PAD, BLOCK_M, ROW_BLOCKS): rows token * G_PAD + head of a request, cut into row
    blocks of at most ``max_rows`` (default 128, 64 from head_size 256: the fp32
    accumulator's registers) and at least 16 rows (the tensor-core dot's minimum)."""
    g_pad = triton.next_power_of_2(gqa)
    rows = max(16, triton.next_power_of_2(max_query_len) * g_pad)
    cap = max_rows or (128 if triton.next_power_of_2(head_size) <= 128 else 64)
    block_m = min(rows, max(cap, g_pad, 16))
    return g_pad, block_m, rows // block_m


def default_tile(cache: PagedCache) -> int:
    """KV tokens per loop step: 32 for 16-bit entries, 64 for 8- and 4-bit ones."""
    return 32 if cache.key.element_size() == 2 else 64


def verify_attention(q: torch.Tensor, cache: PagedCache, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                     max_query_len: int, sm_scale: float, out: torch.Tensor, *,
                     q_scale: torch.Tensor | None = None, num_splits: int = 1,
                     scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                     tile: int | None = None, max_rows: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None
                     ) -> torch.Tensor:
    """Write attention of q [T, H_q, D] over ``cache`` into out [T, H_q, D].

    Request b's query tokens are rows query_start_loc[b]:query_start_loc[b + 1] of q
    (at most ``max_query_len`` <= 16 of them, none for a padding request), at the last
    positions of its seq_lens[b] tokens; block_table[b] lists its pages. q is the model
    dtype, or fp8 e4m3 with its float32 per-tensor ``q_scale`` (FP8 caches only). With
    ``num_splits`` > 1, ``scratch`` = (partials [>= T, H_q, >= num_splits, >= D_pad],
    row max and row sum [>= T, H_q, >= num_splits]), float32, is overwritten; upstream's
    split-softmax scratch has this layout.
    """
    t, hq, d = q.shape
    cache.check(d)
    mode = Mode(cache.mode)
    hkv = cache.num_kv_heads
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not split into {hkv} KV head groups")
    if not 1 <= max_query_len <= MAX_QUERY_LEN:
        raise ValueError(f"max_query_len {max_query_len}: allowed 1..{MAX_QUERY_LEN} (verify "
                         "batches; longer queries are prefill)")
    if out.shape != q.shape or q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError(f"q and out must be [T, H_q, D] with contiguous rows, got "
                         f"{tuple(q.shape)} {q.stride()} and {tuple(out.shape)} {out.stride()}")
    q_fp8 = q.dtype == torch.float8_e4m3fn
    if q_fp8 != (q_scale is not None) or (q_fp8 and mode != Mode.FP8):
        raise ValueError("an fp8 query (with its q_scale) goes with an FP8 cache only; got "
                         f"q {q.dtype}, q_scale {'set' if q_scale is not None else 'None'}, "
                         f"cache {mode.name}")
    if not q_fp8 and q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"q must be bf16, fp16 or fp8 e4m3, got {q.dtype}")
    if num_splits < 1:
        raise ValueError(f"num_splits {num_splits}: allowed 1 or more")
    d_pad = triton.next_power_of_2(d)
    if num_splits > 1:
        if scratch is None:
            raise ValueError(f"num_splits {num_splits} needs the split-softmax scratch")
        so, sm, ss = scratch
        if (so.dim() != 4 or so.shape[0] < t or so.shape[1] != hq or so.shape[2] < num_splits
                or so.shape[3] < d_pad or so.stride(3) != 1):
            raise ValueError(f"scratch partials must be float32 [>= {t}, {hq}, >= {num_splits}, "
                             f">= {d_pad}] with a contiguous last dim, got {tuple(so.shape)}")
        for name, x in (("row max", sm), ("row sum", ss)):
            if (x.dim() != 3 or tuple(x.shape[1:2]) != (hq,) or x.shape[0] < t
                    or x.shape[2] < num_splits or x.stride(2) != 1):
                raise ValueError(f"scratch {name} must be float32 [>= {t}, {hq}, >= "
                                 f"{num_splits}] with a contiguous last dim, got "
                                 f"{tuple(x.shape)}")
        if any(x.dtype != torch.float32 for x in scratch):
            raise ValueError("the split-softmax scratch must be float32")
        if sm.stride() != ss.stride():
            raise ValueError(f"scratch row max and row sum need equal strides, got "
                             f"{sm.stride()} and {ss.stride()}")
    else:
        so = sm = ss = out  # not read
    gqa = hq // hkv
    if max_rows is None and mode == Mode.INT4 and d_pad <= 128:
        # int4 row blocks of 64 rows gave wrong outputs on the H200 (q=16 x GQA 4, GQA 8 at
        # head 64; cause not found): blocks of 32 rows, each reading the cache, are verified
        max_rows = 32
    g_pad, block_m, n_rb = row_blocks(max_query_len, gqa, d, max_rows)
    tile = tile or default_tile(cache)
    interp = _interpreting()
    qk_dtype = tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16  # fp8 q: exact in fp16
    if mode == Mode.PLAIN:
        pv_dtype = tl.bfloat16 if cache.value.dtype == torch.bfloat16 else tl.float16
    else:
        pv_dtype = tl.float16  # codes are exact fp16 integers / fp8 values; P keeps 11 bits
    inv_b = 1.0
    qk_scale = sm_scale * LOG2E
    rot = q
    if mode == Mode.INT4:
        b = block_order(d)
        qk_scale /= b  # q' . k' = b (q . k)
        inv_b = 1.0 / b
        rot = kernel_rotation(d, q.device)
    ks = cache.k_scale if cache.k_scale is not None else q
    vs = cache.v_scale if cache.v_scale is not None else q
    ks_strides = ks.stride() if ks.dim() == 3 else (0, 0, 0)
    vs_strides = vs.stride() if vs.dim() == 3 else (0, 0, 0)
    warps = num_warps or (8 if block_m * d_pad >= 8192 else 4)
    launch = {"num_warps": warps}
    if num_stages is None and mode == Mode.INT4 and block_m * d_pad >= 8192:
        num_stages = 2  # three stages of int4's extra operands overflow shared memory
    if num_stages is not None:
        launch["num_stages"] = num_stages
    # Upstream's 8-bit rows (codes + inline scale) start 4- but not 16-byte aligned, so
    # Triton loads them byte by byte; as int32 words they take a quarter of the loads.
    words = (mode == Mode.PER_TOKEN_HEAD and d % 4 == 0 and d_pad >= 64
             and all(x.data_ptr() % 4 == 0 and all(st % 4 == 0 for st in x.stride()[:3])
                     for x in (cache.key, cache.value)))
    num_seqs = seq_lens.shape[0]
    common = dict(GQA=gqa, G_PAD=g_pad, BLOCK_M=block_m, ROW_BLOCKS=n_rb, D=d, D_PAD=d_pad,
                  DH_PAD=max(d_pad // 2, 16), TILE=tile, NUM_SPLITS=num_splits, MODE=int(mode))
    _verify_kernel[(num_seqs, hkv * n_rb, num_splits)](
        q, cache.key, cache.value, ks, vs, q_scale if q_fp8 else q, rot,
        out, so, sm, ss,
        block_table, seq_lens, query_start_loc,
        qk_scale, inv_b,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *cache.key.stride()[:3], *cache.value.stride()[:3],
        *ks_strides, *vs_strides,
        block_table.stride(0),
        so.stride(0), so.stride(1), so.stride(2), sm.stride(0), sm.stride(1),
        PAGE=cache.block_size, QK_DTYPE=qk_dtype, PV_DTYPE=pv_dtype, Q_SCALED=q_fp8,
        INTERP=interp, WORDS=words, **common, **launch)
    if num_splits > 1:
        _combine_kernel[(num_seqs, hkv * n_rb)](
            out, so, sm, ss, rot, seq_lens, query_start_loc, inv_b,
            out.stride(0), out.stride(1), so.stride(0), so.stride(1), so.stride(2),
            sm.stride(0), sm.stride(1), **common, num_warps=4)
    return out
