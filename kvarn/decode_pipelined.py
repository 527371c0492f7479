"""The "pipelined" KVarN decode / speculative-verify kernel (see ``decode.attend_rotated``).

Same grid, inputs, outputs and reference as the "prefetch" kernel in ``decode``; what
changes is how records are streamed, after ncu showed that kernel latency-bound on its
record loads at 2 CTAs per SM with DRAM mostly idle:

* the loop over records is software-pipelined by Triton: ``num_stages`` - 1 later
  steps' bytes are in flight (cp.async into shared memory) while one is computed,
  instead of an L2 prefetch and a load per use; a step is a record (its sub-tiles of
  TS tokens unrolled) or, with FLAT, one sub-tile (fewer registers, finer buffers);
* codes unpack with the exponent put in by the byte permute (``unpack_prmt_ptx``);
* per step, one cross-warp reduction for the running max (the even and odd token
  halves are merged elementwise first) and one for the value zero-point term; the
  softmax denominator is accumulated elementwise and reduced once, at the end;
* when a request is split, its fp16 blocks (sink and tail) get a program of their own
  (partial number ``SPLITS``) instead of lengthening split 0, the straggler of short
  single-sequence decodes.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._triton_common import checked
from .decode_side import side_pool_blocks
from .decode_unpack import crumbs, nibbles


@triton.jit
def _v_part(acc, alpha, pa_e, pa_o, c_e, c_o, pbias, vcol, U: tl.constexpr,
            VB: tl.constexpr, VPER: tl.constexpr, VNB: tl.constexpr):
    """Channels VPER*i + U: codes arrive as f * code (f = 2**(U*VB), folded into the
    column scale)."""
    f: tl.constexpr = 1 << (U * VB)
    pv = tl.dot(pa_o, c_o, tl.dot(pa_e, c_e))
    vc = tl.load(vcol + VPER * tl.arange(0, VNB) + U).to(tl.float32) * (1.0 / f)
    return acc * alpha[:, None] + (pv + (pbias * f)[:, None]) * vc[None, :]


@triton.jit
def _record(bt_row, i, n_cache, h, err_ptr, H: tl.constexpr, REC: tl.constexpr,
            DEBUG: tl.constexpr):
    """Byte offset of the record of logical block i + 1, KV head h."""
    blk = checked(tl.load(bt_row + i), n_cache, err_ptr, DEBUG)
    return tl.multiple_of((blk.to(tl.int64) * H + h) * REC, 128)


@triton.jit
def _record_query(qf, cache_f16, rec, D: tl.constexpr, K_COL: tl.constexpr,
                  K_ZERO: tl.constexpr):
    """The query with the record's K column scales folded in, and its zero-point term."""
    dd = tl.arange(0, D)
    f16 = cache_f16 + rec // 2
    ka = tl.load(f16 + K_COL // 2 + dd).to(tl.float32)
    kz = tl.load(f16 + K_ZERO // 2 + dd).to(tl.float32)
    return (qf * ka[None, :]).to(tl.float16), tl.sum(qf * kz[None, :], 1)


@triton.jit
def _pairs(ptr, jj):
    """fp16 values 2 jj and 2 jj + 1 as fp32 (one contiguous load, split in registers)."""
    a, b = tl.split(tl.load(ptr + 2 * jj[:, None] + tl.arange(0, 2)[None, :]))
    return a.to(tl.float32), b.to(tl.float32)


@triton.jit
def _sub_tile(m_i, l_e, l_o, acc0, acc1, acc2, acc3, qa, bias, cache_u8, cache_f16, rec,
              jj, qk_scale, D: tl.constexpr, G: tl.constexpr, VB: tl.constexpr,
              K_ROW: tl.constexpr, V_CODES: tl.constexpr, V_COL: tl.constexpr,
              V_ROW: tl.constexpr, V_ZERO: tl.constexpr, USE_ASM: tl.constexpr):
    """One online-softmax step over the token pairs jj of the record at byte rec."""
    VPER: tl.constexpr = 8 // VB
    KNB: tl.constexpr = G // 2
    VNB: tl.constexpr = D // VPER
    dd = tl.arange(0, D)
    f16 = cache_f16 + rec // 2
    kb = tl.load(cache_u8 + rec + dd[:, None] * KNB + jj[None, :])
    k_lo, k_hi = nibbles(kb, USE_ASM, True)
    # K codes arrive as c (even tokens) and 16 c (odd tokens, 1/16 folded into kc_o)
    kc_e, kc_o = _pairs(f16 + K_ROW // 2, jj)
    s_e = (tl.dot(qa, k_lo) + bias[:, None]) * (kc_e * qk_scale)[None, :]
    s_o = (tl.dot(qa, k_hi) + (bias * 16.0)[:, None]) * (kc_o * (qk_scale * 0.0625))[None, :]
    m_new = tl.maximum(m_i, tl.max(tl.maximum(s_e, s_o), 1))
    alpha = tl.exp2(m_i - m_new)
    p_e = tl.exp2(s_e - m_new[:, None])
    p_o = tl.exp2(s_o - m_new[:, None])
    l_e = l_e * alpha[:, None] + p_e
    l_o = l_o * alpha[:, None] + p_o
    va_e, va_o = _pairs(f16 + V_ROW // 2, jj)
    vz_e, vz_o = _pairs(f16 + V_ZERO // 2, jj)
    pa_e = (p_e * va_e[None, :]).to(tl.float16)
    pa_o = (p_o * va_o[None, :]).to(tl.float16)
    pbias = tl.sum(p_e * vz_e[None, :] + p_o * vz_o[None, :], 1)
    vrow = cache_u8 + rec + V_CODES + (2 * jj)[:, None] * VNB + tl.arange(0, VNB)[None, :]
    vb_e = tl.load(vrow)
    vb_o = tl.load(vrow + VNB)
    vcol = f16 + V_COL // 2
    if VB == 2:
        e0, e1, e2, e3 = crumbs(vb_e, USE_ASM, True)
        o0, o1, o2, o3 = crumbs(vb_o, USE_ASM, True)
        acc0 = _v_part(acc0, alpha, pa_e, pa_o, e0, o0, pbias, vcol, 0, VB, VPER, VNB)
        acc1 = _v_part(acc1, alpha, pa_e, pa_o, e1, o1, pbias, vcol, 1, VB, VPER, VNB)
        acc2 = _v_part(acc2, alpha, pa_e, pa_o, e2, o2, pbias, vcol, 2, VB, VPER, VNB)
        acc3 = _v_part(acc3, alpha, pa_e, pa_o, e3, o3, pbias, vcol, 3, VB, VPER, VNB)
    else:
        e0, e1 = nibbles(vb_e, USE_ASM, True)
        o0, o1 = nibbles(vb_o, USE_ASM, True)
        acc0 = _v_part(acc0, alpha, pa_e, pa_o, e0, o0, pbias, vcol, 0, VB, VPER, VNB)
        acc1 = _v_part(acc1, alpha, pa_e, pa_o, e1, o1, pbias, vcol, 1, VB, VPER, VNB)
    return m_new, l_e, l_o, acc0, acc1, acc2, acc3


# No value specialization of the runtime ints: one binary per launch configuration,
# whatever the batch, pool sizes and split count (fewer JIT compiles while serving, and
# a small-shape warm-up compiles exactly what a large one runs).
@triton.jit(do_not_specialize=["bt_stride", "st_stride", "st_width", "n_cache", "n_side",
                               "SPLITS"])
def attn_pipelined_kernel(
        q_ptr, cache_u8, cache_f16, side_ptr, bt_ptr, st_ptr, seq_ptr, nf_ptr, o_ptr,
        lse_ptr, err_ptr, bt_stride, st_stride, st_width, n_cache, n_side, qk_scale, SPLITS,
        H: tl.constexpr, HQ: tl.constexpr, Q: tl.constexpr, HPG: tl.constexpr,
        G: tl.constexpr, D: tl.constexpr, VB: tl.constexpr, REC: tl.constexpr,
        K_COL: tl.constexpr, K_ZERO: tl.constexpr, K_ROW: tl.constexpr,
        V_CODES: tl.constexpr, V_COL: tl.constexpr, V_ROW: tl.constexpr,
        V_ZERO: tl.constexpr, BLOCK_M: tl.constexpr, TS: tl.constexpr,
        STAGES: tl.constexpr, FLAT: tl.constexpr, FP_SPLIT: tl.constexpr,
        USE_ASM: tl.constexpr, DEBUG: tl.constexpr):
    # Program (b, h, s). Records (logical blocks 1..F) are split evenly over s < SPLITS;
    # the fp16 blocks go to s == SPLITS when FP_SPLIT, else to s == 0. Tokens are taken
    # as even/odd halves (the two nibbles of a K byte) and channels as VPER interleaved
    # groups (the codes of a V byte), so unpacking is masks only.
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    L = tl.load(seq_ptr + b)
    F = tl.load(nf_ptr + b)
    VPER: tl.constexpr = 8 // VB
    VNB: tl.constexpr = D // VPER
    KH: tl.constexpr = TS // 2
    NSUB: tl.constexpr = G // TS

    rows = tl.arange(0, BLOCK_M)
    qi = rows // HPG
    row_ok = rows < Q * HPG
    dd = tl.arange(0, D)
    q_off = ((b * Q + qi) * HQ + h * HPG + rows % HPG).to(tl.int64)
    qf = tl.load(q_ptr + q_off[:, None] * D + dd[None, :], mask=row_ok[:, None],
                 other=0.0).to(tl.float32)
    limit = L - Q + qi + 1  # row qi sees positions < limit

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_e = tl.zeros((BLOCK_M, KH), tl.float32)  # denominators, reduced after the loop
    l_o = tl.zeros((BLOCK_M, KH), tl.float32)
    acc0 = tl.zeros((BLOCK_M, VNB), tl.float32)
    acc1 = tl.zeros((BLOCK_M, VNB), tl.float32)
    acc2 = tl.zeros((BLOCK_M, VNB), tl.float32)
    acc3 = tl.zeros((BLOCK_M, VNB), tl.float32)

    bt_row = bt_ptr + b.to(tl.int64) * bt_stride + 1
    per_split = tl.cdiv(F, SPLITS)
    lo = tl.minimum(s * per_split, F)
    hi = tl.minimum(lo + per_split, F)
    kk = tl.arange(0, KH)
    if FLAT:  # one pipelined step per sub-tile
        for it in tl.range(lo * NSUB, hi * NSUB, num_stages=STAGES):
            rec = _record(bt_row, it // NSUB, n_cache, h, err_ptr, H, REC, DEBUG)
            qa, bias = _record_query(qf, cache_f16, rec, D, K_COL, K_ZERO)
            m_i, l_e, l_o, acc0, acc1, acc2, acc3 = _sub_tile(
                m_i, l_e, l_o, acc0, acc1, acc2, acc3, qa, bias, cache_u8, cache_f16, rec,
                (it % NSUB) * KH + kk, qk_scale, D, G, VB, K_ROW, V_CODES, V_COL, V_ROW,
                V_ZERO, USE_ASM)
    else:  # one pipelined step per record, its sub-tiles unrolled
        for i in tl.range(lo, hi, num_stages=STAGES):
            rec = _record(bt_row, i, n_cache, h, err_ptr, H, REC, DEBUG)
            qa, bias = _record_query(qf, cache_f16, rec, D, K_COL, K_ZERO)
            for c in tl.static_range(NSUB):
                m_i, l_e, l_o, acc0, acc1, acc2, acc3 = _sub_tile(
                    m_i, l_e, l_o, acc0, acc1, acc2, acc3, qa, bias, cache_u8, cache_f16,
                    rec, c * KH + kk, qk_scale, D, G, VB, K_ROW, V_CODES, V_COL, V_ROW,
                    V_ZERO, USE_ASM)
    l_i = tl.sum(l_e + l_o, 1)

    if FP_SPLIT:
        fp_here = s == SPLITS
    else:
        fp_here = s == 0
    if fp_here:
        acc0, acc1, acc2, acc3, m_i, l_i = side_pool_blocks(
            acc0, acc1, acc2, acc3, m_i, l_i, qf.to(tl.float16), side_ptr,
            st_ptr + b.to(tl.int64) * st_stride, L, F, st_width, limit, h, n_side, err_ptr,
            qk_scale, H, G, D, TS, VPER, DEBUG)

    empty = l_i == 0.0  # a program with no visible position
    inv = 1.0 / tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    o_row = q_off * (SPLITS + FP_SPLIT) + s
    optr = o_ptr + o_row[:, None] * D + VPER * tl.arange(0, VNB)[None, :]
    tl.store(optr, acc0 * inv[:, None], mask=row_ok[:, None])
    tl.store(optr + 1, acc1 * inv[:, None], mask=row_ok[:, None])
    if VPER == 4:
        tl.store(optr + 2, acc2 * inv[:, None], mask=row_ok[:, None])
        tl.store(optr + 3, acc3 * inv[:, None], mask=row_ok[:, None])
    tl.store(lse_ptr + o_row, lse, mask=row_ok)
