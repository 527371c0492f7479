"""Triton helpers shared by the kernels that read records."""
import triton
import triton.language as tl


@triton.jit
def unpack(packed, ROWS: tl.constexpr, NB: tl.constexpr, BITS: tl.constexpr):
    """uint8 [ROWS, NB] -> int32 codes [ROWS, NB * 8 / BITS], low bits first."""
    PER: tl.constexpr = 8 // BITS
    shifts = tl.arange(0, PER) * BITS
    c = (packed.to(tl.int32)[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(c, (ROWS, NB * PER))


@triton.jit
def checked(idx, bound, err_ptr, DEBUG: tl.constexpr):
    """In debug mode, flag an out-of-range id and read block 0 instead of faulting."""
    if DEBUG:
        bad = (idx < 0) | (idx >= bound)
        tl.atomic_max(err_ptr, tl.where(bad, 1, 0))
        idx = tl.where(bad, 0, idx)
    return idx
