"""The paged KV caches the verify kernel reads: upstream vLLM's TRITON_ATTN layouts.

Upstream (0.32.0, ``backends/triton_attn.py``) stores one layer's cache as a logical
``[num_blocks, num_kv_heads, block_size, 2 * C]`` tensor and hands its kernels the views
``key, value = cache.transpose(1, 2).split(C, dim=-1)``: ``[num_blocks, block_size,
num_kv_heads, C]`` each, with whatever strides the resolved layout gives. The kernels
here take exactly those views, so they read the cache in place:

* ``BF16`` / ``FP16``: ``C = head_size`` elements of the model dtype.
* ``FP8``: ``C = head_size`` fp8 e4m3 codes and one float32 scale per tensor (K and V
  each; ``x = code * scale``), as ``--kv-cache-dtype fp8`` keeps them on the layer.
* ``INT8_PTH`` / ``FP8_PTH`` (``int8_per_token_head`` / ``fp8_per_token_head``):
  ``C = head_size + pad`` where the ``pad`` bytes after each head's codes hold its
  float32 scale (``x = code * scale``); the scales are read through float32 views
  ``[num_blocks, block_size, num_kv_heads]`` of those bytes.
* ``INT4_PTH`` (``int4_per_token_head``): ``C = head_size / 2 + 4`` bytes: byte ``j``
  holds element ``2j`` in its low nibble and ``2j + 1`` in its high nibble, codes
  ``u`` in 0..15 of the rotated row ``x' = (u - zp) * scale``; the float32 scale keeps
  its 4-bit zero point ``zp`` in its 4 lowest mantissa bits. Rows are rotated by the
  randomized Hadamard transform of ``rotation.py`` before they are quantized.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class Mode(enum.IntEnum):
    """How the kernel turns cache entries into K and V (a constexpr of the kernel)."""

    PLAIN = 0  # bf16 / fp16 entries
    FP8 = 1  # fp8 e4m3 codes, one scale per tensor
    PER_TOKEN_HEAD = 2  # int8 or fp8 codes, one float32 scale per (token, head)
    INT4 = 3  # packed nibbles of rotated rows, scale + zero point per (token, head)


# ``--kv-cache-dtype`` names (upstream's) and the mode each one reads as.
CACHE_DTYPES = {
    "auto": Mode.PLAIN,
    "bfloat16": Mode.PLAIN,
    "float16": Mode.PLAIN,
    "fp8": Mode.FP8,
    "fp8_e4m3": Mode.FP8,
    "int8_per_token_head": Mode.PER_TOKEN_HEAD,
    "fp8_per_token_head": Mode.PER_TOKEN_HEAD,
    "int4_per_token_head": Mode.INT4,
}

_ENTRY_DTYPES = {
    Mode.PLAIN: (torch.bfloat16, torch.float16),
    Mode.FP8: (torch.float8_e4m3fn,),
    Mode.PER_TOKEN_HEAD: (torch.int8, torch.float8_e4m3fn),
    Mode.INT4: (torch.uint8,),
}


@dataclass(frozen=True)
class PagedCache:
    """One layer's K and V views ``[num_blocks, block_size, num_kv_heads, C]`` and their
    scales: per tensor (FP8: 1-element float32 tensors), per (token, head) (float32
    ``[num_blocks, block_size, num_kv_heads]``), or none (PLAIN)."""

    mode: Mode
    key: torch.Tensor
    value: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        return self.key.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.key.shape[2]

    def check(self, head_size: int) -> None:
        """Raise ValueError naming what does not fit the mode (cheap: shapes only)."""
        mode = Mode(self.mode)
        for name, t in (("key", self.key), ("value", self.value)):
            if t.dim() != 4:
                raise ValueError(f"{name} cache must be [num_blocks, block_size, "
                                 f"num_kv_heads, C], got shape {tuple(t.shape)}")
            if t.dtype not in _ENTRY_DTYPES[mode]:
                raise ValueError(f"{mode.name} {name} cache entries must be one of "
                                 f"{[str(d) for d in _ENTRY_DTYPES[mode]]}, got {t.dtype}")
            if t.stride(3) != 1:
                raise ValueError(f"{name} cache: the last dim must be contiguous, got "
                                 f"strides {t.stride()}")
            need = head_size // 2 if mode == Mode.INT4 else head_size
            if t.shape[3] < need:
                raise ValueError(f"{mode.name} {name} cache holds {t.shape[3]} entries per "
                                 f"head, head_size {head_size} needs {need}")
        if self.key.shape[:3] != self.value.shape[:3]:
            raise ValueError(f"key and value caches differ: {tuple(self.key.shape)} vs "
                             f"{tuple(self.value.shape)}")
        if mode == Mode.INT4 and head_size % 2:
            raise ValueError(f"INT4 packs two elements per byte: head_size {head_size} "
                             "must be even")
        if mode == Mode.PLAIN:
            if self.k_scale is not None or self.v_scale is not None:
                raise ValueError("PLAIN caches take no scales")
            return
        for name, s in (("k_scale", self.k_scale), ("v_scale", self.v_scale)):
            if s is None or s.dtype != torch.float32:
                raise ValueError(f"{mode.name} needs a float32 {name}, got "
                                 f"{None if s is None else s.dtype}")
            if mode == Mode.FP8 and s.numel() != 1:
                raise ValueError(f"FP8 scales are per tensor (1 element); {name} has "
                                 f"{s.numel()}")
            if mode != Mode.FP8 and tuple(s.shape) != tuple(self.key.shape[:3]):
                raise ValueError(f"{mode.name} {name} must be [num_blocks, block_size, "
                                 f"num_kv_heads] = {tuple(self.key.shape[:3])}, got "
                                 f"{tuple(s.shape)}")
