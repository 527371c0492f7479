"""Triton Hadamard rotation: rotate-and-stage for new K/V rows, and plain rotation of
queries (into the rotated frame) and attention outputs (back out of it).

Reference: ``reference.rotate_rows`` (stage) and ``x @ reference.hadamard(D)``.
The rotation is a dot with the exact +-1 matrix in fp16 (products are exact, fp32
accumulation) times 1/sqrt(D), so it costs no precision beyond the fp16 input cast.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .hadamard import sylvester
from .layout import PagedKV

FP16_MAX = tl.constexpr(65504.0)  # Triton kernels may only read constexpr globals


@functools.cache
def hadamard_pm1(head_dim: int, device: torch.device) -> torch.Tensor:
    """Sylvester Hadamard matrix with +-1 entries, fp16 (exact)."""
    return sylvester(head_dim).to(device=device, dtype=torch.float16).contiguous()


@triton.jit
def _rotate_kernel(x_ptr, h_ptr, y_ptr, slot_ptr, count_ptr, n_rows, inv_sqrt_d,
                   D: tl.constexpr, HEADS: tl.constexpr, G: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   STAGE: tl.constexpr, SPLIT_LO: tl.constexpr, COUNT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < n_rows
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    nbad = 0
    for k0 in tl.static_range(0, D, BK):
        ks = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * D + ks[None, :],
                    mask=row_ok[:, None], other=0.0).to(tl.float32)
        if COUNT:
            nbad += tl.sum(((x != x) | (tl.abs(x) > FP16_MAX)).to(tl.int32))
        x = tl.clamp(tl.where(x != x, 0.0, x), -FP16_MAX, FP16_MAX)
        hm = tl.load(h_ptr + ks[:, None] * D + cols[None, :])
        hi = x.to(tl.float16)
        acc = tl.dot(hi, hm, acc)
        if SPLIT_LO:
            # fp32 inputs: the fp16 residual keeps the rotation close to fp32 accuracy.
            acc = tl.dot((x - hi.to(tl.float32)).to(tl.float16), hm, acc)
    y = acc * inv_sqrt_d
    if COUNT:
        nbad = tl.where(pid_n == 0, nbad, 0)  # input elements are seen once per column block
        nbad += tl.sum((row_ok[:, None] & (tl.abs(y) > FP16_MAX)).to(tl.int32))
        tl.atomic_add(count_ptr, nbad)
    y = tl.clamp(y, -FP16_MAX, FP16_MAX)
    if STAGE:
        # Row n is token n // HEADS, KV head n % HEADS; slot = side_block * G + row.
        slot = tl.load(slot_ptr + rows // HEADS, mask=row_ok, other=-1).to(tl.int64)
        head = rows % HEADS
        dst = (slot // G) * (2 * HEADS * G * D) + head * (G * D) + (slot % G) * D
        tl.store(y_ptr + dst[:, None] + cols[None, :], y.to(tl.float16),
                 mask=(row_ok & (slot >= 0))[:, None])
    else:
        tl.store(y_ptr + rows[:, None].to(tl.int64) * D + cols[None, :],
                 y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None])


def _launch(x2d: torch.Tensor, y: torch.Tensor, slots: torch.Tensor | None,
            count: torch.Tensor | None, heads: int, group: int) -> None:
    n, d = x2d.shape
    bm = 32
    bn = min(d, 128)
    grid = (triton.cdiv(n, bm), d // bn)
    dummy = count if count is not None else x2d
    _rotate_kernel[grid](
        x2d, hadamard_pm1(d, x2d.device), y, slots if slots is not None else dummy,
        count if count is not None else dummy, n, d ** -0.5,
        D=d, HEADS=heads, G=group, BM=bm, BN=bn, BK=min(d, 64),
        STAGE=slots is not None,
        # staging follows the spec (cast to fp16, then rotate); other callers keep fp32
        SPLIT_LO=slots is None and x2d.dtype != torch.float16,
        COUNT=count is not None, num_warps=4)


def rotate(x: torch.Tensor, out_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """x [..., D] -> x @ H/sqrt(D) (H symmetric, self-inverse: the same call rotates back)."""
    d = x.shape[-1]
    x2d = x.reshape(-1, d).contiguous()
    y = torch.empty(x2d.shape, dtype=out_dtype, device=x.device)
    _launch(x2d, y, None, None, 1, 1)
    return y.reshape(x.shape)


def rotate_and_stage(key: torch.Tensor, value: torch.Tensor, kv: PagedKV,
                     slot_mapping: torch.Tensor, clamp_count: torch.Tensor) -> None:
    """Rotate new rows key/value [T, H, D] (any float dtype) into the fp16 side pool.

    slot_mapping [T]: side_block * G + row; negative slots (padding) are skipped.
    NaN becomes 0 and values beyond fp16 range are clamped, before and after rotation;
    each changed element adds 1 to clamp_count (int32 [1], on device, never synced).
    """
    t, h, d = key.shape
    if (h, d) != (kv.num_kv_heads, kv.head_dim) or value.shape != key.shape:
        raise ValueError(f"key/value must be [T, {kv.num_kv_heads}, {kv.head_dim}], "
                         f"got {tuple(key.shape)} and {tuple(value.shape)}")
    if clamp_count.dtype != torch.int32 or clamp_count.numel() != 1:
        raise ValueError("clamp_count must be an int32 tensor with one element")
    slots = slot_mapping.to(torch.int64).contiguous()
    for which, x in enumerate((key, value)):
        _launch(x.reshape(t * h, d).contiguous(), kv.side[:, which], slots, clamp_count,
                h, kv.preset.group)
