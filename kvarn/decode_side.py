"""The fp16 part of the decode kernels: a request's side-pool blocks (the sink, logical
block 0, then the tail from logical block F + 1), walked in sub-tiles of TS tokens, one
online-softmax step each, every query row masked at its own causal limit."""
from __future__ import annotations

import triton
import triton.language as tl

from ._triton_common import checked


@triton.jit
def _fp16_v_part(acc, alpha, p16, vbase, tt, U: tl.constexpr, VPER: tl.constexpr,
                 D: tl.constexpr):
    """Channels VPER*i + U (the accumulators interleave channels as the V codes do)."""
    v = tl.load(vbase + tt[:, None] * D + VPER * tl.arange(0, D // VPER)[None, :] + U)
    return acc * alpha[:, None] + tl.dot(p16, v)


@triton.jit
def side_pool_blocks(acc0, acc1, acc2, acc3, m_i, l_i, q, side_ptr, st_row, L, F, st_width,
                     limit, h, n_side, err_ptr, qk_scale, H: tl.constexpr, G: tl.constexpr,
                     D: tl.constexpr, TS: tl.constexpr, VPER: tl.constexpr,
                     DEBUG: tl.constexpr):
    """Attend the fp16 query q [rows, D] over the side blocks listed at st_row, on top of
    the running state (accumulators, max m_i, denominator l_i) in the exp2 domain."""
    dd = tl.arange(0, D)
    # Bounded by the table, so a dummy run's arbitrary lengths read only its zeros.
    n_fp = tl.minimum(tl.cdiv(L, G) - F, st_width)
    for j in range(0, n_fp):
        logical = tl.where(j == 0, 0, F + j)
        sid = checked(tl.load(st_row + j), n_side, err_ptr, DEBUG)
        base = side_ptr + sid.to(tl.int64) * (2 * H * G * D) + h * (G * D)
        vbase = base + H * G * D
        for c in tl.static_range(G // TS):
            tt = c * TS + tl.arange(0, TS)
            k = tl.load(base + tt[None, :] * D + dd[:, None])  # [D, TS]
            sc = tl.dot(q, k) * qk_scale
            sc = tl.where((logical * G + tt)[None, :] < limit[:, None], sc, float("-inf"))
            # A row that has seen no position yet (a dummy run may pass seq_len < query
            # len) keeps m_i at -inf through a fully masked sub-tile, and exp2 of
            # (-inf) - (-inf) is NaN: its reference max is taken as 0 (its p are all 0).
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_ref)
            p = tl.exp2(sc - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            p16 = p.to(tl.float16)
            acc0 = _fp16_v_part(acc0, alpha, p16, vbase, tt, 0, VPER, D)
            acc1 = _fp16_v_part(acc1, alpha, p16, vbase, tt, 1, VPER, D)
            if VPER == 4:
                acc2 = _fp16_v_part(acc2, alpha, p16, vbase, tt, 2, VPER, D)
                acc3 = _fp16_v_part(acc3, alpha, p16, vbase, tt, 3, VPER, D)
            m_i = m_new
    return acc0, acc1, acc2, acc3, m_i, l_i
