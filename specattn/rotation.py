"""The randomized Hadamard transform (RHT) of upstream's int4_per_token_head cache.

Upstream rotates every K and V row before it quantizes it to 4 bits, and the query
before it reads them: ``x' = H (s * x)`` with ``H`` the unnormalized Sylvester Hadamard
matrix of order ``b`` and ``s`` a fixed +-1 vector, applied block-diagonally over the
``head_size / b`` blocks of a row, ``b`` the largest power of two dividing
``head_size``. ``H H = b I``, so ``q' . k' = b (q . k)`` and ``x = s * (H x') / b``.

``s`` is part of the stored format (a cache written by upstream is only readable with
the same signs): ``b`` Bernoulli(0.5) draws of a CPU ``torch.Generator`` seeded with
0x9E3779B9, mapped to -1/+1.
"""
from __future__ import annotations

import torch

# kvarn is this package's sibling: both are top-level packages in the repository (where
# the tests import them) and vllm.kvarn, vllm.specattn in the wheel (kiln/build/wheel.py).
if __name__.startswith("vllm."):
    from ..kvarn.hadamard import sylvester
else:
    from kvarn.hadamard import sylvester

SIGN_SEED = 0x9E3779B9

_MATRICES: dict[tuple[int, str], torch.Tensor] = {}


def block_order(head_size: int) -> int:
    """b: the largest power of two that divides head_size."""
    if head_size < 1:
        raise ValueError(f"head_size must be positive, got {head_size}")
    return head_size & -head_size


def signs(order: int) -> torch.Tensor:
    """The format's +-1 vector of length ``order`` (float32, CPU)."""
    gen = torch.Generator(device="cpu").manual_seed(SIGN_SEED)
    draws = torch.bernoulli(torch.full((order,), 0.5), generator=gen)
    return draws * 2.0 - 1.0


def rotation_matrix(head_size: int) -> torch.Tensor:
    """R [head_size, head_size] with x' = R x (block-diagonal H diag(s)), float32 CPU."""
    b = block_order(head_size)
    block = sylvester(b) * signs(b)[None, :]
    return torch.block_diag(*([block] * (head_size // b)))


def kernel_rotation(head_size: int, device: torch.device | str) -> torch.Tensor:
    """The verify kernel's operand: R's even rows then its odd rows, float32
    ``[2, head_size / 2, head_size]``, cached per (head_size, device). The kernel turns
    q into the two nibble streams of q' with it and rotates its output back."""
    key = (head_size, str(torch.device(device)))
    m = _MATRICES.get(key)
    if m is None:
        r = rotation_matrix(head_size)
        m = torch.stack([r[0::2], r[1::2]]).contiguous().to(device)
        _MATRICES[key] = m
    return m
