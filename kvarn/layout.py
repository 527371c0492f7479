"""Paged KVarN cache layout, shared by the reference and the kernels.

Two pools per attention layer:

* ``cache``: uint8 ``[num_blocks, num_kv_heads, tile_bytes]``. One record per
  (block, KV head), contiguous, fields in the spec's order (see ``Preset.layout``).
  ``tile_bytes`` is a multiple of 128 for every preset and head dim, so every record
  starts 16-byte aligned with no padding. Page size per block = num_kv_heads * tile_bytes.
* ``side``: fp16 ``[num_side_blocks, 2 (K, V), num_kv_heads, G, D]``. Rotated rows that
  are not (yet) quantized: block 0 of every request (the attention sink, fp16 for the
  request's life) and the tail: the partial last block plus any full block whose tokens
  are not all committed (speculative tokens are never frozen into a record).

Per request b the kernels read:

* ``seq_lens[b]``: tokens including this step's query tokens;
* ``num_flushed[b]`` = F: logical blocks 1..F are records in ``cache``;
  block i lives at ``cache[block_table[b, i]]`` (column 0 is unused);
* ``side_table[b, 0]``: the sink's side block; ``side_table[b, 1 + j]``: logical block
  F + 1 + j of the tail.

A block is flushed (written as a record from its side block) at the end of every step
after which it is full, block 0 too; it is read as a record (counted in F) only once
every token of it is committed, so speculative rows are never read back quantized
(``sidepool`` keeps this bookkeeping).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .preset import Preset


@dataclass
class PagedKV:
    preset: Preset
    head_dim: int
    cache: torch.Tensor  # uint8 [num_blocks, H, tile_bytes]
    side: torch.Tensor  # fp16 [num_side_blocks, 2, H, G, D]

    @staticmethod
    def allocate(preset: Preset, head_dim: int, num_kv_heads: int, num_blocks: int,
                 num_side_blocks: int, device=None) -> PagedKV:
        rec = preset.tile_bytes(head_dim)
        cache = torch.zeros(num_blocks, num_kv_heads, rec, dtype=torch.uint8, device=device)
        side = torch.zeros(num_side_blocks, 2, num_kv_heads, preset.group, head_dim,
                           dtype=torch.float16, device=device)
        return PagedKV(preset, head_dim, cache, side)

    def __post_init__(self) -> None:
        rec = self.preset.tile_bytes(self.head_dim)
        if self.cache.dtype != torch.uint8 or self.cache.dim() != 3 or self.cache.shape[2] != rec:
            raise ValueError(f"cache must be uint8 [blocks, heads, {rec}], "
                             f"got {self.cache.dtype} {tuple(self.cache.shape)}")
        want = (2, self.cache.shape[1], self.preset.group, self.head_dim)
        if self.side.dtype != torch.float16 or tuple(self.side.shape[1:]) != want:
            raise ValueError(f"side pool must be fp16 [blocks, {', '.join(map(str, want))}], "
                             f"got {self.side.dtype} {tuple(self.side.shape)}")
        if not (self.cache.is_contiguous() and self.side.is_contiguous()):
            raise ValueError("cache and side pool must be contiguous")

    @property
    def num_kv_heads(self) -> int:
        return self.cache.shape[1]

    @staticmethod
    def check_ids(ids: torch.Tensor, bound: int, what: str) -> None:
        ids = ids.reshape(-1)
        bad = (ids < 0) | (ids >= bound)
        if bool(bad.any()):
            raise IndexError(f"{what} {int(ids[bad][0])} is outside [0, {bound})")

    def check_tables(self, block_table: torch.Tensor, side_table: torch.Tensor,
                     seq_lens: torch.Tensor, num_flushed: torch.Tensor, query_len: int) -> None:
        """Host-side validation of the per-request tables (syncs; for the reference and
        the kernels' debug mode)."""
        g = self.preset.group
        for b in range(seq_lens.shape[0]):
            L, F = int(seq_lens[b]), int(num_flushed[b])
            if query_len > L:
                raise ValueError(f"request {b}: seq_len {L} < query_len {query_len}")
            # Records may hold query positions too: a prefix hit's last token is
            # recomputed into a block that is already a record.
            if F < 0 or (F > 0 and (F + 1) * g > L):
                raise ValueError(f"request {b}: {F} flushed blocks cover {(F + 1) * g} "
                                 f"positions, the row has only {L}")
            if block_table.shape[1] <= F:
                raise IndexError(f"request {b}: {F} flushed blocks exceed block table "
                                 f"width {block_table.shape[1]}")
            self.check_ids(block_table[b, 1:F + 1], self.cache.shape[0],
                           f"request {b}: block table entry")
            n_tail = max(0, (L + g - 1) // g - F - 1)
            if 1 + n_tail > side_table.shape[1]:
                raise IndexError(f"request {b}: needs {1 + n_tail} side table columns, "
                                 f"width is {side_table.shape[1]}")
            self.check_ids(side_table[b, :1 + n_tail], self.side.shape[0],
                           f"request {b}: side table entry")
