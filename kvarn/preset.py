"""KVarN presets: bit widths, tile length and the byte layout of one tile record."""
from __future__ import annotations

from dataclasses import dataclass

HEAD_DIMS = (64, 128, 256, 512)


@dataclass(frozen=True)
class RecordLayout:
    """Byte offsets of the fields of one (block, KV head) record, in spec order."""

    k_codes: int
    k_col_scale: int  # fp16 [D]: K step folded with the channel scale
    k_zero: int  # fp16 [D]
    k_row_scale: int  # fp16 [G]: per-token scale
    v_codes: int
    v_col_scale: int  # fp16 [D]: per-channel scale
    v_row_scale: int  # fp16 [G]: V step folded with the token scale
    v_zero: int  # fp16 [G]
    total: int


@dataclass(frozen=True)
class Preset:
    name: str
    key_bits: int
    value_bits: int
    group: int

    @staticmethod
    def names() -> tuple[str, ...]:
        return tuple(_PRESETS)

    @staticmethod
    def parse(name: str) -> Preset:
        try:
            return _PRESETS[name]
        except KeyError:
            raise ValueError(
                f"unknown KVarN preset {name!r}; valid presets: {', '.join(_PRESETS)}"
            ) from None

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim not in HEAD_DIMS:
            raise ValueError(
                f"{self.name}: head_dim {head_dim} is not supported; allowed: {HEAD_DIMS}"
            )

    def layout(self, head_dim: int) -> RecordLayout:
        self.check_head_dim(head_dim)
        d, g = head_dim, self.group
        off = 0
        fields = {}
        for field, size in (
            ("k_codes", d * g * self.key_bits // 8),
            ("k_col_scale", 2 * d),
            ("k_zero", 2 * d),
            ("k_row_scale", 2 * g),
            ("v_codes", g * d * self.value_bits // 8),
            ("v_col_scale", 2 * d),
            ("v_row_scale", 2 * g),
            ("v_zero", 2 * g),
        ):
            fields[field] = off
            off += size
        return RecordLayout(total=off, **fields)

    def tile_bytes(self, head_dim: int) -> int:
        """D*G*(Kb+Vb)/8 + 6*(D+G). Always a multiple of 128 for the supported D and G,
        so records need no padding and every record starts 16-byte aligned."""
        return self.layout(head_dim).total

    def bytes_per_token(self, head_dim: int) -> int:
        """Bytes per token per KV head: D*(Kb+Vb)/8 + 6*(D+G)/G (exact for all presets)."""
        return self.tile_bytes(head_dim) // self.group


# Insertion order matters: the first preset is the default.
_PRESETS = {
    p.name: p
    for p in (
        Preset("kvarn_k4v2_g128", 4, 2, 128),
        Preset("kvarn_k4v4_g128", 4, 4, 128),
        Preset("kvarn_k4v2_g64", 4, 2, 64),
        Preset("kvarn_k4v4_g64", 4, 4, 64),
    )
}
DEFAULT_PRESET = "kvarn_k4v2_g128"
