"""Triton dequantize-to-fp16 of whole records: the context of a prefill chunk
(``materialize_rows``), and a prefix-hit sink whose fp16 rows were evicted from the
side pool (``restore_sinks``).

Writes rotated-frame K and V into fp16 scratch blocks laid out as vLLM's NHD paged
cache ([N, G, H, D]), so a prefill attention can read them through a scratch block
table (rotate q in and the output back out with ``rotate.rotate``).
Reference: ``reference.dequantize_blocks``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_common import checked, unpack
from .layout import PagedKV


@triton.jit
def _decode_record(cache_u8, cache_f16, rec, G: tl.constexpr, D: tl.constexpr,
                   KB: tl.constexpr, VB: tl.constexpr, K_COL: tl.constexpr,
                   K_ZERO: tl.constexpr, K_ROW: tl.constexpr, V_CODES: tl.constexpr,
                   V_COL: tl.constexpr, V_ROW: tl.constexpr, V_ZERO: tl.constexpr):
    """The record at byte offset rec -> fp32 (K [D, G], V [G, D]), rotated frame."""
    f16 = cache_f16 + rec // 2
    dd = tl.arange(0, D)
    tt = tl.arange(0, G)
    KNB: tl.constexpr = G * KB // 8
    VNB: tl.constexpr = D * VB // 8
    kq = unpack(tl.load(cache_u8 + rec + dd[:, None] * KNB + tl.arange(0, KNB)[None, :]),
                D, KNB, KB).to(tl.float32)  # [D, G]
    k = ((kq * tl.load(f16 + K_COL // 2 + dd).to(tl.float32)[:, None]
          + tl.load(f16 + K_ZERO // 2 + dd).to(tl.float32)[:, None])
         * tl.load(f16 + K_ROW // 2 + tt).to(tl.float32)[None, :])
    vq = unpack(tl.load(cache_u8 + rec + V_CODES + tt[:, None] * VNB
                        + tl.arange(0, VNB)[None, :]), G, VNB, VB).to(tl.float32)  # [G, D]
    v = ((vq * tl.load(f16 + V_ROW // 2 + tt).to(tl.float32)[:, None]
          + tl.load(f16 + V_ZERO // 2 + tt).to(tl.float32)[:, None])
         * tl.load(f16 + V_COL // 2 + dd).to(tl.float32)[None, :])
    return k, v


@triton.jit
def _dequant_kernel(ids_ptr, cache_u8, cache_f16, k_ptr, v_ptr, err_ptr, n_cache,
                    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, KB: tl.constexpr,
                    VB: tl.constexpr, REC: tl.constexpr, K_COL: tl.constexpr,
                    K_ZERO: tl.constexpr, K_ROW: tl.constexpr, V_CODES: tl.constexpr,
                    V_COL: tl.constexpr, V_ROW: tl.constexpr, V_ZERO: tl.constexpr,
                    DEBUG: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    blk = checked(tl.load(ids_ptr + n), n_cache, err_ptr, DEBUG)
    rec = (blk.to(tl.int64) * H + h) * REC
    k, v = _decode_record(cache_u8, cache_f16, rec, G, D, KB, VB, K_COL, K_ZERO, K_ROW,
                          V_CODES, V_COL, V_ROW, V_ZERO)
    dd = tl.arange(0, D)
    tt = tl.arange(0, G)
    out = (n.to(tl.int64) * G * H + h) * D  # row t of block n, head h: + t * H * D
    tl.store(k_ptr + out + tt[None, :] * (H * D) + dd[:, None], k.to(tl.float16))
    tl.store(v_ptr + out + tt[:, None] * (H * D) + dd[None, :], v.to(tl.float16))


@triton.jit
def _restore_kernel(dst_ptr, row_ptr, bt_ptr, bt_stride, cache_u8, cache_f16, side_ptr,
                    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, KB: tl.constexpr,
                    VB: tl.constexpr, REC: tl.constexpr, K_COL: tl.constexpr,
                    K_ZERO: tl.constexpr, K_ROW: tl.constexpr, V_CODES: tl.constexpr,
                    V_COL: tl.constexpr, V_ROW: tl.constexpr, V_ZERO: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    dst = tl.load(dst_ptr + n).to(tl.int64)
    if dst >= 0:
        blk = tl.load(bt_ptr + tl.load(row_ptr + n).to(tl.int64) * bt_stride)
        rec = (blk.to(tl.int64) * H + h) * REC
        k, v = _decode_record(cache_u8, cache_f16, rec, G, D, KB, VB, K_COL, K_ZERO, K_ROW,
                              V_CODES, V_COL, V_ROW, V_ZERO)
        dd = tl.arange(0, D)
        tt = tl.arange(0, G)
        base = side_ptr + dst * (2 * H * G * D) + h * (G * D)
        tl.store(base + tt[None, :] * D + dd[:, None], k.to(tl.float16))
        tl.store(base + H * G * D + tt[:, None] * D + dd[None, :], v.to(tl.float16))


def restore_sinks(kv: PagedKV, dst_side_blocks: torch.Tensor, rows: torch.Tensor,
                  block_table: torch.Tensor) -> None:
    """Side block dst_side_blocks[n] <- the record of logical block 0 of row rows[n]
    (a prefix hit on a sink whose fp16 rows were evicted). Negative entries are
    skipped, so a fixed-size table replays in a CUDA graph."""
    n, p = dst_side_blocks.shape[0], kv.preset
    if n == 0:
        return
    lay = p.layout(kv.head_dim)
    _restore_kernel[(n, kv.num_kv_heads)](
        dst_side_blocks, rows, block_table, block_table.stride(0), kv.cache,
        kv.cache.view(torch.float16), kv.side, H=kv.num_kv_heads, G=p.group,
        D=kv.head_dim, KB=p.key_bits, VB=p.value_bits, REC=lay.total,
        K_COL=lay.k_col_scale, K_ZERO=lay.k_zero, K_ROW=lay.k_row_scale,
        V_CODES=lay.v_codes, V_COL=lay.v_col_scale, V_ROW=lay.v_row_scale,
        V_ZERO=lay.v_zero, num_warps=8)


def dequantize_blocks(kv: PagedKV, block_ids: torch.Tensor, debug: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Records cache[block_ids] -> fp16 K, V [N, G, H, D] in the rotated frame.

    debug=True flags ids outside the cache inside the kernel and raises IndexError.
    """
    n, h, d, p = block_ids.shape[0], kv.num_kv_heads, kv.head_dim, kv.preset
    k = torch.empty(n, p.group, h, d, dtype=torch.float16, device=kv.cache.device)
    v = torch.empty_like(k)
    if n == 0:
        return k, v
    lay = p.layout(d)
    err = torch.zeros(1, dtype=torch.int32, device=kv.cache.device)
    _dequant_kernel[(n, h)](
        block_ids.contiguous(), kv.cache, kv.cache.view(torch.float16), k, v, err,
        kv.cache.shape[0], H=h, G=p.group, D=d, KB=p.key_bits, VB=p.value_bits,
        REC=lay.total, K_COL=lay.k_col_scale, K_ZERO=lay.k_zero, K_ROW=lay.k_row_scale,
        V_CODES=lay.v_codes, V_COL=lay.v_col_scale, V_ROW=lay.v_row_scale,
        V_ZERO=lay.v_zero, DEBUG=debug, num_warps=8)
    if debug and int(err.item()):
        raise IndexError(f"a block id is outside the cache [0, {kv.cache.shape[0]})")
    return k, v


