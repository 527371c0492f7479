"""Code unpackers of the Triton decode kernel: uint8 -> exact fp16 codes.

On CUDA, inline PTX turns two codes into an fp16x2 word with one LOP3 and one HSUB2;
the portable path (the interpreter, other GPUs) computes the same fp16 values.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def u8_f16(x, m: tl.constexpr):
    """Portable twin of the PTX unpackers: byte & m as an exact fp16, via the bit pattern
    0x6400 | v = 1024 + v and an exact fp16 subtract (no int-to-float conversion)."""
    return ((x.to(tl.int16) & m) | 0x6400).to(tl.float16, bitcast=True) - 1024.0


def unpack_ptx(masks: tuple[int, ...]) -> str:
    """PTX for one uint8 -> fp16 unpacker, 4 bytes per call: prmt spreads the bytes into
    two fp16x2 words; per mask, an AND keeps the code's bits, an OR puts the exponent of
    1024 in and an exact HSUB2 takes 1024 off, so a pair of codes costs one LOP3 and one
    HSUB2. Output 2i is mask i over bytes 0 and 1, output 2i + 1 over bytes 2 and 3."""
    src = f"${2 * len(masks)}"
    lines = [".reg .b32 a, b, t, m;", "mov.b32 m, 0x64006400;",
             f"prmt.b32 a, {src}, 0, 0x4140;", f"prmt.b32 b, {src}, 0, 0x4342;"]
    for i, mask in enumerate(masks):
        for j, word in enumerate("ab"):
            lines += [f"and.b32 t, {word}, 0x{mask:04X}{mask:04X};", "or.b32 t, t, m;",
                      f"sub.rn.f16x2 ${2 * i + j}, t, m;"]
    return "{\n" + "\n".join(lines) + "\n}"


def unpack_constraints(masks: tuple[int, ...]) -> str:
    return "=r," * (2 * len(masks)) + "r"


NIBBLE_MASKS = (0x0F, 0xF0)
CRUMB_MASKS = (0x03, 0x0C, 0x30, 0xC0)
_NIBBLES_PTX = tl.constexpr(unpack_ptx(NIBBLE_MASKS))
_NIBBLES_CONSTRAINTS = tl.constexpr(unpack_constraints(NIBBLE_MASKS))
_CRUMBS_PTX = tl.constexpr(unpack_ptx(CRUMB_MASKS))
_CRUMBS_CONSTRAINTS = tl.constexpr(unpack_constraints(CRUMB_MASKS))


@triton.jit
def nibbles(x, USE_ASM: tl.constexpr):
    """uint8 -> (low nibble, 16 * high nibble) as exact fp16 (see unpack_ptx)."""
    if USE_ASM:
        lo, hi = tl.inline_asm_elementwise(
            asm=_NIBBLES_PTX, constraints=_NIBBLES_CONSTRAINTS, args=[x],
            dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        lo = u8_f16(x, 0x0F)
        hi = u8_f16(x, 0xF0)
    return lo, hi


@triton.jit
def crumbs(x, USE_ASM: tl.constexpr):
    """uint8 -> 4**u * (2-bit code u), u = 0..3, as exact fp16 (see unpack_ptx)."""
    if USE_ASM:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(
            asm=_CRUMBS_PTX, constraints=_CRUMBS_CONSTRAINTS, args=[x],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        c0 = u8_f16(x, 0x03)
        c1 = u8_f16(x, 0x0C)
        c2 = u8_f16(x, 0x30)
        c3 = u8_f16(x, 0xC0)
    return c0, c1, c2, c3
