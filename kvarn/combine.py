"""Split-K merge of the decode kernels: each query row's per-part outputs, weighted by
their log-sum-exps (exp2 domain). Shared by the KVarN decode and the fp16 baseline of
bench/kvarn_decode.py, so the benchmark compares the same merge."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["PARTS"])
def _combine_kernel(o_ptr, lse_ptr, out_ptr, PARTS, D: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ss = tl.arange(0, BLOCK_S)
    dd = tl.arange(0, D)
    lse = tl.load(lse_ptr + row * PARTS + ss, mask=ss < PARTS, other=float("-inf"))
    # A part that saw no position has lse -inf and weight 0; a row that no part saw is
    # zeros (as each part writes it), not the NaN of exp2((-inf) - (-inf)).
    top = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    o = tl.load(o_ptr + (row * PARTS + ss)[:, None] * D + dd[None, :],
                mask=(ss < PARTS)[:, None], other=0.0)
    total = tl.sum(w, 0)
    merged = tl.sum(o * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * D + dd, merged.to(out_ptr.dtype.element_ty))


def combine(o: torch.Tensor, lse: torch.Tensor, parts: int, out: torch.Tensor) -> torch.Tensor:
    """o fp32 [rows * parts, D] and lse fp32 [rows * parts] (a row's parts adjacent,
    lse in log2 units) -> out [rows, D], in out's dtype. Launches only (no host sync)."""
    rows, d = out.shape
    if o.shape != (rows * parts, d) or lse.shape != (rows * parts,):
        raise ValueError(f"o must be [{rows * parts}, {d}] and lse [{rows * parts}] for "
                         f"{rows} rows of {parts} parts, got {tuple(o.shape)} and "
                         f"{tuple(lse.shape)}")
    _combine_kernel[(rows,)](o, lse, out, parts, D=d, BLOCK_S=triton.next_power_of_2(parts))
    return out
