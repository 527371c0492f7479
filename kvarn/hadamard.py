"""The Sylvester Hadamard matrix: the one builder behind KVarN's rotation (``rotate``,
``reference``) and the randomized Hadamard transform of ``specattn.rotation``."""
from __future__ import annotations

import torch


def sylvester(order: int) -> torch.Tensor:
    """Unnormalized Sylvester Hadamard matrix H of a power-of-two order: +-1 entries,
    float32 on the CPU (exact), symmetric, H H = order * I."""
    if order < 1 or order & (order - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two order "
                         f"(a head dim or a block of one), got {order}")
    h = torch.ones(1, 1)
    while h.shape[0] < order:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h
