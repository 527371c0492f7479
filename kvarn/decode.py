"""Triton fused decode / speculative-verify attention over the paged KVarN cache.

One program per (request, KV head, split) serves every query head of the GQA group and
every query token of the request (one virtual row each, with its own causal limit), so
each record is read and unpacked once. Scales are folded out of the per-element work:

    scores[m, t] = c[t] * (sum_d (q[m, d] a[d]) code[d, t] + sum_d q[m, d] z[d])
    out[m, d]   += c'[d] * (sum_t (p[m, t] a'[t]) code'[t, d] + sum_t p[m, t] z'[t])

so a tile costs a shift, mask, OR and fp16 subtract per code (no int-to-float
conversion) and tensor-core dots. Split-K partials are merged by a log-sum-exp combine. The
launch depends only on tensor shapes (no host syncs), so it can be captured in a CUDA graph. Reference:
``reference.paged_attention``.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import decode_select
from ._triton_common import checked
from .combine import combine
from .decode_side import side_pool_blocks
from .decode_unpack import crumbs, nibbles
from .layout import PagedKV
from .rotate import rotate

LOG2E = 1.4426950408889634


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


# No value specialization of the runtime ints: one binary per launch configuration,
# whatever the batch, pool sizes and split count (fewer JIT compiles while serving, and
# a small-shape warm-up compiles exactly what a large one runs).
@triton.jit(do_not_specialize=["bt_stride", "st_stride", "st_width", "n_cache", "n_side",
                               "SPLITS"])
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
            k_lo, k_hi = nibbles(kb, USE_ASM)
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
                e0, e1, e2, e3 = crumbs(vb_e, USE_ASM)
                o0, o1, o2, o3 = crumbs(vb_o, USE_ASM)
                acc0 = _v_acc(acc0, alpha, pa_e, pa_o, e0, o0, pbias, vcol, 0, VB, VPER, VNB)
                acc1 = _v_acc(acc1, alpha, pa_e, pa_o, e1, o1, pbias, vcol, 1, VB, VPER, VNB)
                acc2 = _v_acc(acc2, alpha, pa_e, pa_o, e2, o2, pbias, vcol, 2, VB, VPER, VNB)
                acc3 = _v_acc(acc3, alpha, pa_e, pa_o, e3, o3, pbias, vcol, 3, VB, VPER, VNB)
            else:
                e0, e1 = nibbles(vb_e, USE_ASM)
                o0, o1 = nibbles(vb_o, USE_ASM)
                acc0 = _v_acc(acc0, alpha, pa_e, pa_o, e0, o0, pbias, vcol, 0, VB, VPER, VNB)
                acc1 = _v_acc(acc1, alpha, pa_e, pa_o, e1, o1, pbias, vcol, 1, VB, VPER, VNB)
            m_i = m_new

    # fp16 rows from the side pool: sink (logical block 0) then the tail (F+1, ...).
    if s == 0:
        acc0, acc1, acc2, acc3, m_i, l_i = side_pool_blocks(
            acc0, acc1, acc2, acc3, m_i, l_i, qf.to(tl.float16), side_ptr,
            st_ptr + b.to(tl.int64) * st_stride, L, F, st_width, limit, h, n_side, err_ptr,
            qk_scale, H, G, D, TS, VPER, DEBUG)

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


VARIANTS = ("prefetch",)  # the Triton kernel, tuned by launch parameters
# What variant= and KVARN_DECODE_VARIANT accept: "cuda" is the CUDA C++ kernel
# (decode_cuda) where it is available and has the shape, else "prefetch"; "auto" is the
# same choice, with its fallbacks logged as info rather than warnings (decode_select).
CHOICES = ("auto", "cuda", *VARIANTS)
# The kernel ``attend`` uses unless told otherwise: the CUDA kernel ran 1.5x to 3.8x as
# fast as the Triton ones on the H200 (RELEASE-NOTES.md, "A CUDA decode kernel"); the
# environment variable KVARN_DECODE_VARIANT overrides it (for end-to-end comparisons).
DEFAULT_VARIANT = "auto"
# Launch parameters per variant, and per head dim where the sweep found another best;
# programs_per_sm sizes the split-K grid (default_splits).
LAUNCH_DEFAULTS: dict[str, dict] = {
    "prefetch": {"num_warps": 4, "num_stages": 1, "maxnreg": None, "tile_tokens": 128,
                 "prefetch": 2, "programs_per_sm": 2},
}
LAUNCH_DEFAULTS_BY_HEAD_DIM: dict[tuple[str, int], dict] = {}
_PARAMS = {"prefetch": {"num_warps", "num_stages", "maxnreg", "tile_tokens", "prefetch",
                        "programs_per_sm", "unpack_asm"}}


def default_variant() -> str:
    v = os.environ.get("KVARN_DECODE_VARIANT") or DEFAULT_VARIANT
    if v not in CHOICES:
        raise ValueError(f"KVARN_DECODE_VARIANT={v!r}: allowed: {', '.join(CHOICES)}")
    return v


def launch_config(variant: str, head_dim: int, **overrides) -> dict:
    """The variant's launch parameters at this head dim, with overrides (None = default)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown decode variant {variant!r}; allowed: {', '.join(VARIANTS)}")
    bad = sorted(k for k, v in overrides.items() if v is not None and k not in _PARAMS[variant])
    if bad:
        raise TypeError(f"decode variant {variant!r} takes no {', '.join(bad)}; "
                        f"its parameters: {', '.join(sorted(_PARAMS[variant]))}")
    cfg = {**LAUNCH_DEFAULTS[variant], **LAUNCH_DEFAULTS_BY_HEAD_DIM.get((variant, head_dim), {})}
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    return cfg


