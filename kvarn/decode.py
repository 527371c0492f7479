"""Triton fused decode / speculative-verify attention over the paged KVarN cache.

One program per (request, KV head, split) serves every query head of the GQA group and
every query token of the request (one virtual row each, with its own causal limit), so
each record is read and unpacked once. Scales are folded out of the per-element work:

    scores[m, t] = c[t] * (sum_d (q[m, d] a[d]) code[d, t] + sum_d q[m, d] z[d])
    out[m, d]   += c'[d] * (sum_t (p[m, t] a'[t]) code'[t, d] + sum_t p[m, t] z'[t])

so a tile costs a shift, mask, OR and fp16 subtract per code (no int-to-float
conversion) and tensor-core dots. Split-K partials are merged by a log-sum-exp combine. The launch depends only on tensor shapes
(no host syncs), so it can be captured in a CUDA graph. Reference:
``reference.paged_attention``.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._triton_common import checked
from .layout import PagedKV
from .rotate import rotate

LOG2E = 1.4426950408889634


@triton.jit
def _u8_f16(x, m: tl.constexpr):
    """Portable twin of the PTX unpackers: byte & m as an exact fp16, via the bit pattern
    0x6400 | v = 1024 + v and an exact fp16 subtract (no int-to-float conversion)."""
    return ((x.to(tl.int16) & m) | 0x6400).to(tl.float16, bitcast=True) - 1024.0


def _unpack_ptx(masks: tuple[int, ...]) -> str:
    """PTX for one uint8 -> fp16 unpacker, 4 bytes per call: prmt spreads the bytes into
    two fp16x2 words; per mask, an AND keeps the code's bits, an OR puts the exponent of
    1024 in and an exact HSUB2 takes 1024 off, so a pair of codes costs one LOP3 and one
    HSUB2. Output 2i is mask i over bytes 0 and 1, output 2i + 1 over bytes 2 and 3."""
    src = f"${2 * len(masks)}"
    lines = [".reg .b32 a, b, t, m;", "mov.b32 m, 0x64006400;",
             f"prmt.b32 a, {src}, 0, 0x4140;", f"prmt.b32 b, {src}, 0, 0x4342;"]
    for i, mask in enumerate(masks):
        for j, word in enumerate("ab"):
            lines += [f"and.b32 t, {word}, 0x{mask:04X}{mask:04X};", "or.b32 t, t, m;",
                      f"sub.rn.f16x2 ${2 * i + j}, t, m;"]
    return "{\n" + "\n".join(lines) + "\n}"


def _unpack_constraints(masks: tuple[int, ...]) -> str:
    return "=r," * (2 * len(masks)) + "r"


_NIBBLE_MASKS = (0x0F, 0xF0)
_CRUMB_MASKS = (0x03, 0x0C, 0x30, 0xC0)
_NIBBLES_PTX = tl.constexpr(_unpack_ptx(_NIBBLE_MASKS))
_NIBBLES_CONSTRAINTS = tl.constexpr(_unpack_constraints(_NIBBLE_MASKS))
_CRUMBS_PTX = tl.constexpr(_unpack_ptx(_CRUMB_MASKS))
_CRUMBS_CONSTRAINTS = tl.constexpr(_unpack_constraints(_CRUMB_MASKS))


@triton.jit
def _nibbles(x, USE_ASM: tl.constexpr):
    """uint8 -> (low nibble, 16 * high nibble) as exact fp16 (see _unpack_ptx)."""
    if USE_ASM:
        lo, hi = tl.inline_asm_elementwise(
            asm=_NIBBLES_PTX, constraints=_NIBBLES_CONSTRAINTS, args=[x],
            dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        lo = _u8_f16(x, 0x0F)
        hi = _u8_f16(x, 0xF0)
    return lo, hi


@triton.jit
def _crumbs(x, USE_ASM: tl.constexpr):
    """uint8 -> 4**u * (2-bit code u), u = 0..3, as exact fp16 (see _unpack_ptx)."""
    if USE_ASM:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(
            asm=_CRUMBS_PTX, constraints=_CRUMBS_CONSTRAINTS, args=[x],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        c0 = _u8_f16(x, 0x03)
        c1 = _u8_f16(x, 0x0C)
        c2 = _u8_f16(x, 0x30)
        c3 = _u8_f16(x, 0xC0)
    return c0, c1, c2, c3


@triton.jit
def _prefetch_record(cache_u8, bt_row, i, n_cache, h, H: tl.constexpr, REC: tl.constexpr):
    """Ask L2 for record (block_table[i], h), one 128-byte line per lane (PTX only; the
    kernel is latency-bound on its record loads otherwise). Bad ids are skipped."""
    blk = tl.load(bt_row + i)
    ok = (blk >= 0) & (blk < n_cache)
    NL: tl.constexpr = triton.next_power_of_2((REC + 127) // 128)
    line = tl.minimum(tl.arange(0, NL) * 128, REC - 128)
    addr = cache_u8 + (tl.where(ok, blk, 0).to(tl.int64) * H + h) * REC + line
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [addr],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _v_acc(acc, alpha, pa_e, pa_o, c_e, c_o, pbias, vcol_ptr, U: tl.constexpr,
           VB: tl.constexpr, VPER: tl.constexpr, VNB: tl.constexpr):
    """Channels VPER*i + U of a sub-tile's V contribution. The codes arrive in place
    (f * code, f = 2**(U*VB)), so f is folded into the column scale."""
    f: tl.constexpr = 1 << (U * VB)
    pv = tl.dot(pa_e, c_e)
    pv = tl.dot(pa_o, c_o, pv)
    vc = tl.load(vcol_ptr + VPER * tl.arange(0, VNB) + U).to(tl.float32) * (1.0 / f)
    return acc * alpha[:, None] + (pv + (pbias * f)[:, None]) * vc[None, :]


@triton.jit
def _fp16_v_part(acc, alpha, p16, vbase, tt, U: tl.constexpr, VPER: tl.constexpr,
                 D: tl.constexpr):
    v = tl.load(vbase + tt[:, None] * D + VPER * tl.arange(0, D // VPER)[None, :] + U)
    return acc * alpha[:, None] + tl.dot(p16, v)


@triton.jit
def _attn_kernel(q_ptr, cache_u8, cache_f16, side_ptr, bt_ptr, st_ptr, seq_ptr, nf_ptr,
                 o_ptr, lse_ptr, err_ptr, bt_stride, st_stride, st_width, n_cache, n_side,
                 qk_scale, SPLITS, H: tl.constexpr, HQ: tl.constexpr, Q: tl.constexpr, HPG: tl.constexpr,
                 G: tl.constexpr, D: tl.constexpr, VB: tl.constexpr, REC: tl.constexpr,
                 K_COL: tl.constexpr, K_ZERO: tl.constexpr, K_ROW: tl.constexpr,
                 V_CODES: tl.constexpr, V_COL: tl.constexpr, V_ROW: tl.constexpr,
                 V_ZERO: tl.constexpr, BLOCK_M: tl.constexpr, TS: tl.constexpr,
                 USE_ASM: tl.constexpr, PF: tl.constexpr, DEBUG: tl.constexpr):
    # Tokens are handled as even/odd halves (the low/high nibble of each K byte) and
    # channels as VPER interleaved groups (the codes of each V byte), so unpacking is
    # masks only, with no register shuffles. Each record is walked in sub-tiles of TS
    # tokens (one online-softmax step each), so no whole dequantized G x D tile is
    # ever live: that is what keeps the register count, and so occupancy, up.
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    L = tl.load(seq_ptr + b)
    F = tl.load(nf_ptr + b)
    VPER: tl.constexpr = 8 // VB
    KNB: tl.constexpr = G // 2
    VNB: tl.constexpr = D // VPER
    KH: tl.constexpr = TS // 2
    NSUB: tl.constexpr = G // TS

    rows = tl.arange(0, BLOCK_M)
    qi = rows // HPG
    head = h * HPG + rows % HPG
    row_ok = rows < Q * HPG
    dd = tl.arange(0, D)
    q_off = ((b * Q + qi) * HQ + head).to(tl.int64)
    qf = tl.load(q_ptr + q_off[:, None] * D + dd[None, :], mask=row_ok[:, None],
                 other=0.0).to(tl.float32)
    limit = L - Q + qi + 1  # row qi sees positions < limit

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc0 = tl.zeros((BLOCK_M, VNB), tl.float32)
    acc1 = tl.zeros((BLOCK_M, VNB), tl.float32)
    acc2 = tl.zeros((BLOCK_M, VNB), tl.float32)
    acc3 = tl.zeros((BLOCK_M, VNB), tl.float32)

    # Quantized logical blocks 1..F, split evenly per request (no host-side lengths).
    per_split = tl.cdiv(F, SPLITS)
    lo = s * per_split
    hi = tl.minimum(lo + per_split, F)
    if PF > 0:  # warm L2 with the first records of this split
        for ahead in tl.static_range(1, PF):
            _prefetch_record(cache_u8, bt_ptr + b * bt_stride + 1, tl.minimum(lo + ahead, hi - 1),
                             n_cache, h, H, REC)
    for i in range(lo, hi):
        blk = tl.load(bt_ptr + b * bt_stride + 1 + i)
        blk = checked(blk, n_cache, err_ptr, DEBUG)
        if PF > 0:  # the record PF blocks ahead streams into L2 while this one is used
            _prefetch_record(cache_u8, bt_ptr + b * bt_stride + 1, tl.minimum(i + PF, hi - 1),
                             n_cache, h, H, REC)
        rec = (blk.to(tl.int64) * H + h) * REC
        rec = tl.multiple_of(rec, 128)
        f16 = cache_f16 + rec // 2
        ka = tl.load(f16 + K_COL // 2 + dd).to(tl.float32)
        kz = tl.load(f16 + K_ZERO // 2 + dd).to(tl.float32)
        qa = (qf * ka[None, :]).to(tl.float16)
        # K codes arrive as c (even tokens) and 16 c (odd tokens, 1/16 folded into kc_o)
        bias_e = tl.sum(qf * kz[None, :], 1)
        bias_o = bias_e * 16.0
        vcol = f16 + V_COL // 2
        for c in tl.static_range(NSUB):
            jj = c * KH + tl.arange(0, KH)
            kb = tl.load(cache_u8 + rec + dd[:, None] * KNB + jj[None, :])
            k_lo, k_hi = _nibbles(kb, USE_ASM)
            s_e = tl.dot(qa, k_lo)  # tokens 2j
            s_o = tl.dot(qa, k_hi)  # tokens 2j + 1
            kc_e = tl.load(f16 + K_ROW // 2 + 2 * jj).to(tl.float32) * qk_scale
            kc_o = tl.load(f16 + K_ROW // 2 + 2 * jj + 1).to(tl.float32) * (qk_scale * 0.0625)
            s_e = (s_e + bias_e[:, None]) * kc_e[None, :]
            s_o = (s_o + bias_o[:, None]) * kc_o[None, :]

            m_new = tl.maximum(m_i, tl.maximum(tl.max(s_e, 1), tl.max(s_o, 1)))
            alpha = tl.exp2(m_i - m_new)
            p_e = tl.exp2(s_e - m_new[:, None])
            p_o = tl.exp2(s_o - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p_e, 1) + tl.sum(p_o, 1)

            pa_e = (p_e * tl.load(f16 + V_ROW // 2 + 2 * jj).to(tl.float32)[None, :]
                    ).to(tl.float16)
            pa_o = (p_o * tl.load(f16 + V_ROW // 2 + 2 * jj + 1).to(tl.float32)[None, :]
                    ).to(tl.float16)
            pbias = (tl.sum(p_e * tl.load(f16 + V_ZERO // 2 + 2 * jj).to(tl.float32)[None, :], 1)
                     + tl.sum(p_o * tl.load(f16 + V_ZERO // 2 + 2 * jj + 1).to(tl.float32)[None, :], 1))
            vb_e = tl.load(cache_u8 + rec + V_CODES + (2 * jj)[:, None] * VNB
                           + tl.arange(0, VNB)[None, :])
            vb_o = tl.load(cache_u8 + rec + V_CODES + (2 * jj + 1)[:, None] * VNB
                           + tl.arange(0, VNB)[None, :])
            if VB == 2:
                e0, e1, e2, e3 = _crumbs(vb_e, USE_ASM)
                o0, o1, o2, o3 = _crumbs(vb_o, USE_ASM)
                acc0 = _v_acc(acc0, alpha, pa_e, pa_o, e0, o0, pbias, vcol, 0, VB, VPER, VNB)
                acc1 = _v_acc(acc1, alpha, pa_e, pa_o, e1, o1, pbias, vcol, 1, VB, VPER, VNB)
                acc2 = _v_acc(acc2, alpha, pa_e, pa_o, e2, o2, pbias, vcol, 2, VB, VPER, VNB)
                acc3 = _v_acc(acc3, alpha, pa_e, pa_o, e3, o3, pbias, vcol, 3, VB, VPER, VNB)
            else:
                e0, e1 = _nibbles(vb_e, USE_ASM)
                o0, o1 = _nibbles(vb_o, USE_ASM)
                acc0 = _v_acc(acc0, alpha, pa_e, pa_o, e0, o0, pbias, vcol, 0, VB, VPER, VNB)
                acc1 = _v_acc(acc1, alpha, pa_e, pa_o, e1, o1, pbias, vcol, 1, VB, VPER, VNB)
            m_i = m_new

    # fp16 rows from the side pool: sink (logical block 0) then the tail (F+1, ...).
    if s == 0:
        q = qf.to(tl.float16)
        # Bounded by the table, so a dummy run's arbitrary lengths read only its zeros.
        n_fp = tl.minimum(tl.cdiv(L, G) - F, st_width)
        for j in range(0, n_fp):
            logical = tl.where(j == 0, 0, F + j)
            sid = tl.load(st_ptr + b * st_stride + j)
            sid = checked(sid, n_side, err_ptr, DEBUG)
            base = side_ptr + sid.to(tl.int64) * (2 * H * G * D) + h * (G * D)
            vbase = base + H * G * D
            for c in tl.static_range(NSUB):
                tt = c * TS + tl.arange(0, TS)
                k = tl.load(base + tt[None, :] * D + dd[:, None])  # [D, TS]
                sc = tl.dot(q, k) * qk_scale
                pos = logical * G + tt
                sc = tl.where(pos[None, :] < limit[:, None], sc, float("-inf"))
                # the sink's first sub-tile always holds a visible token, so m_new is
                # finite from the first step on
                m_new = tl.maximum(m_i, tl.max(sc, 1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(sc - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                p16 = p.to(tl.float16)
                acc0 = _fp16_v_part(acc0, alpha, p16, vbase, tt, 0, VPER, D)
                acc1 = _fp16_v_part(acc1, alpha, p16, vbase, tt, 1, VPER, D)
                if VPER == 4:
                    acc2 = _fp16_v_part(acc2, alpha, p16, vbase, tt, 2, VPER, D)
                    acc3 = _fp16_v_part(acc3, alpha, p16, vbase, tt, 3, VPER, D)
                m_i = m_new

    empty = l_i == 0.0  # a split with no blocks
    inv = 1.0 / tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    o_row = q_off * SPLITS + s
    optr = o_ptr + o_row[:, None] * D + VPER * tl.arange(0, VNB)[None, :]
    tl.store(optr, acc0 * inv[:, None], mask=row_ok[:, None])
    tl.store(optr + 1, acc1 * inv[:, None], mask=row_ok[:, None])
    if VPER == 4:
        tl.store(optr + 2, acc2 * inv[:, None], mask=row_ok[:, None])
        tl.store(optr + 3, acc3 * inv[:, None], mask=row_ok[:, None])
    tl.store(lse_ptr + o_row, lse, mask=row_ok)


@triton.jit
def _combine_kernel(o_ptr, lse_ptr, out_ptr, D: tl.constexpr, SPLITS: tl.constexpr,
                    BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ss = tl.arange(0, BLOCK_S)
    dd = tl.arange(0, D)
    lse = tl.load(lse_ptr + row * SPLITS + ss, mask=ss < SPLITS, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    o = tl.load(o_ptr + (row * SPLITS + ss)[:, None] * D + dd[None, :],
                mask=(ss < SPLITS)[:, None], other=0.0)
    tl.store(out_ptr + row * D + dd, tl.sum(o * w[:, None], 0) / tl.sum(w, 0))


def default_splits(batch: int, num_kv_heads: int, max_blocks: int) -> int:
    """Enough splits to give every SM about two programs, from shapes alone (so the
    choice is fixed under CUDA-graph capture); at least 4 blocks per split."""
    if torch.cuda.is_available():
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    else:
        sms = 4
    want = triton.cdiv(2 * sms, batch * num_kv_heads)
    return max(1, min(want, max_blocks // 4, 64))


def attend_rotated(q_rot: torch.Tensor, kv: PagedKV, block_table: torch.Tensor,
                   side_table: torch.Tensor, seq_lens: torch.Tensor,
                   num_flushed: torch.Tensor, sm_scale: float | None = None,
                   num_splits: int | None = None, debug: bool = False,
                   num_warps: int = 4, num_stages: int = 1,
                   maxnreg: int | None = None, tile_tokens: int = 128,
                   unpack_asm: bool | None = None, prefetch: int = 2) -> torch.Tensor:
    """Attention in the rotated frame. q_rot [B, Q, Hq, D] -> fp32 [B, Q, Hq, D].

    Q = 1 is decode; Q = k + 1 is speculative verify (row i sees seq_len - Q + i + 1
    positions). maxnreg caps registers per thread (the kernel otherwise takes ~240,
    which limits an H200 SM to 2 programs of 4 warps). tile_tokens: tokens per inner
    online-softmax step (a power of two >= 32; capped at the group). unpack_asm: unpack
    codes with inline PTX (default: on CUDA outside the interpreter; the portable path
    computes the same fp16 values). prefetch: records to run ahead into L2 (PTX path
    only; 0 turns it off). debug=True validates the tables on the host and flags,
    inside the kernel, any block id outside its pool (raising IndexError).
    """
    bsz, nq, hq, d = q_rot.shape
    h, g = kv.num_kv_heads, kv.preset.group
    if d != kv.head_dim or hq % h:
        raise ValueError(f"q must be [B, Q, k*{h}, {kv.head_dim}], got {tuple(q_rot.shape)}")
    if kv.preset.key_bits != 4:
        raise ValueError(f"{kv.preset.name}: the decode kernel supports 4-bit keys only")
    if debug:
        kv.check_tables(block_table, side_table, seq_lens, num_flushed, nq)
    splits = num_splits or default_splits(bsz, h, block_table.shape[1])
    hpg = hq // h
    lay = kv.preset.layout(d)
    o = torch.empty(bsz * nq * hq * splits, d, dtype=torch.float32, device=q_rot.device)
    lse = torch.empty(bsz * nq * hq * splits, dtype=torch.float32, device=q_rot.device)
    err = torch.zeros(1, dtype=torch.int32, device=q_rot.device)
    scale = (sm_scale if sm_scale is not None else d ** -0.5) * LOG2E
    ts = min(tile_tokens, g)
    if ts < 32 or ts & (ts - 1):
        raise ValueError(f"tile_tokens must be a power of two >= 32, got {tile_tokens}")
    if unpack_asm is None:
        unpack_asm = q_rot.is_cuda and torch.version.hip is None
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        unpack_asm = False  # inline PTX does not run in the interpreter
    _attn_kernel[(bsz, h, splits)](
        q_rot.contiguous(), kv.cache, kv.cache.view(torch.float16), kv.side,
        block_table, side_table, seq_lens, num_flushed, o, lse, err,
        block_table.stride(0), side_table.stride(0), side_table.shape[1],
        kv.cache.shape[0], kv.side.shape[0],
        scale, splits, H=h, HQ=hq, Q=nq, HPG=hpg, G=g, D=d, VB=kv.preset.value_bits, REC=lay.total,
        K_COL=lay.k_col_scale, K_ZERO=lay.k_zero, K_ROW=lay.k_row_scale,
        V_CODES=lay.v_codes, V_COL=lay.v_col_scale, V_ROW=lay.v_row_scale, V_ZERO=lay.v_zero,
        BLOCK_M=max(16, triton.next_power_of_2(nq * hpg)), TS=ts,
        USE_ASM=bool(unpack_asm), PF=prefetch if unpack_asm else 0, DEBUG=debug,
        num_warps=num_warps, num_stages=num_stages,
        **({"maxnreg": maxnreg} if maxnreg else {}))
    if debug and int(err.item()):
        raise IndexError("a block table or side table entry points outside its pool")
    if splits == 1:
        return o.view(bsz, nq, hq, d)
    out = torch.empty(bsz * nq * hq, d, dtype=torch.float32, device=q_rot.device)
    _combine_kernel[(bsz * nq * hq,)](o, lse, out, D=d, SPLITS=splits,
                                      BLOCK_S=triton.next_power_of_2(splits))
    return out.view(bsz, nq, hq, d)


def attend(q: torch.Tensor, kv: PagedKV, block_table: torch.Tensor, side_table: torch.Tensor,
           seq_lens: torch.Tensor, num_flushed: torch.Tensor, **kwargs) -> torch.Tensor:
    """Decode (Q = 1) or speculative verify (Q > 1): q [B, Q, Hq, D] -> fp16, model frame."""
    out_rot = attend_rotated(rotate(q), kv, block_table, side_table, seq_lens, num_flushed,
                             **kwargs)
    return rotate(out_rot, torch.float16)