@triton.jit
def _materialize_kernel(first_row, bt_ptr, bt_stride, st_ptr, st_stride, nf_ptr, seq_ptr,
                        off_ptr, cache_u8, cache_f16, side_ptr, k_ptr, v_ptr,
                        H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, KB: tl.constexpr,
                        VB: tl.constexpr, REC: tl.constexpr, K_COL: tl.constexpr,
                        K_ZERO: tl.constexpr, K_ROW: tl.constexpr, V_CODES: tl.constexpr,
                        V_COL: tl.constexpr, V_ROW: tl.constexpr, V_ZERO: tl.constexpr):
    row = first_row + tl.program_id(0)
    j = tl.program_id(1)
    h = tl.program_id(2)
    if j * G < tl.load(seq_ptr + row):
        f = tl.load(nf_ptr + row)
        dd = tl.arange(0, D)
        tt = tl.arange(0, G)
        out = ((tl.load(off_ptr + row) + j).to(tl.int64) * G * H + h) * D  # + t * H * D
        if (j == 0) | (j > f):
            sid = tl.load(st_ptr + row.to(tl.int64) * st_stride + tl.where(j == 0, 0, j - f))
            base = side_ptr + sid.to(tl.int64) * (2 * H * G * D) + h * (G * D)
            rows = tt[:, None] * D + dd[None, :]
            tl.store(k_ptr + out + tt[:, None] * (H * D) + dd[None, :], tl.load(base + rows))
            tl.store(v_ptr + out + tt[:, None] * (H * D) + dd[None, :],
                     tl.load(base + H * G * D + rows))
        else:
            blk = tl.load(bt_ptr + row.to(tl.int64) * bt_stride + j)
            k, v = _decode_record(cache_u8, cache_f16, (blk.to(tl.int64) * H + h) * REC, G, D,
                                  KB, VB, K_COL, K_ZERO, K_ROW, V_CODES, V_COL, V_ROW, V_ZERO)
            tl.store(k_ptr + out + tt[None, :] * (H * D) + dd[:, None], k.to(tl.float16))
            tl.store(v_ptr + out + tt[:, None] * (H * D) + dd[None, :], v.to(tl.float16))


def materialize_rows(kv: PagedKV, first_row: int, num_rows: int, max_blocks: int,
                     block_table: torch.Tensor, side_table: torch.Tensor,
                     num_flushed: torch.Tensor, seq_lens: torch.Tensor,
                     scratch_offset: torch.Tensor, k_out: torch.Tensor,
                     v_out: torch.Tensor) -> None:
    """Every position of rows first_row .. first_row + num_rows - 1, in the rotated frame,
    into fp16 scratch blocks [N, G, H, D] (vLLM's paged NHD layout): logical block j of
    row b lands in scratch block scratch_offset[b] + j. The sink and the tail come from
    the side pool, blocks 1..F are dequantized from their records (the same view the
    decode kernel reads), so a prefill chunk attends over its context and itself."""
    p = kv.preset
    if num_rows == 0:
        return
    lay = p.layout(kv.head_dim)
    _materialize_kernel[(num_rows, max_blocks, kv.num_kv_heads)](
        first_row, block_table, block_table.stride(0), side_table, side_table.stride(0),
        num_flushed, seq_lens, scratch_offset, kv.cache, kv.cache.view(torch.float16),
        kv.side, k_out, v_out, H=kv.num_kv_heads, G=p.group, D=kv.head_dim,
        KB=p.key_bits, VB=p.value_bits, REC=lay.total, K_COL=lay.k_col_scale,
        K_ZERO=lay.k_zero, K_ROW=lay.k_row_scale, V_CODES=lay.v_codes,
        V_COL=lay.v_col_scale, V_ROW=lay.v_row_scale, V_ZERO=lay.v_zero, num_warps=8)