def default_splits(batch: int, num_kv_heads: int, max_blocks: int,
                   programs_per_sm: int = 2) -> int:
    """Enough splits to give every SM about programs_per_sm programs, from shapes alone
    (so the choice is fixed under CUDA-graph capture); at least 4 blocks per split."""
    if torch.cuda.is_available():
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    else:
        sms = 4
    want = triton.cdiv(programs_per_sm * sms, batch * num_kv_heads)
    return max(1, min(want, max_blocks // 4, 64))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def attend_rotated(q_rot: torch.Tensor, kv: PagedKV, block_table: torch.Tensor,
                   side_table: torch.Tensor, seq_lens: torch.Tensor,
                   num_flushed: torch.Tensor, sm_scale: float | None = None,
                   num_splits: int | None = None, debug: bool = False,
                   variant: str | None = None,
                   selector: decode_select.DecodeSelector | None = None,
                   **launch) -> torch.Tensor:
    """Attention in the rotated frame. q_rot [B, Q, Hq, D] -> fp32 [B, Q, Hq, D].

    Q = 1 is decode; Q = k + 1 is speculative verify (row i sees seq_len - Q + i + 1
    positions). variant: "cuda" (the CUDA C++ kernel, ``decode_cuda``, where its library
    is available and has the shape, else "prefetch"), "auto" (the same choice; a
    fallback is logged as info, not as a warning) or "prefetch" (the Triton kernel, with
    an L2 prefetch of the next records); default ``default_variant()``. selector: the
    ``decode_select.DecodeSelector`` that remembers, across calls, whether the CUDA kernel
    serves this process and which fallbacks were logged (None: a fresh one, for this call).
    Launch parameters tune the Triton kernel only (None or absent = ``launch_config``):
    num_warps, num_stages, maxnreg (caps registers per thread; the prefetch kernel takes
    ~240 otherwise, 2 programs of 4 warps per H200 SM), tile_tokens (tokens per
    online-softmax step, a power of two >= 32, capped at the group), programs_per_sm
    (split-K grid size when num_splits is None), unpack_asm (inline-PTX unpacking;
    default on CUDA outside the interpreter, the portable path computes the same fp16
    values), prefetch (records run ahead into L2, PTX path only, 0 = off).
    debug=True validates the tables on the host and flags, inside the kernel, any
    block id outside its pool (raising IndexError).
    """
    bsz, nq, hq, d = q_rot.shape
    h, g = kv.num_kv_heads, kv.preset.group
    if d != kv.head_dim or hq % h:
        raise ValueError(f"q must be [B, Q, k*{h}, {kv.head_dim}], got {tuple(q_rot.shape)}")
    if kv.preset.key_bits != 4:
        raise ValueError(f"{kv.preset.name}: the decode kernel supports 4-bit keys only")
    variant = variant or default_variant()
    if variant not in CHOICES:
        raise ValueError(f"unknown decode variant {variant!r}; allowed: {', '.join(CHOICES)}")
    if variant in ("auto", "cuda"):
        given = sorted(k for k, v in launch.items() if v is not None)
        if given:
            raise TypeError(f"decode variant {variant!r} takes no {', '.join(given)}: launch "
                            f"parameters tune the Triton kernel ({', '.join(VARIANTS)})")
        selector = selector or decode_select.DecodeSelector()
        if selector.choose(variant, kv.preset, d, nq * (hq // h), q_rot.device,
                           debug) == "cuda":
            out = selector.attend(q_rot, kv, block_table, side_table, seq_lens,
                                  num_flushed, sm_scale, num_splits or None)
            if out is not None:
                return out
        variant = decode_select.FALLBACK
    cfg = launch_config(variant, d, **launch)
    ts = min(cfg["tile_tokens"], g)
    if ts < 32 or ts & (ts - 1):
        raise ValueError(f"tile_tokens must be a power of two >= 32, got {cfg['tile_tokens']}")
    if debug:
        kv.check_tables(block_table, side_table, seq_lens, num_flushed, nq)
    splits = num_splits or default_splits(bsz, h, block_table.shape[1], cfg["programs_per_sm"])
    unpack_asm = cfg.get("unpack_asm")
    if unpack_asm is None:
        unpack_asm = q_rot.is_cuda and torch.version.hip is None
    if _interpreting():
        unpack_asm = False  # inline PTX does not run in the interpreter
    hpg = hq // h
    lay = kv.preset.layout(d)
    dev = q_rot.device
    o = torch.empty(bsz * nq * hq * splits, d, dtype=torch.float32, device=dev)
    lse = torch.empty(bsz * nq * hq * splits, dtype=torch.float32, device=dev)
    # The error flag is written only in debug mode; otherwise any int32 buffer will do
    # (no memset launch on the decode path).
    err = torch.zeros(1, dtype=torch.int32, device=dev) if debug else seq_lens
    scale = (sm_scale if sm_scale is not None else d ** -0.5) * LOG2E
    args = (q_rot.contiguous(), kv.cache, kv.cache.view(torch.float16), kv.side,
            block_table, side_table, seq_lens, num_flushed, o, lse, err,
            block_table.stride(0), side_table.stride(0), side_table.shape[1],
            kv.cache.shape[0], kv.side.shape[0], scale, splits)
    fields = dict(H=h, HQ=hq, Q=nq, HPG=hpg, G=g, D=d, VB=kv.preset.value_bits,
                  REC=lay.total, K_COL=lay.k_col_scale, K_ZERO=lay.k_zero,
                  K_ROW=lay.k_row_scale, V_CODES=lay.v_codes, V_COL=lay.v_col_scale,
                  V_ROW=lay.v_row_scale, V_ZERO=lay.v_zero,
                  BLOCK_M=max(16, triton.next_power_of_2(nq * hpg)), TS=ts,
                  USE_ASM=bool(unpack_asm), DEBUG=debug, num_warps=cfg["num_warps"])
    if cfg["maxnreg"]:
        fields["maxnreg"] = cfg["maxnreg"]
    _attn_kernel[(bsz, h, splits)](*args, **fields, num_stages=cfg["num_stages"],
                                   PF=cfg["prefetch"] if unpack_asm else 0)
    if debug and int(err.item()):
        raise IndexError("a block table or side table entry points outside its pool")
    if splits == 1:
        return o.view(bsz, nq, hq, d)
    out = torch.empty(bsz * nq * hq, d, dtype=torch.float32, device=dev)
    return combine(o, lse, splits, out).view(bsz, nq, hq, d)


def attend(q: torch.Tensor, kv: PagedKV, block_table: torch.Tensor, side_table: torch.Tensor,
           seq_lens: torch.Tensor, num_flushed: torch.Tensor, **kwargs) -> torch.Tensor:
    """Decode (Q = 1) or speculative verify (Q > 1): q [B, Q, Hq, D] -> fp16, model frame."""
    out_rot = attend_rotated(rotate(q), kv, block_table, side_table, seq_lens, num_flushed,
                             **kwargs)
    return rotate(out_rot, torch.float16)
