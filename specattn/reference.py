"""Plain torch fp32 reference of the verify attention, and writers of every cache mode.

Clarity over speed: gather a request's pages through its block table, dequantize them
(rotating INT4 rows back), and run causal softmax attention in float32 with GQA by
repetition. The writers (``quantize``) make test caches in upstream's layouts; how a
value is rounded when written does not matter to the reader, which is what is tested.
"""
from __future__ import annotations

import torch

from .cache import Mode, PagedCache
from .rotation import block_order, rotation_matrix

FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0
INT4_LEVELS = 15.0


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x' = R x along the last dim, float32 (the INT4 format's forward transform)."""
    r = rotation_matrix(x.shape[-1]).to(x.device)
    return x.float() @ r.T


def unrotate(x: torch.Tensor) -> torch.Tensor:
    """The inverse of ``rotate``: R R^T = b I."""
    d = x.shape[-1]
    r = rotation_matrix(d).to(x.device)
    return (x.float() @ r) / block_order(d)


# --------------------------------------------------------------------------- writers


def quantize(mode: Mode, x: torch.Tensor, entry_dtype: torch.dtype | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows x [..., D] (float) -> (entries, scales) as the cache of ``mode`` stores them.

    PLAIN: entries of ``entry_dtype`` (bf16 or fp16), no scales. FP8: e4m3 codes and one
    float32 scale (1 element). PER_TOKEN_HEAD: int8 (or, with entry_dtype fp8, e4m3) codes
    and a float32 scale per row. INT4: uint8 [..., D / 2] nibbles of the rotated row and a
    float32 scale per row carrying the zero point in its 4 low mantissa bits.
    """
    x = x.float()
    if mode == Mode.PLAIN:
        return x.to(entry_dtype or torch.bfloat16), None
    if mode == Mode.FP8:
        scale = (x.abs().amax() / FP8_MAX).clamp_min(1e-8)
        return (x / scale).to(torch.float8_e4m3fn), scale.reshape(1)
    if mode == Mode.PER_TOKEN_HEAD:
        fp8 = entry_dtype == torch.float8_e4m3fn
        top = FP8_MAX if fp8 else INT8_MAX
        scale = (x.abs().amax(-1) / top).clamp_min(1e-8)
        y = x / scale[..., None]
        codes = y.to(torch.float8_e4m3fn) if fp8 else y.round().clamp(-127, 127).to(torch.int8)
        return codes, scale
    if mode == Mode.INT4:
        xr = rotate(x)
        lo, hi = xr.amin(-1), xr.amax(-1)
        scale = ((hi - lo) / INT4_LEVELS).clamp_min(1e-6)
        zp = (-lo / scale).round().clamp(0, 15)
        u = (xr / scale[..., None] + zp[..., None]).round().clamp(0, 15).to(torch.uint8)
        packed = u[..., 0::2] | (u[..., 1::2] << 4)
        bits = (scale.view(torch.int32) & ~0xF) | zp.to(torch.int32)
        return packed, bits.view(torch.float32)
    raise ValueError(f"unknown cache mode {mode!r}")


def dequantize(mode: Mode, entries: torch.Tensor, scales: torch.Tensor | None,
               head_size: int) -> torch.Tensor:
    """The float32 rows [..., head_size] that entries (+ scales) stand for."""
    if mode == Mode.PLAIN:
        return entries[..., :head_size].float()
    if mode == Mode.FP8:
        return entries[..., :head_size].float() * scales.reshape(())
    if mode == Mode.PER_TOKEN_HEAD:
        return entries[..., :head_size].float() * scales[..., None]
    if mode == Mode.INT4:
        packed = entries[..., : head_size // 2].to(torch.int32)
        u = torch.stack([packed & 0xF, packed >> 4], -1).flatten(-2).float()
        bits = scales.view(torch.int32)
        zp = (bits & 0xF).float()
        scale = (bits & ~0xF).view(torch.float32)
        return unrotate((u - zp[..., None]) * scale[..., None])
    raise ValueError(f"unknown cache mode {mode!r}")


# --------------------------------------------------------------------------- attention


def gather(cache: PagedCache, block_row: torch.Tensor, length: int, head_size: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one request's first ``length`` tokens, float32 [length, H_kv, D]."""
    pos = torch.arange(length, device=cache.key.device)
    blocks = block_row.long()[pos // cache.block_size]
    slots = pos % cache.block_size
    out = []
    for entries, scale in ((cache.key, cache.k_scale), (cache.value, cache.v_scale)):
        rows = entries[blocks, slots]
        per_row = scale[blocks, slots] if cache.mode in (Mode.PER_TOKEN_HEAD, Mode.INT4) else scale
        out.append(dequantize(cache.mode, rows, per_row, head_size))
    return out[0], out[1]


def verify_attention(q: torch.Tensor, cache: PagedCache, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                     sm_scale: float, q_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of every request's query tokens (the last ``q_len`` positions of
    its ``seq_len``) over its paged cache: float32 [num_tokens, H_q, D]."""
    num_tokens, hq, d = q.shape
    qf = q.float() * (q_scale.float().reshape(()) if q_scale is not None else 1.0)
    out = torch.zeros(num_tokens, hq, d, dtype=torch.float32, device=q.device)
    for b in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        n, length = end - start, int(seq_lens[b])
        if n == 0:
            continue
        k, v = gather(cache, block_table[b], length, d)
        gqa = hq // k.shape[1]
        k = k.repeat_interleave(gqa, 1)
        v = v.repeat_interleave(gqa, 1)
        s = torch.einsum("qhd,lhd->hql", qf[start:end], k) * sm_scale
        pos = length - n + torch.arange(n, device=q.device)
        visible = torch.arange(length, device=q.device)[None, :] <= pos[:, None]
        s = s.masked_fill(~visible[None], float("-inf"))
        out[start:end] = torch.einsum("hql,lhd->qhd", s.softmax(-1), v)
    return out
