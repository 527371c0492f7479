"""Triton flush: normalize, round and pack a batch of staged tiles into the paged cache.

One program per (tile, KV head, K-or-V); a tile's bytes do not depend on what else is in
the batch. Reference: ``reference.flush`` / ``reference.encode_tiles``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference as ref
from .layout import PagedKV

# Triton kernels may only read globals that are constexpr.
FP16_MAX = tl.constexpr(ref.FP16_MAX)
IMBALANCE_FLOOR = tl.constexpr(ref.IMBALANCE_FLOOR)
LOG_SCALE_MIN = tl.constexpr(ref.LOG_SCALE_MIN)
LOG_SCALE_MAX = tl.constexpr(ref.LOG_SCALE_MAX)
STD_MIN = tl.constexpr(ref.STD_MIN)
STD_MAX = tl.constexpr(ref.STD_MAX)
STEP_MIN = tl.constexpr(ref.STEP_MIN)
TIE_RTOL = tl.constexpr(ref.TIE_RTOL)


@triton.jit
def _std(y, AXIS: tl.constexpr, N: tl.constexpr):
    mean = tl.sum(y, AXIS) / N
    dev = y - mean[None, :] if AXIS == 0 else y - mean[:, None]
    return tl.sqrt(tl.sum(dev * dev, AXIS) / (N - 1))


@triton.jit
def _imbalance(y, ROWS: tl.constexpr, COLS: tl.constexpr):
    cs = _std(y, 0, ROWS)
    rs = _std(y, 1, COLS)
    return (tl.max(cs, 0) / tl.maximum(tl.min(cs, 0), IMBALANCE_FLOOR)
            + tl.max(rs, 0) / tl.maximum(tl.min(rs, 0), IMBALANCE_FLOOR))


@triton.jit
def _step(log_s, std):
    s = tl.log(tl.clamp(std, STD_MIN, STD_MAX))
    return tl.clamp(log_s + s, LOG_SCALE_MIN, LOG_SCALE_MAX)


@triton.jit
def _scaled(x, lr, lc):
    return x * tl.exp(-lr)[:, None] * tl.exp(-lc)[None, :]


@triton.jit
def _encode_half(src, rec_u8, rec_f16, D: tl.constexpr, ROWS: tl.constexpr,
                 COLS: tl.constexpr, TRANS: tl.constexpr, BITS: tl.constexpr,
                 ITERS: tl.constexpr, CODES_OFF: tl.constexpr, STEP_OFF: tl.constexpr,
                 ZERO_OFF: tl.constexpr, COL_OFF: tl.constexpr):
    r = tl.arange(0, ROWS)
    c = tl.arange(0, COLS)
    if TRANS:  # K: rows are channels, columns are tokens of the [G, D] staged tile
        x = tl.load(src + c[None, :] * D + r[:, None]).to(tl.float32)
    else:
        x = tl.load(src + r[:, None] * D + c[None, :]).to(tl.float32)
    lr = tl.zeros((ROWS,), dtype=tl.float32)
    lc = tl.zeros((COLS,), dtype=tl.float32)
    best_lr = lr
    best_lc = lc
    best = _imbalance(x, ROWS, COLS)
    for _ in range(ITERS):
        lc = _step(lc, _std(_scaled(x, lr, lc), 0, ROWS))
        lr = _step(lr, _std(_scaled(x, lr, lc), 1, COLS))
        imb = _imbalance(_scaled(x, lr, lc), ROWS, COLS)
        better = imb <= best * (1 + TIE_RTOL)  # ties go to the later iteration
        best = tl.where(better, imb, best)
        best_lr = tl.where(better, lr, best_lr)
        best_lc = tl.where(better, lc, best_lc)

    y = _scaled(x, best_lr, best_lc)
    QMAX: tl.constexpr = (1 << BITS) - 1
    mn = tl.min(y, 1)
    step = tl.maximum((tl.max(y, 1) - mn) / QMAX, STEP_MIN)
    q = tl.clamp(tl.floor((y - mn[:, None]) / step[:, None] + 0.5), 0.0, QMAX).to(tl.int32)

    PER: tl.constexpr = 8 // BITS
    NB: tl.constexpr = COLS // PER
    shifts = tl.arange(0, PER) * BITS
    packed = tl.sum(tl.reshape(q, (ROWS, NB, PER)) << shifts[None, None, :], 2)
    tl.store(rec_u8 + CODES_OFF + r[:, None] * NB + tl.arange(0, NB)[None, :],
             packed.to(tl.uint8))

    row = tl.exp(best_lr)
    col = tl.exp(best_lc)
    # An all-zero column can only reconstruct exactly through a zero scale.
    col = tl.where(tl.max(tl.abs(x), 0) > 0, col, 0.0)
    tl.store(rec_f16 + STEP_OFF // 2 + r,
             tl.clamp(step * row, -FP16_MAX, FP16_MAX).to(tl.float16))
    tl.store(rec_f16 + ZERO_OFF // 2 + r,
             tl.clamp(mn * row, -FP16_MAX, FP16_MAX).to(tl.float16))
    tl.store(rec_f16 + COL_OFF // 2 + c, tl.clamp(col, -FP16_MAX, FP16_MAX).to(tl.float16))


@triton.jit
def _flush_kernel(side_ptr, src_ptr, dst_ptr, cache_u8, cache_f16,
                  H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, REC: tl.constexpr,
                  KB: tl.constexpr, VB: tl.constexpr, ITERS: tl.constexpr,
                  K_CODES: tl.constexpr, K_COL: tl.constexpr, K_ZERO: tl.constexpr,
                  K_ROW: tl.constexpr, V_CODES: tl.constexpr, V_COL: tl.constexpr,
                  V_ROW: tl.constexpr, V_ZERO: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    which = tl.program_id(2)
    src = tl.load(src_ptr + t).to(tl.int64)
    dst = tl.load(dst_ptr + t).to(tl.int64)
    if dst >= 0:
        tile = side_ptr + src * (2 * H * G * D) + which * (H * G * D) + h * (G * D)
        rec = (dst * H + h) * REC
        if which == 0:
            _encode_half(tile, cache_u8 + rec, cache_f16 + rec // 2, D, D, G, True, KB,
                         ITERS, K_CODES, K_COL, K_ZERO, K_ROW)
        else:
            _encode_half(tile, cache_u8 + rec, cache_f16 + rec // 2, D, G, D, False, VB,
                         ITERS, V_CODES, V_ROW, V_ZERO, V_COL)


def flush(kv: PagedKV, src_side_blocks: torch.Tensor, dst_blocks: torch.Tensor,
          debug: bool = False, iters: int = ref.NORM_ITERS) -> None:
    """Quantize side blocks src_side_blocks[i] into cache block dst_blocks[i], all heads.

    A negative dst_blocks[i] skips entry i, so a fixed-size table (filled on the device
    each step) replays in a CUDA graph. debug=True checks every id on the host first
    (syncs; not for CUDA graphs).
    """
    if src_side_blocks.shape != dst_blocks.shape or src_side_blocks.dim() != 1:
        raise ValueError("src_side_blocks and dst_blocks must be 1-D and of equal length")
    if debug:
        kv.check_ids(src_side_blocks, kv.side.shape[0], "side block")
        kv.check_ids(dst_blocks[dst_blocks >= 0], kv.cache.shape[0], "cache block")
    n = src_side_blocks.shape[0]
    if n == 0:
        return
    p, lay = kv.preset, kv.preset.layout(kv.head_dim)
    elems = kv.head_dim * p.group
    _flush_kernel[(n, kv.num_kv_heads, 2)](
        kv.side, src_side_blocks.contiguous(), dst_blocks.contiguous(), kv.cache,
        kv.cache.view(torch.float16),
        H=kv.num_kv_heads, G=p.group, D=kv.head_dim, REC=lay.total,
        KB=p.key_bits, VB=p.value_bits, ITERS=iters,
        K_CODES=lay.k_codes, K_COL=lay.k_col_scale, K_ZERO=lay.k_zero, K_ROW=lay.k_row_scale,
        V_CODES=lay.v_codes, V_COL=lay.v_col_scale, V_ROW=lay.v_row_scale, V_ZERO=lay.v_zero,
        num_warps=max(4, min(16, elems // 2048)))
