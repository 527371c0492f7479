"""Triton dequantize-to-fp16 of whole records, for chunked-prefill continuation.

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
    out = (n.to(tl.int64) * G * H + h) * D  # row t of block n, head h: + t * H * D
    tl.store(k_ptr + out + tt[None, :] * (H * D) + dd[:, None], k.to(tl.float16))
    tl.store(v_ptr + out + tt[:, None] * (H * D) + dd[None, :], v.to(tl.float16))


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
