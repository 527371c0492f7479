"""Torch fp32 reference of the KVarN format and of every kernel in this package.

Everything here favours clarity over speed; the Triton kernels are tested against it.
Functions accept a leading batch of tiles where that costs nothing in clarity, so tests
can build caches of a few thousand tiles quickly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .hadamard import sylvester
from .layout import PagedKV
from .preset import Preset

FP16_MAX = 65504.0
NORM_ITERS = 8
LOG_SCALE_MIN, LOG_SCALE_MAX = -0.3, 10.0
STD_MIN, STD_MAX = 1e-3, 1e3
STEP_MIN = 1e-10
IMBALANCE_FLOOR = 1e-8
# An iteration whose imbalance is within this relative margin of the best so far counts
# as a tie (and wins, being later): near convergence the trace moves by 1e-7, which is
# fp32 noise, and a kernel must make the same choice as this reference.
TIE_RTOL = 1e-5


# --------------------------------------------------------------------------- rotation


def hadamard(head_dim: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix H/sqrt(D): symmetric and self-inverse."""
    h = sylvester(head_dim).double() / math.sqrt(head_dim)
    return h.to(dtype=dtype, device=device)


def sanitize(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """fp32 copy of x with NaN -> 0 and everything else clamped into fp16 range.

    Returns the copy and how many elements were changed. Clamping (not refusing) keeps
    one bad activation from taking down a whole batch; the count lets callers log it.
    """
    x = x.float()
    bad = ~torch.isfinite(x) | (x.abs() > FP16_MAX)
    out = torch.nan_to_num(x, nan=0.0).clamp(-FP16_MAX, FP16_MAX)
    return out, int(bad.sum())


def rotate_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """What rotate-and-stage stores: sanitize, cast to fp16, rotate in fp32, clamp, fp16.

    Returns the fp16 rows and the number of clamped elements (input and output side).
    """
    xs, bad_in = sanitize(x)
    y = xs.half().float() @ hadamard(x.shape[-1], device=x.device)
    bad_out = int((y.abs() > FP16_MAX).sum())
    return y.clamp(-FP16_MAX, FP16_MAX).half(), bad_in + bad_out


# ------------------------------------------------------------------------- normalizer


def _std(y: torch.Tensor, dim: int) -> torch.Tensor:
    return y.std(dim=dim, correction=1)


def imbalance(y: torch.Tensor) -> torch.Tensor:
    """max/min of column stds + max/min of row stds (min floored); balanced scores 2."""
    total = torch.zeros(y.shape[:-2], dtype=torch.float32, device=y.device)
    for dim in (-2, -1):
        s = _std(y, dim)
        total = total + s.amax(-1) / s.amin(-1).clamp_min(IMBALANCE_FLOOR)
    return total


def _scaled(x: torch.Tensor, log_row: torch.Tensor, log_col: torch.Tensor) -> torch.Tensor:
    return x * torch.exp(-log_row)[..., :, None] * torch.exp(-log_col)[..., None, :]


def _step_scales(log_s: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    return (log_s + torch.log(std.clamp(STD_MIN, STD_MAX))).clamp(LOG_SCALE_MIN, LOG_SCALE_MAX)


@dataclass
class Normalized:
    log_row: torch.Tensor  # [..., R]
    log_col: torch.Tensor  # [..., C]
    best_iter: torch.Tensor  # [...] int: 0 is the identity
    trace: torch.Tensor  # [..., iters + 1] imbalance after each iteration


def normalize(x: torch.Tensor, iters: int = NORM_ITERS) -> Normalized:
    """Alternating column/row variance normalization of x [..., R, C] in the log domain.

    Keeps the best-so-far scales (lowest imbalance, ties within TIE_RTOL to the later
    iteration), starting from the identity: the last iteration's scales can be far worse.
    """
    x = x.float()
    log_row = torch.zeros(x.shape[:-1], dtype=torch.float32, device=x.device)
    log_col = torch.zeros(x.shape[:-2] + x.shape[-1:], dtype=torch.float32, device=x.device)
    best_row, best_col = log_row, log_col
    best_imb = imbalance(x)
    best_iter = torch.zeros(x.shape[:-2], dtype=torch.int64, device=x.device)
    trace = [best_imb]
    for it in range(1, iters + 1):
        log_col = _step_scales(log_col, _std(_scaled(x, log_row, log_col), -2))
        log_row = _step_scales(log_row, _std(_scaled(x, log_row, log_col), -1))
        imb = imbalance(_scaled(x, log_row, log_col))
        trace.append(imb)
        better = imb <= best_imb * (1 + TIE_RTOL)
        best_imb = torch.where(better, imb, best_imb)
        best_iter = torch.where(better, it, best_iter)
        best_row = torch.where(better[..., None], log_row, best_row)
        best_col = torch.where(better[..., None], log_col, best_col)
    return Normalized(best_row, best_col, best_iter, torch.stack(trace, -1))


# ---------------------------------------------------------------- rounding and packing


def quantize_rows(y: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest per row. Returns (codes int32, step, zero=row min).

    Rounds half up (floor(v + 0.5)) so that the kernels can match it bit for bit.
    """
    qmax = (1 << bits) - 1
    mn, mx = y.amin(-1), y.amax(-1)
    step = ((mx - mn) / qmax).clamp_min(STEP_MIN)
    codes = torch.floor((y - mn[..., None]) / step[..., None] + 0.5).clamp(0, qmax)
    return codes.to(torch.int32), step, mn


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes [..., C] into bytes [..., C*bits/8], row-major, low bits first."""
    per = 8 // bits
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_bits: bytes [..., N] -> codes int32 [..., N*8/bits]."""
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    c = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def to_fp16_saturated(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP16_MAX, FP16_MAX).half()


# ------------------------------------------------------------------------ tile codec


@dataclass
class EncodedHalf:
    """One oriented tile [R, C] after normalize + round, with folded fp16 scales."""

    codes: torch.Tensor  # int32 [..., R, C]
    row_step: torch.Tensor  # fp16 [..., R]: step * row scale
    row_zero: torch.Tensor  # fp16 [..., R]: zero * row scale
    col_scale: torch.Tensor  # fp16 [..., C]: column scale (0 for an all-zero column)


def encode_oriented(x: torch.Tensor, bits: int, iters: int = NORM_ITERS) -> EncodedHalf:
    """Normalize, round per row and fold, for x [..., R, C] already oriented."""
    x = x.float()
    n = normalize(x, iters)
    codes, step, zero = quantize_rows(_scaled(x, n.log_row, n.log_col), bits)
    row = torch.exp(n.log_row)
    col = torch.exp(n.log_col)
    # An all-zero column can only reconstruct exactly through a zero scale.
    col = torch.where((x != 0).any(-2), col, torch.zeros_like(col))
    return EncodedHalf(
        codes,
        to_fp16_saturated(step * row),
        to_fp16_saturated(zero * row),
        to_fp16_saturated(col),
    )


def encode_tiles(k_rot: torch.Tensor, v_rot: torch.Tensor, preset: Preset,
                 iters: int = NORM_ITERS) -> torch.Tensor:
    """Encode tiles: k_rot, v_rot [..., G, D] (tokens x channels, rotated, finite).

    Returns uint8 records [..., tile_bytes] in the spec's field order. Non-finite input
    is refused: rotate_rows (rotate-and-stage) clamps and counts before rows get here.
    """
    g, d = k_rot.shape[-2:]
    if not (torch.isfinite(k_rot).all() and torch.isfinite(v_rot).all()):
        raise ValueError("encode_tiles: K/V contain NaN or Inf; stage rows through "
                         "rotate_rows (which clamps and counts) first")
    if g != preset.group or v_rot.shape[-2:] != (g, d):
        raise ValueError(
            f"{preset.name}: expected k_rot and v_rot of shape [..., {preset.group}, D], "
            f"got {tuple(k_rot.shape)} and {tuple(v_rot.shape)}")
    lay = preset.layout(d)
    k = encode_oriented(k_rot.float().transpose(-1, -2), preset.key_bits, iters)  # [D, G]
    v = encode_oriented(v_rot.float(), preset.value_bits, iters)  # [G, D]

    def b(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(torch.uint8).reshape(*t.shape[:-1], -1)

    parts = [
        pack_bits(k.codes, preset.key_bits).flatten(-2),
        b(k.row_step), b(k.row_zero), b(k.col_scale),
        pack_bits(v.codes, preset.value_bits).flatten(-2),
        b(v.col_scale), b(v.row_step), b(v.row_zero),
    ]
    rec = torch.cat(parts, -1)
    assert rec.shape[-1] == lay.total
    return rec


def encode_tile(k_rot: torch.Tensor, v_rot: torch.Tensor, preset: Preset) -> torch.Tensor:
    """One tile: k_rot, v_rot [G, D] -> uint8 record [tile_bytes]."""
    return encode_tiles(k_rot, v_rot, preset)


def _f16(rec: torch.Tensor, off: int, n: int) -> torch.Tensor:
    return rec[..., off:off + 2 * n].contiguous().view(torch.float16).float()


def decode_tiles(records: torch.Tensor, preset: Preset, head_dim: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """records uint8 [..., tile_bytes] -> (k_rot, v_rot) fp32 [..., G, D]."""
    lay = preset.layout(head_dim)
    d, g = head_dim, preset.group
    if records.dtype != torch.uint8 or records.shape[-1] != lay.total:
        raise ValueError(f"{preset.name}, D={d}: expected uint8 records of "
                         f"{lay.total} bytes, got {records.dtype} {tuple(records.shape)}")
    lead = records.shape[:-1]
    kq = unpack_bits(records[..., lay.k_codes:lay.k_col_scale], preset.key_bits)
    kq = kq.reshape(*lead, d, g).float()
    k = (kq * _f16(records, lay.k_col_scale, d)[..., :, None]
         + _f16(records, lay.k_zero, d)[..., :, None]) * _f16(records, lay.k_row_scale, g)[..., None, :]
    vq = unpack_bits(records[..., lay.v_codes:lay.v_col_scale], preset.value_bits)
    vq = vq.reshape(*lead, g, d).float()
    v = (vq * _f16(records, lay.v_row_scale, g)[..., :, None]
         + _f16(records, lay.v_zero, g)[..., :, None]) * _f16(records, lay.v_col_scale, d)[..., None, :]
    return k.transpose(-1, -2), v


def decode_tile(record: torch.Tensor, preset: Preset, head_dim: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One record [tile_bytes] -> (k_rot, v_rot) fp32 [G, D]."""
    return decode_tiles(record, preset, head_dim)


# ------------------------------------------------------------------- paged operations


def flush(kv: PagedKV, src_side_blocks: torch.Tensor, dst_blocks: torch.Tensor) -> None:
    """Encode whole staged blocks from the side pool into the paged cache, all heads."""
    kv.check_ids(src_side_blocks, kv.side.shape[0], "side block")
    kv.check_ids(dst_blocks, kv.cache.shape[0], "cache block")
    src = kv.side[src_side_blocks.long()]  # [T, 2, H, G, D]
    kv.cache[dst_blocks.long()] = encode_tiles(src[:, 0], src[:, 1], kv.preset)


def dequantize_blocks(kv: PagedKV, block_ids: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantized blocks -> fp16 K, V [N, G, H, D] (rotated frame, vLLM's NHD block layout)."""
    kv.check_ids(block_ids, kv.cache.shape[0], "cache block")
    k, v = decode_tiles(kv.cache[block_ids.long()], kv.preset, kv.head_dim)  # [N, H, G, D]
    return k.transpose(1, 2).half(), v.transpose(1, 2).half()


def gather_request(kv: PagedKV, b: int, block_table: torch.Tensor, side_table: torch.Tensor,
                   seq_len: int, num_flushed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All seq_len rotated K/V rows of request b as fp32 [L, H, D]: logical block 0 (the
    sink) and blocks past num_flushed from the side pool, blocks 1..num_flushed records.
    One gather per pool, so that references over long contexts stay quick on a GPU."""
    g = kv.preset.group
    n_blocks = (seq_len + g - 1) // g
    n_rec = min(num_flushed, max(0, n_blocks - 1))
    n_side = n_blocks - n_rec  # the sink, then the tail from block n_rec + 1
    if n_side > side_table.shape[1]:
        raise IndexError(f"request {b}: block {n_blocks - 1} needs side table column "
                         f"{n_side - 1}, width is {side_table.shape[1]}")
    sid = side_table[b, :n_side]
    kv.check_ids(sid, kv.side.shape[0], "side table entry")
    side = kv.side[sid.long()].float()  # [S, 2, H, G, D]
    ks, vs = [side[:1, 0]], [side[:1, 1]]
    if n_rec:
        pid = block_table[b, 1:n_rec + 1]
        kv.check_ids(pid, kv.cache.shape[0], "block table entry")
        k, v = decode_tiles(kv.cache[pid.long()], kv.preset, kv.head_dim)  # [F, H, G, D]
        ks.append(k)
        vs.append(v)
    ks.append(side[1:, 0])
    vs.append(side[1:, 1])

    def rows(blocks: list[torch.Tensor]) -> torch.Tensor:  # [N, H, G, D] -> [N*G, H, D]
        x = torch.cat(blocks).transpose(1, 2)
        return x.reshape(-1, *x.shape[2:])[:seq_len]

    return rows(ks), rows(vs)


def paged_attention(q_rot: torch.Tensor, kv: PagedKV, block_table: torch.Tensor,
                    side_table: torch.Tensor, seq_lens: torch.Tensor,
                    num_flushed: torch.Tensor, sm_scale: float | None = None) -> torch.Tensor:
    """Dequantize-then-attend over the paged cache, in the rotated frame.

    q_rot [B, Q, Hq, D]: Q query tokens per request (1 for decode, k+1 for speculative
    verify); query row i of request b sees positions < seq_len - Q + i + 1.
    Returns fp32 [B, Q, Hq, D].
    """
    bsz, nq, hq, d = q_rot.shape
    hkv = kv.side.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of KV heads {hkv}")
    kv.check_tables(block_table, side_table, seq_lens, num_flushed, nq)
    scale = sm_scale if sm_scale is not None else d ** -0.5
    out = torch.empty(bsz, nq, hq, d, dtype=torch.float32, device=q_rot.device)
    for b in range(bsz):
        L, F = int(seq_lens[b]), int(num_flushed[b])
        k, v = gather_request(kv, b, block_table, side_table, L, F)
        k = k.repeat_interleave(hq // hkv, 1)  # [L, Hq, D]
        v = v.repeat_interleave(hq // hkv, 1)
        s = torch.einsum("qhd,lhd->hql", q_rot[b].float(), k) * scale
        pos = torch.arange(L, device=q_rot.device)
        limit = L - nq + 1 + torch.arange(nq, device=q_rot.device)
        s = s.masked_fill(pos[None, None, :] >= limit[None, :, None], float("-inf"))
        out[b] = torch.einsum("hql,lhd->qhd", torch.softmax(s, -1), v)
    return out
